"""The repository root, and the real `harvest` CLI run in a subprocess as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def harvest_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `harvest` CLI in a subprocess, as a user would.

    In a process group of its own: if the test gives up on it (the timeout, a failure, pytest's own
    timeout), everything it started goes too; a `harvest run` killed alone would leave its engine
    and workers running, and on a shared machine they slow every test after it."""
    argv = [sys.executable, "-m", "harvest.cli", *args]
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p)
        stdout, stderr = p.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
    finally:
        if p.poll() is None:
            kill_group(p)
            p.wait()
    return subprocess.CompletedProcess(argv, p.returncode, stdout, stderr)


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL `p` and every process of its group (one started with start_new_session=True)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
