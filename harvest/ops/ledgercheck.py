"""The ledger's invariants, checked (`harvest status --check`) and repaired (`harvest reconcile`).

The ledger (harvest.state.ledger) keeps one state letter per sample in one hash, so a sample
cannot hold two states; what can disagree is everything kept beside it: the per-state counters
(status, `runs` and the end of `harvest run` read only those), the failures hash (what `requeue`
selects from), the spool owners and their per-spool counts. Every move goes through one Lua
script that keeps them together, so they part only when the writes themselves were mixed up:
two redis-servers on one append-only file (two `harvest run`s on one work dir: counts such as
"done 50 failed 50" for a 50-sample run, `requeue --all` finding nothing), or a hand edit. The check
reads the state hash and the rest in one Lua call (one consistent snapshot) and names each
disagreement; the repair rebuilds the counters and side tables from the state hash, the one
truth Redis has (storage's index files then correct the states themselves: `reconcile`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from harvest.state import scripts
from harvest.state.failures import WORKER_ERROR
from harvest.state.keys import Keys
from harvest.state.ledger import STATE_NAMES


@dataclass
class LedgerCheck:
    run: str
    total: int
    by_state: dict[str, int]  # recounted from the state hash
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        counts = ", ".join(f"{STATE_NAMES[s]} {self.by_state.get(s, 0)}" for s in STATE_NAMES)
        if self.ok:
            return [f"ledger of run {self.run}: consistent ({self.total} samples: {counts})"]
        return [
            f"ledger of run {self.run}: {len(self.problems)} inconsistencies ({self.total} samples in the state "
            f"hash: {counts})"
        ] + [f"  {p}" for p in self.problems]


def _examples(ids: list[str]) -> str:
    return ", ".join(ids)


def check_ledger(conn: redis.Redis, run: str, repair: bool = False) -> LedgerCheck:
    """What disagrees with the state hash (and, with `repair`, rebuilt from it) in one snapshot."""
    k = Keys(run)
    why = json.dumps(
        {"reason": WORKER_ERROR, "message": "failed without a recorded reason (found by the ledger check; requeue it)"}
    )
    skip = len(k.job_copy_prefix)
    copies = [c.decode()[skip:] for c in conn.scan_iter(match=k.job_copies_match, count=1000)]
    raw = scripts.check_ledger(k, repair, why, copies).run(conn)
    doc = json.loads(raw)
    counts = doc["counts"] if isinstance(doc["counts"], dict) else {}
    rep = LedgerCheck(run, int(doc["total"]), {s: int(v[0]) for s, v in counts.items()})
    for s, (want, got) in sorted(counts.items()):
        if want != got:
            rep.problems.append(f"count of {STATE_NAMES[s]}: the counters say {got}, the state hash holds {want}")
    n = doc["n"]
    for key, what in (
        ("fws", "failed_without_state"),
        ("fwr", "failed_without_reason"),
        ("ows", "owner_without_spooled"),
        ("swo", "spooled_without_owner"),
        ("pws", "payload_without_spooled"),
    ):
        if n[key]:
            rep.problems.append(f"{what.replace('_', ' ')}: {n[key]} (e.g. {_examples(doc[what])})")
    spool_counts = doc["spool_counts"] if isinstance(doc["spool_counts"], dict) else {}
    for spool, (want, got) in sorted(spool_counts.items()):
        rep.problems.append(f"spool {spool}: its counter says {got} spooled samples, the state hash {want}")
    copies = doc["job_copies"] if isinstance(doc["job_copies"], dict) else {}
    for job, (want, got) in sorted(copies.items()):
        rep.problems.append(f"copy of job {job}: its counter says {got} refs, the ledger holds {want}")
    return rep
