"""The drafter trainers `harvest export` writes for, by name, and the error of an export that
cannot serve one (imports nothing heavy: the CLI draws its choices from here without importing
torch)."""

from __future__ import annotations

from harvest.errors import ConfigurationError

# Export format -> the trainer (and version) whose own reader the export is checked with (tests/system/test_trainers.py).
TRAINER_NAMES = {"specforge": "SpecForge 0.2.0", "speculators": "speculators 0.9.0"}
EXPORT_FORMATS = tuple(TRAINER_NAMES)


class ExportError(ConfigurationError, ValueError):
    """An export that cannot give its trainer what it reads, or a DEST that holds something other
    than this run's export; the message names the fix."""
