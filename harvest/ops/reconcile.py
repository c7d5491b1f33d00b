"""Rebuild the ledger's done-set from storage: the index files are the durable truth.

After Redis is lost or wiped, `restore_run` puts the run's configuration back from its
run.json and `reconcile` marks every sample of every committed shard done, so the producer
then enqueues only what is missing. A shard without an index file is not committed and
counts for nothing here.
"""

from __future__ import annotations

import redis

from harvest.config import RunConfig
from harvest.formats.index import INDEX, parse_index
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run, read_run_json, run_location
from harvest.storage import retry


def restore_run(conn: redis.Redis, run: str, out_url: str) -> RunConfig:
    """The run's configuration from `<out_url>/<run>/run.json`, published to Redis (a no-op if
    Redis still holds it; refused if Redis holds a different one)."""
    loc = run_location(out_url, run)
    cfg = retry(lambda: read_run_json(loc), f"reading {loc.path('run.json')}")
    return publish_run(conn, cfg)


def reconcile(conn: redis.Redis, cfg: RunConfig) -> int:
    """Mark every sample of every committed shard done; returns how many changed state."""
    loc = run_location(cfg.out_url, cfg.run)
    ledger = Ledger(conn, cfg.run)
    changed = 0
    for name in retry(lambda: loc.list(INDEX, ".json"), f"listing {loc.path(INDEX)}"):
        raw = retry(lambda: loc.read_json(f"{INDEX}/{name}"), f"reading {loc.path(INDEX, name)}")
        doc = parse_index(raw, loc.path(INDEX, name))
        changed += len(ledger.mark_done(list(doc["samples"])))
    return changed
