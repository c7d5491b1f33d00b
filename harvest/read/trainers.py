"""The drafter trainers `harvest export` writes for, by name (imports nothing heavy: the CLI
draws its choices from here without importing torch)."""

from __future__ import annotations

# Export format -> the trainer (and version) whose own reader the export is checked with (tests/system/test_trainers.py).
TRAINER_NAMES = {"specforge": "SpecForge 0.2.0", "speculators": "speculators 0.9.0"}
EXPORT_FORMATS = tuple(TRAINER_NAMES)
