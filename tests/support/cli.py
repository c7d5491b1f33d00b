"""The repository root, and the real `harvest` CLI run in a subprocess as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def harvest_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `harvest` CLI in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
