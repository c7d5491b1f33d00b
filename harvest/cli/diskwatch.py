"""`harvest run` on a filling disk: pause before it is full, go on once there is room again.

The work dir holds the spool (every verified sample until its shard is committed) and the
private Redis's append-only file; both grow while the run goes on. A full filesystem there used
to end the run in bare `OSError: [Errno 28]` lines from every child and a private Redis that
died with it. Now the runner looks at the work dir's filesystem every few seconds: below
`--min-free-mb` it stops the workers (each finishes its job; nothing more is spooled), says once
what is full and what fills it, and starts them again when free space is back above the mark
(with a margin, so it does not flap). The collector goes on meanwhile (committing frees the
spool), and a child that keeps dying while the run is paused does not end it. Ctrl-C stops a
paused run as any other.

A disk can fill faster than the look every few seconds, to the last byte. Then the runner's own
writes there meet ENOSPC (or EDQUOT) too, and none of them ends the run: supervisor.log keeps its
lines in memory until they fit (harvest.cli.supervisor `note`), a child whose log cannot be
opened runs with its output dropped, the lock file keeps its last holder's line
(harvest.cli.workdir); the pause comes at the next look, and the run goes on once space returns.
"""

from __future__ import annotations

import os
import time

RESUME_FACTOR = 1.5  # resume once free space is this many times the mark


def filesystem_of(path: str) -> str:
    """The mount point of the filesystem holding `path`."""
    p = os.path.realpath(path)
    while not os.path.ismount(p):
        p = os.path.dirname(p)
    return p


def tree_bytes(path: str) -> int:
    """The bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(d, n)).st_size
            except OSError:
                pass
    return total


def mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class DiskWatch:
    """Free space of the work dir's filesystem, asked at most every `interval` seconds."""

    def __init__(self, work: str, spool: str, redis_dir: str | None, min_free: int, interval: float = 2.0) -> None:
        self.work, self.spool, self.redis_dir, self.min_free, self.interval = work, spool, redis_dir, min_free, interval
        self.paused = False
        self._next = 0.0

    def free(self) -> int:
        st = os.statvfs(self.work)
        return st.f_bavail * st.f_frsize

    def full(self) -> bool:
        """Below the floor now (no state change: `check` still reports the pause)."""
        return bool(self.min_free) and self.free() < self.min_free

    def check(self) -> str | None:
        """'pause' or 'resume' when the run should change state now; None otherwise."""
        now = time.monotonic()
        if not self.min_free or now < self._next:
            return None
        self._next = now + self.interval
        free = self.free()
        if not self.paused and free < self.min_free:
            self.paused = True
            return "pause"
        if self.paused and free >= self.min_free * RESUME_FACTOR:
            self.paused = False
            return "resume"
        return None

    def pause_line(self) -> str:
        fs = filesystem_of(self.work)
        fills = f"the spool ({self.spool}) holds {mb(tree_bytes(self.spool))}"
        if self.redis_dir:
            fills += f", the private Redis's append-only file ({self.redis_dir}) {mb(tree_bytes(self.redis_dir))}"
        return (
            f"harvest: paused: the filesystem {fs} (work dir {self.work}) is full: {mb(self.free())} free, less "
            f"than --min-free-mb {self.min_free >> 20}; {fills}. The workers are stopped; free space there and "
            f"the run goes on by itself (at {mb(self.min_free * RESUME_FACTOR)} free), or Ctrl-C stops it cleanly"
        )

    def resume_line(self) -> str:
        return (
            f"harvest: resumed: the filesystem {filesystem_of(self.work)} has {mb(self.free())} free again; "
            "the workers are started again"
        )
