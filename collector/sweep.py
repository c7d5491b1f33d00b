"""Removal of uploaded shards that no index file commits (orphans).

A collector that dies between uploading a shard and writing its index finds its packing
record on restart and overwrites the shard with the identical re-pack, so orphans arise only
when that record is lost too (Redis wiped, a node retired mid-commit). Readers never see an
orphan (no index, no shard), but it costs storage, so the collector sweeps them at start:
a shard is removed only if it has no index file, no collector of the run has it recorded as
in progress, and it is older than `min_age` by the store's own clock (a guard against a commit
racing the sweep; never this node's clock, which may be off by hours). An orphan may also be a
committed shard whose index file was lost: if the ledger has any of its samples done, the run is
reconciled first (harvest.ops.reconcile), which puts those samples back on the queue from this
shard's tokens, before the shard goes. Local outputs also lose temporary files (`.tmp-*`) older
than `min_age`.
"""

from __future__ import annotations

import logging
import os
import time

import redis

from harvest.config import RunConfig
from harvest.formats.claims import store_now
from harvest.formats.generated import GENERATED
from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS
from harvest.ops.reconcile import reconcile, shard_sample_ids
from harvest.state.ledger import DONE, Ledger
from harvest.state.packing import PackingRecords
from harvest.storage import TEMP_PREFIX, Location

log = logging.getLogger("harvest.collector")


def sweep_orphans(out: Location, conn: redis.Redis, cfg: RunConfig, min_age: float) -> list[str]:
    """Delete orphan shards (and stale local temporaries); returns the names removed.
    Shards are listed before records and indexes are read: a shard committed meanwhile has
    its record until its index exists, so it is never taken for an orphan."""
    shards = out.list(SHARDS, ".safetensors")
    generated = out.list(GENERATED, ".parquet")  # a --regenerate run's, given up with their shard
    busy = PackingRecords(conn, cfg.run).shard_ids()
    indexed = {n.removesuffix(".json") for n in out.list(INDEX, ".json")}
    candidates = [n for n in shards if n.removesuffix(".safetensors") not in indexed | busy]
    stray = [n for n in generated if n.removesuffix(".parquet") not in indexed | busy]
    if not candidates and not stray:
        return []
    now = store_now(out) or time.time()
    removed = []
    for name in stray:  # no reader reads a generated file its shard's index does not name
        m = out.modified(f"{GENERATED}/{name}")
        if m is not None and now - m >= min_age:
            out.delete(f"{GENERATED}/{name}")
            removed.append(name)
            log.warning(
                "removed orphan generated file %s (no index file, %.0f s old)", out.path(GENERATED, name), now - m
            )
    old = [(n, m) for n in candidates if (m := out.modified(f"{SHARDS}/{n}")) is not None and now - m >= min_age]
    ledger = Ledger(conn, cfg.run)
    if any(DONE in ledger.states(shard_sample_ids(out, f"{SHARDS}/{n}")) for n, _ in old):
        log.warning("orphan shards hold samples the ledger has done: an index file was lost; reconciling first")
        reconcile(conn, cfg)
    for name, mtime in old:
        out.delete(f"{SHARDS}/{name}")
        removed.append(name)
        log.warning("removed orphan shard %s (no index file, %.0f s old)", out.path(SHARDS, name), now - mtime)
    if out.is_local and os.path.isdir(out.path(SHARDS)):
        for e in os.scandir(out.path(SHARDS)):
            if e.name.startswith(TEMP_PREFIX) and now - e.stat().st_mtime >= min_age:
                os.unlink(e.path)
                removed.append(e.name)
    return removed
