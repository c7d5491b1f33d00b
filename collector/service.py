"""`harvest collect`: a node's packers (harvest.collector.packers) on its spool, until stopped.

The CLI reads the run, checks its output and maps a `StorageError` to its message; this is the
process's work, with its tunables in one `harvest.settings.CollectorSettings`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import redis

from harvest.collector.packers import Packers
from harvest.config import RunConfig
from harvest.settings import CollectorSettings


def run_collector(
    conn: redis.Redis,
    cfg: RunConfig,
    spool_dir: str,
    settings: CollectorSettings = CollectorSettings(),
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Pack `spool_dir` into shards of the run until `stop()` (with `settings.burst`: what is
    spooled now). Raises StorageError when storage errors persist (the spool and the record stay)."""
    os.makedirs(spool_dir, mode=0o700, exist_ok=True)
    packers = Packers(
        conn,
        cfg,
        spool_dir,
        settings.packers(),
        node=settings.node,
        max_wait=settings.max_wait_s,
        shard_bytes=settings.shard_bytes,
        part_bytes=settings.part_bytes,
        retries=settings.storage_retries,
        retry_delay=settings.retry_delay_s,
        orphan_age=settings.orphan_age_s,
    )
    packers.run(lambda: settings.burst or stop())
