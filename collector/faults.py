"""A test-only fault hook: make the collector kill (SIGKILL) or freeze (SIGSTOP) itself at a named point.

`HARVEST_COLLECTOR_CRASH_AT=point[:n][:stop]` acts the n-th time (default 1st) the process reaches
`point`: it kills itself, or with `:stop` it stops itself, as a paused VM or a long stall would,
until someone sends it SIGCONT (then it carries on from that very point). The crash tests use the
kill to stop the collector at exact places in the commit sequence (between shard and index, between
index and ledger, ...) and check that a restart still leaves every sample in exactly one committed
shard; the freeze tests let its spool be reclaimed and its samples committed by another collector
before it resumes (tests/system/test_freeze_collector.py, tests/support/freeze_soak.py). Unset, it
costs one comparison.
"""

from __future__ import annotations

import os
import signal
import threading

CRASH_ENV = "HARVEST_COLLECTOR_CRASH_AT"
# In commit order: Redis record written; shard bytes partly streamed; the safetensors header
# stored (in the local temp file, or the upload's first part); object storage: parts stored
# while more are in flight; every byte stored, not visible yet (upload not completed; temp file
# not renamed); local: about to rename; shard visible (not fenced yet); commit fence passed (the
# record holds the index document, no index file yet); index written (ledger not yet done);
# ledger done (spool files still there); some spool files deleted.
CRASH_POINTS = (
    "recorded",
    "claimed",
    "packing",
    "header-sent",
    "uploading",
    "packed",
    "uploaded",
    "fenced",
    "indexed",
    "marked",
    "unlinking",
)
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class CrashHook:
    """One per process (`from_env`): every packer of a collector (a thread each) counts into the same
    hook, so the n-th time is the process's, and a process resumed after a stop stops no more."""

    _shared: CrashHook | None = None

    def __init__(self, spec: str | None) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self.point: str | None = None
        self.at = 1
        self.seen = 0
        self.signal = signal.SIGKILL
        if spec:
            point, _, rest = spec.partition(":")
            n, _, action = rest.partition(":")
            if not n.isdigit() and not action:  # point:stop
                n, action = "", n
            if point not in CRASH_POINTS or action not in ("", *ACTIONS) or (n and not n.isdigit()):
                raise ValueError(
                    f"{CRASH_ENV}={spec!r}: expected point[:n][:kill|stop], point one of {', '.join(CRASH_POINTS)}"
                )
            self.point, self.at, self.signal = point, int(n or 1), ACTIONS[action or "kill"]

    @classmethod
    def from_env(cls) -> CrashHook:
        spec = os.environ.get(CRASH_ENV)
        if cls._shared is None or cls._shared.spec != spec:
            cls._shared = cls(spec)
        return cls._shared

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        with self._lock:
            self.seen += 1
            now = self.seen == self.at
        if now:
            # To this very thread: it takes the signal as its call returns, so it stops (or dies)
            # at the point itself; one sent to the process may be taken by another thread, which
            # leaves this one running on for a moment (past the point: a fence, a record cleared).
            signal.pthread_kill(threading.get_ident(), self.signal)
