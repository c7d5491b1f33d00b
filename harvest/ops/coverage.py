"""Whether a run's ledger and its dataset agree: what the dataset owes, what the run holds beyond it.

`harvest run` reads its dataset into a `SampleIds` (harvest.formats.datasetids) and compares it
with the ledger's states, in one pass over the state hash (HSCAN; the same cost as reconcile's
done-set):

- the dataset's samples by state: committed (`d`: a collector marks a sample done only after its
  index is written, and reconcile brings a Redis that lost writes back in line with the index
  files), failed (with a reason), queued, spooled, and in no state at all: what a Redis that came
  back without them (no persistence, a wipe) forgot. Nothing finishes those but a producer pass,
  which enqueues every sample the ledger does not know (harvest.producer.enqueue). A run is done only
  when every sample of its dataset is committed or failed.
- the ledger's samples the dataset no longer holds (rows edited or removed since they were
  enqueued), by state. `prune_queued` drops the queued ones (q -> absent: the worker of their
  job takes only its queued samples, so they are never extracted); a worker that took their job
  before the prune extracts them still, and the next rerun reports them committed. Committed
  samples are never deleted: they stay readable in the run, and a run that must hold exactly an
  edited dataset is a new run (`--run NAME`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import redis

from harvest.config import RunConfig
from harvest.formats.datasetids import SampleIds, read_manifest
from harvest.formats.runfile import run_location
from harvest.state.ledger import QUEUED, STATE_NAMES, Ledger, state_letter

SCAN = 10_000  # state hash entries a round trip
CHUNK = 1000  # ids a forget call


@dataclass
class Coverage:
    """The dataset's samples by ledger state (absent: in none), and the ledger's samples the dataset
    does not hold, by state name."""

    total: int  # the dataset's distinct samples
    by_state: Counter = field(default_factory=Counter)  # state name or "absent" -> dataset samples
    stray: Counter = field(default_factory=Counter)  # state name -> ledger samples not in the dataset

    @property
    def missing(self) -> int:
        """The dataset's samples neither committed nor failed."""
        return self.total - self.by_state["done"] - self.by_state["failed"]

    def missing_line(self) -> str:
        """What is missing, in one phrase ("" when nothing is)."""
        if not self.missing:
            return ""
        parts = [f"{self.by_state[k]} {k}" for k in ("queued", "spooled") if self.by_state[k]]
        if self.by_state["absent"]:
            parts.append(f"{self.by_state['absent']} in no state (a Redis that came back without them)")
        return f"{self.missing} of {self.total} samples are neither committed nor failed ({', '.join(parts)})"

    def stray_line(self, pruned: int = 0) -> str:
        """The samples the run holds that its dataset no longer does ("" when none, nothing pruned)."""
        parts = []
        if self.stray["done"]:
            parts.append(
                f"{self.stray['done']} committed (kept: harvest deletes no committed sample; a run that "
                "must hold exactly this dataset is a new --run)"
            )
        if pruned:
            parts.append(f"{pruned} queued, dropped (--prune)")
        left = self.stray["queued"] + self.stray["spooled"]
        if left:
            parts.append(f"{left} queued or spooled, extracted too (--prune drops the queued ones)")
        if self.stray["failed"]:
            parts.append(f"{self.stray['failed']} failed")
        return "; ".join(parts)


def coverage(conn: redis.Redis, run: str, ids: SampleIds) -> Coverage:
    """The ledger of `run` against the dataset's `ids`, in one pass over the state hash."""
    cov = Coverage(total=len(ids))
    key = Ledger(conn, run).keys.state
    seen = 0
    batch: list[tuple[bytes, bytes]] = []

    def flush() -> None:
        nonlocal seen
        inside = ids.contains([k for k, _ in batch])
        for (_, v), held in zip(batch, inside, strict=False):
            name = STATE_NAMES.get(state_letter(v) or "", "absent")
            if held:
                cov.by_state[name] += 1
                seen += 1
            else:
                cov.stray[name] += 1
        batch.clear()

    for kv in conn.hscan_iter(key, count=SCAN):
        batch.append(kv)
        if len(batch) >= SCAN:
            flush()
    flush()
    cov.by_state["absent"] = cov.total - seen
    return cov


def prune_queued(conn: redis.Redis, run: str, ids: SampleIds) -> int:
    """Drop the queued samples of `run` that `ids` (its dataset) does not hold: q -> absent.
    Returns how many were dropped."""
    ledger = Ledger(conn, run)
    stray = [k.decode() for k, v in conn.hscan_iter(ledger.keys.state, count=SCAN) if v == QUEUED.encode()]
    stray = [k for k, held in zip(stray, ids.contains(stray), strict=False) if not held]
    return sum(len(ledger.forget_done(stray[i : i + CHUNK], state=QUEUED)) for i in range(0, len(stray), CHUNK))


def dataset_check(conn: redis.Redis, cfg: RunConfig) -> list[str]:
    """`harvest status --check`'s lines on the dataset: one naming the samples of the dataset its
    last `harvest run` read (harvest.formats.datasetids) that the ledger holds in no state, and the
    command that enqueues them again; none when there are none or no `harvest run` kept the ids.
    Queued and spooled samples are a run in progress, not a disagreement."""
    ids = read_manifest(run_location(cfg.out_url, cfg.run))
    if ids is None:
        return []
    lost = coverage(conn, cfg.run, ids).by_state["absent"]
    if not lost:
        return []
    return [
        f"dataset of run {cfg.run}: {lost} of {len(ids)} samples are in no state (neither queued, spooled, "
        "committed nor failed: a Redis that came back without them); run the same `harvest run` command again: "
        "its producer pass enqueues them"
    ]
