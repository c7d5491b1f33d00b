"""Waiting in tests without fixed sleeps: poll a condition (a line in a process's output, a file,
a Redis state) until it holds, bounded by a deadline, and fail naming what was waited for."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float, what: str, poll: float = 0.1):
    """Return `pred()`'s first truthy value; raise AssertionError naming `what` once `timeout` s pass.

    A functional deadline, not a timing assertion: pick it generously (the suite runs on loaded
    2-core machines, with several tests in parallel)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(poll)


class OutputReader:
    """Collects a process's piped text output in a thread, so a test can wait for a line in it
    while the process runs and still read all of it at the end."""

    def __init__(self, stream) -> None:
        self._parts: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.readline(), ""):
            with self._lock:
                self._parts.append(chunk)

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)

    def wait_for(self, pred: Callable[[str], object], timeout: float, what: str, proc: subprocess.Popen | None = None):
        """Wait until `pred(output so far)` holds; fail at once, with the output, if `proc` exits first."""

        def check():
            v = pred(self.text)
            if not v and proc is not None and proc.poll() is not None:
                self._thread.join(5)
                v = pred(self.text)
                assert v, f"exited with status {proc.returncode} before {what}:\n{self.text[-3000:]}"
            return v

        return wait_for(check, timeout, what, poll=0.05)

    def close(self, timeout: float = 20) -> str:
        """Wait for the stream's end (the process closed it); return everything read."""
        self._thread.join(timeout)
        return self.text
