"""Removal of uploaded shards that no index file commits (orphans).

A collector that dies between uploading a shard and writing its index finds its packing
record on restart and overwrites the shard with the identical re-pack, so orphans arise only
when that record is lost too (Redis wiped, a node retired mid-commit). Readers never see an
orphan (no index, no shard), but it costs storage, so the collector sweeps them at start:
a shard is removed only if it has no index file, no collector of the run has it recorded as
in progress, and it is older than `min_age` (a guard against a commit racing the sweep).
Local outputs also lose temporary files (`.tmp-*`) older than `min_age`.
"""

from __future__ import annotations

import logging
import os
import time

import redis

from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS
from harvest.state.keys import Keys
from harvest.state.packing import PackingRecord
from harvest.storage import TEMP_PREFIX, Location

log = logging.getLogger("harvest.collector")


def in_progress(conn: redis.Redis, run: str) -> set[str]:
    """Shard ids recorded by any collector of the run as being committed."""
    out = set()
    for key in conn.scan_iter(match=Keys(run).packing_pattern):
        raw = conn.get(key)
        if raw:
            out.add(PackingRecord.from_json(raw).shard_id)
    return out


def sweep_orphans(out: Location, conn: redis.Redis, run: str, min_age: float) -> list[str]:
    """Delete orphan shards (and stale local temporaries); returns the names removed.
    Shards are listed before records and indexes are read: a shard committed meanwhile has
    its record until its index exists, so it is never taken for an orphan."""
    now = time.time()
    shards = out.list(SHARDS, ".safetensors")
    busy = in_progress(conn, run)
    indexed = {n.removesuffix(".json") for n in out.list(INDEX, ".json")}
    removed = []
    for name in shards:
        sid = name.removesuffix(".safetensors")
        if sid in indexed or sid in busy:
            continue
        mtime = out.modified(f"{SHARDS}/{name}")
        if mtime is None or now - mtime < min_age:
            continue
        out.delete(f"{SHARDS}/{name}")
        removed.append(name)
        log.warning("removed orphan shard %s (no index file, %.0f s old)", out.path(SHARDS, name), now - mtime)
    if out.is_local and os.path.isdir(out.path(SHARDS)):
        for e in os.scandir(out.path(SHARDS)):
            if e.name.startswith(TEMP_PREFIX) and now - e.stat().st_mtime >= min_age:
                os.unlink(e.path)
                removed.append(e.name)
    return removed
