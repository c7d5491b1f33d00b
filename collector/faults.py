"""A test-only fault hook: make the collector kill itself (SIGKILL) at a named point.

`HARVEST_COLLECTOR_CRASH_AT=point[:n]` kills the process the n-th time (default 1st) it
reaches `point`. The crash tests use it to stop the collector at exact places in the commit
sequence (between shard and index, between index and ledger, ...) and check that a restart
still leaves every sample in exactly one committed shard. Unset, it costs one comparison.
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "HARVEST_COLLECTOR_CRASH_AT"
# In commit order: Redis record written; shard bytes partly streamed; the safetensors header
# stored (in the local temp file, or the upload's first part); object storage: parts stored
# while more are in flight; every byte stored, not visible yet (upload not completed; temp file
# not renamed); local: about to rename; shard visible (not fenced yet); commit fence passed (the
# record holds the index document, no index file yet); index written (ledger not yet done);
# ledger done (spool files still there); some spool files deleted.
CRASH_POINTS = ("recorded", "claimed", "packing", "header-sent", "uploading", "packed", "uploaded", "fenced", "indexed",
                "marked", "unlinking")


class CrashHook:
    def __init__(self, spec: str | None) -> None:
        self.point: str | None = None
        self.at = 1
        self.seen = 0
        if spec:
            point, _, n = spec.partition(":")
            if point not in CRASH_POINTS:
                raise ValueError(f"{CRASH_ENV}={spec!r}: point must be one of {', '.join(CRASH_POINTS)}")
            self.point, self.at = point, int(n or 1)

    @classmethod
    def from_env(cls) -> CrashHook:
        return cls(os.environ.get(CRASH_ENV))

    def __call__(self, point: str) -> None:
        if point != self.point:
            return
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
