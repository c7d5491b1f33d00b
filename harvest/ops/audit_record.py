"""Where an audit's result lives: with the run in its output, and a copy in Redis for the light
readers (`harvest status`, `harvest metrics`).

The output holds the truth, as for the commits: `<out>/<run>/audits/<stamp>-<seed>.json` is the
whole record (every sample checked, per capture point, every failure), written whole or not at
all (`Location.write_atomic`: a temp name and a rename locally, one PUT on object stores), and
`audits/latest.json` is the summary of the last one with the record's name, written after it, so
the pointer never names a record that is not there. Two audits at once: each keeps its record,
the pointer names the one that finished last. Nothing here is committed data: no reader of the
run lists `audits/`.

Redis gets the same summary under `harvest:<run>:audit` (harvest.state.keys), so status and the
exporter read one key instead of storage on every refresh and scrape. Redis can forget it (a wipe):
then status says the run was never audited until the next audit, and the output still has it.
No torch here: `harvest status` imports this.
"""

from __future__ import annotations

import json
import time

import redis

from harvest.state.keys import Keys
from harvest.storage import Location, retry

AUDITS = "audits"
LATEST = f"{AUDITS}/latest.json"
FORMAT = "harvest-audit-1"
PASS, FAIL = "pass", "fail"


def stamp(at: float) -> str:
    """A record's time in its name, UTC, sortable."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at))


def write_record(loc: Location, record: dict) -> str:
    """Store the whole record, then the latest pointer (its summary and the record's name); returns
    the record's name in the run folder `loc`."""
    name = f"{AUDITS}/{stamp(record['at'])}-{int(record['seed'])}.json"
    body = json.dumps(record, indent=1, sort_keys=True).encode()
    retry(lambda: loc.write_atomic(name, body), f"writing {loc.path(name)}")
    latest = json.dumps({**summary(record), "record": name}, indent=1, sort_keys=True).encode()
    retry(lambda: loc.write_atomic(LATEST, latest), f"writing {loc.path(LATEST)}")
    return name


def summary(record: dict) -> dict:
    """What status and metrics show: when, how, on how much, the verdict, the counts."""
    keys = (
        "format",
        "run",
        "at",
        "route",
        "route_detail",
        "seed",
        "samples",
        "committed",
        "dtype",
        "tolerance",
        "verdict",
        "outcomes",
        "worst_rel",
        "requeued",
    )
    return {k: record[k] for k in keys if k in record}


def mirror(conn: redis.Redis, run: str, summary_: dict) -> None:
    conn.set(Keys(run).audit, json.dumps(summary_, sort_keys=True))


def last_audit(conn: redis.Redis, run: str) -> dict | None:
    """The summary of the run's last audit as Redis holds it (None: never, or Redis forgot)."""
    raw = conn.get(Keys(run).audit)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def status_line(doc: dict | None, run: str) -> str:
    """`harvest status`'s audit line."""
    if not doc:
        return f"  audit    never (harvest audit --run {run})"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc.get("at", 0)))
    outcomes = doc.get("outcomes") or {}
    bad = {k: v for k, v in sorted(outcomes.items()) if k != "ok" and v}
    text = (
        f"  audit    {doc.get('verdict', '?')} {when}, against {doc.get('route', '?')}, {doc.get('samples', '?')} "
        f"samples (seed {doc.get('seed', '?')}), worst relative error {doc.get('worst_rel', 0.0):.1e} "
        f"(bound {doc.get('tolerance', 0.0):.2e})"
    )
    if bad:
        text += ": " + ", ".join(f"{v} {k}" for k, v in bad.items())
    if doc.get("requeued"):
        text += f"; {len(doc['requeued'])} requeued"
    return text
