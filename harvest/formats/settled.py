"""`<out>/<run>/settled.json`: the run's output says the run is over, for readers with no Redis.

A reader that follows a live run (harvest.read.follow) must know when no index file will come
any more. The index files cannot say it (a run's total is in its ledger, not in storage), and a
trainer should not need Redis. So `harvest run`, once every sample of the run is done or failed
(its ledger has nothing queued or spooled) and so every index file is written, writes this small
document: `{"format", "run", "done", "failed", "at"}`. `harvest run` removes it as soon as the run
has work again (queued or spooled samples when it starts, or new ones from its producer); a rerun
with nothing to do leaves it as it was. A follower that reads it lists the index once
more and ends: every index was written before the marker.

Only `harvest run` writes it: a fleet run by hand (`harvest produce`, `worker`, `collect` on many
nodes) has no single process that knows the producer is finished; its operator writes the
marker with `write_settled` (or a reader follows with a bounded wait instead).
"""

from __future__ import annotations

import json
import time
from typing import Any

from harvest.formats.index import ShardError
from harvest.storage import Location, retry

SETTLED = "settled.json"
FORMAT = "harvest-settled-1"


def write_settled(loc: Location, run: str, done: int, failed: int) -> None:
    """Mark the run in `loc` (its `<out>/<run>` folder) settled: whole or not at all."""
    doc = {
        "format": FORMAT,
        "run": run,
        "done": done,
        "failed": failed,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    loc.write_atomic(SETTLED, json.dumps(doc, indent=1).encode())


def read_settled(loc: Location) -> dict[str, Any] | None:
    """The marker, or None while the run is not settled; ShardError for a marker of another format."""
    try:
        doc = loc.read_json(SETTLED)
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ShardError(f"{loc.path(SETTLED)}: not a {FORMAT} document")
    return doc


def clear_settled(loc: Location) -> None:
    """The run is open again: no marker."""
    loc.delete(SETTLED)


def settle(loc: Location, run: str, done: int, failed: int) -> None:
    """`harvest run`'s end, every sample done or failed and every index written: the marker, unless
    one already says the same (a rerun that found nothing to do changes no byte of the output).
    Storage calls retried (harvest.storage.retry)."""
    marker = retry(lambda: read_settled(loc), f"reading {loc.path(SETTLED)}")
    if marker is None or (marker["done"], marker["failed"]) != (done, failed):
        retry(lambda: write_settled(loc, run, done, failed), f"writing {loc.path(SETTLED)}")


def unsettle(loc: Location) -> None:
    """The run has work again (queued or spooled samples, or new ones enqueued): no marker, so the
    feeds following it wait for its commits."""
    retry(lambda: clear_settled(loc), f"removing {loc.path(SETTLED)}")
