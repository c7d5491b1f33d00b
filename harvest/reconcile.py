"""Rebuild the ledger's done-set from storage: the index files are the durable truth."""

from __future__ import annotations

import redis

from harvest.config import RunConfig
from harvest.ledger import Ledger
from harvest.runstore import run_location
from harvest.shard import INDEX


def reconcile(conn: redis.Redis, cfg: RunConfig) -> int:
    """Mark every sample of every committed shard done; returns how many changed state."""
    loc = run_location(cfg.out_url, cfg.run)
    ledger = Ledger(conn, cfg.run)
    changed = 0
    for name in loc.list(INDEX, ".json"):
        doc = loc.read_json(f"{INDEX}/{name}")
        changed += len(ledger.mark_done(list(doc["samples"])))
    return changed
