"""The drafter trainers `harvest export` writes for, by name (imports nothing heavy: the CLI
draws its choices from here without importing torch)."""

from __future__ import annotations

# specforge: SpecForge's offline-data `.ckpt` per sample; speculators: speculators' `.safetensors` per sample.
EXPORT_FORMATS = ("specforge", "speculators")
