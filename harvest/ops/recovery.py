"""Noticing that Redis forgot writes, and reconciling the ledger from storage before going on.

STUB: being written (see docs/architecture.md, "Exactly once"). `Recovery.check()` is safe and
cheap to call often (at most one INFO and one GET every `min_interval` seconds).
"""

from __future__ import annotations

import redis

from harvest.config import RunConfig


class Recovery:
    """One per process and run. `check()` returns True when this call reconciled the ledger."""

    def __init__(self, conn: redis.Redis, cfg: RunConfig, min_interval: float = 2.0) -> None:
        self.conn, self.cfg, self.min_interval = conn, cfg, min_interval

    def check(self) -> bool:
        return False
