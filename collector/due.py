"""When a shard is due: full, its oldest sample `max_wait` old, or nothing left queued to fill it.

A collector polls its spool every 0.2 s while a shard fills. What its own spool files tell (their
sizes, their ages) costs Redis nothing; whether samples are still queued is a read of the run's
count, one round trip, and a poll that made it every time cost the fleet's one Redis a round trip
a shard (bench/fleet.py). So an answer "samples are queued" is kept for QUEUED_CHECK_S: a partial
shard whose run has just drained waits that much longer (and never past `max_wait`). "Nothing
queued" is never kept.
"""

from __future__ import annotations

import os
import time

import redis

from harvest.state.ledger import QUEUED

QUEUED_CHECK_S = 1.0


class QueuedCheck:
    """Whether no sample of the run is queued, read at most every QUEUED_CHECK_S while some are.
    Owned by one packer thread (harvest.collector.collector.Collector)."""

    def __init__(self, conn: redis.Redis, counts_key: str) -> None:
        self.conn, self.counts_key = conn, counts_key
        self._queued_until = -float("inf")  # monotonic time until which "some are queued" stands

    def none(self) -> bool:
        if time.monotonic() < self._queued_until:
            return False
        if self.conn.hget(self.counts_key, QUEUED) in (None, b"0"):
            return True
        self._queued_until = time.monotonic() + QUEUED_CHECK_S
        return False


def may_be_due(files: list[tuple[str, str, int]], shard_bytes: int, max_wait: float, queued: QueuedCheck) -> bool:
    """From the spool's files (oldest first: harvest.node.spooldir.list_spooled) and at most one
    O(1) read (a poll reads no sample's state): they hold every ready sample, so all of them below
    a shard, none `max_wait` old and samples queued rule a due shard out."""
    try:
        old = time.time() - os.stat(files[0][1]).st_mtime >= max_wait
    except FileNotFoundError:
        return True  # a file went meanwhile: let the full look decide
    return old or sum(size for _, _, size in files) >= shard_bytes or queued.none()
