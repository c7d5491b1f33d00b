"""`harvest audit`: committed samples recomputed by a second route and compared with what is stored.

The worker checks every sample's tokens, coverage, capture points and finiteness: that proves the
files whole, not the numbers right. An audit picks committed samples at random, stratified by
length (so samples spanning several prefill chunks are among them), and for each:

1. checks the stored bytes against the index's crc32s first (harvest.read.shard_reader: the
   checks `harvest reconcile --verify` makes): a mismatch is corruption at rest, reported as
   that and not recomputed, since its numbers say nothing about the engine;
2. recomputes its hidden states by a route (`Route`): the run's engine, each sample alone with a
   fresh rid (harvest.cli.audit: it needs the worker's client and claim code, which only the
   composition root may import), or an independent transformers forward (harvest.ops.audit_hf);
3. compares per capture point (harvest.ops.audit_compare): relative error per row against the
   storage dtype's bound, with a diagnosis of the failure's shape.

It reads the copy of each sample that readers read (`kept_copies`) and changes nothing in the
run: the result goes to `audits/` beside it (harvest.ops.audit_record). Only `exclude_bad`, behind
`--requeue-bad`, touches an index: it stops committing the failing copies, exactly as
`harvest reconcile --verify` does for corrupt ones, and reconcile then puts them back on the queue.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from harvest import __version__
from harvest.config import RunConfig
from harvest.errors import InputError, ServiceError
from harvest.formats.index import ShardIndex, kept_copies
from harvest.ops.audit_compare import (
    CORRUPT,
    OK,
    OUTCOMES,
    UNCHECKED,
    PointStats,
    SampleResult,
    compare_sample,
    worst_by_point,
)
from harvest.ops.audit_record import FAIL, FORMAT, PASS, stamp
from harvest.ops.dedupe import exclude_in_index, read_indexes
from harvest.sample import Sample
from harvest.storage import Location

if TYPE_CHECKING:
    import torch

    from harvest.read.shard_reader import ShardReader


class Unchecked(ServiceError):
    """The route could not recompute this sample (the engine refused it, its dump failed the
    worker's checks): the sample is reported unchecked, with this message."""


class NothingToAudit(InputError):
    """The run commits no sample yet."""


class Route(Protocol):
    """A second computation of a sample's hidden states."""

    name: str  # engine | hf
    detail: str  # one line: what computed them, where, how

    def recompute(self, sample: Sample) -> tuple[torch.Tensor, Mapping[int, torch.Tensor] | None]:
        """`[T, K, H]` at the run's capture points, and every other layer the route has (HF index ->
        [T, H]; None: only the capture points). Raises Unchecked."""
        ...


@dataclass(frozen=True)
class Picked:
    sample_id: str
    shard_id: str
    position: int  # in its shard
    tokens: int


def committed(docs: Sequence[ShardIndex]) -> list[Picked]:
    """Every committed sample once, the copy readers read, sorted by id."""
    kept = kept_copies(docs).kept
    by_id = {d["shard_id"]: d for d in docs}
    out = []
    for sid, shard in kept.items():
        doc = by_id[shard]
        i = doc["samples"].index(sid)
        out.append(Picked(sid, shard, i, doc["tokens"][i]))
    return sorted(out, key=lambda p: p.sample_id)


def pick(samples: Sequence[Picked], n: int, seed: int) -> list[Picked]:
    """`n` samples at random, stratified by length: strata by powers of two of the token count
    (1, 2-3, 4-7, ...), one from each stratum in turn, the longest first, until `n`; so the
    longest samples (those spanning several prefill chunks) are always among them once `n` reaches
    the number of strata. The same seed and committed set give the same choice. Shortest first."""
    if n >= len(samples):
        return sorted(samples, key=lambda p: (p.tokens, p.sample_id))
    rng = random.Random(seed)
    strata: dict[int, list[Picked]] = {}
    for p in sorted(samples, key=lambda p: p.sample_id):
        strata.setdefault(max(p.tokens, 1).bit_length(), []).append(p)
    for members in strata.values():
        rng.shuffle(members)
    chosen: list[Picked] = []
    while len(chosen) < n:
        for k in sorted(strata, reverse=True):
            if strata[k] and len(chosen) < n:
                chosen.append(strata[k].pop())
    return sorted(chosen, key=lambda p: (p.tokens, p.sample_id))


@dataclass
class AuditReport:
    cfg: RunConfig
    route: str
    route_detail: str
    seed: int
    requested: int
    committed: int
    tolerance: float
    at: float = field(default_factory=time.time)
    results: list[SampleResult] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    requeue_line: str = ""
    record: str = ""

    @property
    def outcomes(self) -> dict[str, int]:
        c = Counter(r.outcome for r in self.results)
        return {k: c[k] for k in OUTCOMES if c[k]}

    @property
    def verdict(self) -> str:
        return PASS if self.results and all(r.outcome == OK for r in self.results) else FAIL

    @property
    def bad(self) -> list[SampleResult]:
        """Samples whose stored copy is wrong (beyond the bound, or corrupt at rest)."""
        return [r for r in self.results if r.bad]

    def worst(self) -> list[PointStats]:
        return worst_by_point([r for r in self.results if r.points], self.cfg.capture_points)

    def to_dict(self) -> dict:
        worst = self.worst()
        return {
            "format": FORMAT,
            "harvest": __version__,
            "run": self.cfg.run,
            "at": self.at,
            "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at)),
            "route": self.route,
            "route_detail": self.route_detail,
            "seed": self.seed,
            "samples": len(self.results),
            "requested": self.requested,
            "committed": self.committed,
            "dtype": self.cfg.storage_dtype,
            "capture_points": list(self.cfg.capture_points),
            "tolerance": self.tolerance,
            "verdict": self.verdict,
            "outcomes": self.outcomes,
            "worst_rel": max((p.rel for p in worst), default=0.0),
            "points": [p.to_dict() for p in worst],
            "requeued": self.requeued,
            "results": [r.to_dict() for r in self.results],
        }

    def lines(self) -> list[str]:
        """What `harvest audit` prints."""
        cfg, n = self.cfg, len(self.results)
        lengths = [r.tokens for r in self.results]
        out = [
            f"audit of run {cfg.run}: {n} of {self.committed} committed samples (seed {self.seed}, stratified by "
            f"length: {min(lengths, default=0)}-{max(lengths, default=0)} tokens), {cfg.storage_dtype}, capture "
            f"points {', '.join(map(str, cfg.capture_points))}",
            f"against {self.route}: {self.route_detail}",
        ]
        corrupt = sum(r.outcome == CORRUPT for r in self.results)
        out.append(
            f"stored bytes: {n - corrupt} of {n} samples match their index's crc32s"
            + (f"; {corrupt} corrupt at rest (not recomputed)" if corrupt else "")
        )
        out.append(f"bound ({cfg.storage_dtype}): relative error per row <= {self.tolerance:.2e}")
        out += [f"  {p.line()}" for p in self.worst()]
        for r in self.results:
            if r.outcome == OK:
                continue
            label = {CORRUPT: "CORRUPT", UNCHECKED: "UNCHECKED"}.get(r.outcome, "FAIL")
            out.append(f"{label} sample {r.sample_id} (shard {r.shard_id}, {r.tokens} tokens): {r.outcome}: {r.detail}")
            out += [f"  {p.line()}" for p in r.points if p.reason != OK]
        counts = ", ".join(f"{v} {k}" for k, v in self.outcomes.items() if k != OK)
        if self.verdict == PASS:
            out.append(f"verdict: pass: {n} of {n} samples within the bound")
        else:
            out.append(f"verdict: FAIL: {n - self.outcomes.get(OK, 0)} of {n} samples not within the bound ({counts})")
        if self.requeue_line:
            out.append(self.requeue_line)
        return out


def _stored(
    reader: ShardReader, i: int, dtype: torch.dtype, regenerated_id: str | None = None
) -> tuple[Sample, torch.Tensor]:
    """The stored sample `i` and its states. Its id is the hash of its tokens, which the caller
    compares with the index; a --regenerate run's sample keeps its conversation's id
    (`regenerated_id`), which no hash of the regenerated tokens gives (its bytes are checked by
    their crc32 all the same)."""
    got = reader.sample(i, dtype)
    ids, mask = got["input_ids"].numpy(), got["loss_mask"].numpy()
    if regenerated_id is not None:
        return Sample(regenerated_id, ids.astype("int32"), mask.astype("uint8")), got["hidden_states"]
    return Sample.build(ids, mask), got["hidden_states"]


def audit_run(
    loc: Location,
    cfg: RunConfig,
    route: Route,
    n: int,
    seed: int,
    tolerance: float,
    progress: Callable[[int, int], None] | None = None,
) -> AuditReport:
    """Audit `n` committed samples of the run folder `loc` (`<out>/<run>`) against `route`."""
    import torch

    from harvest.read.shard_reader import ShardReader, UnreadableShard

    docs = read_indexes(loc)
    every = committed(docs)
    if not every:
        raise NothingToAudit(f"run {cfg.run} commits no sample yet in {loc.url()}: nothing to audit")
    chosen = pick(every, n, seed)
    rep = AuditReport(cfg, route.name, route.detail, seed, n, len(every), tolerance)
    by_id = {d["shard_id"]: d for d in docs}
    readers: dict[str, ShardReader | UnreadableShard] = {}
    for done, p in enumerate(chosen, 1):
        res = SampleResult(p.sample_id, p.shard_id, p.tokens)
        rep.results.append(res)
        if p.shard_id not in readers:
            try:
                readers[p.shard_id] = ShardReader(loc, by_id[p.shard_id])
            except UnreadableShard as e:
                readers[p.shard_id] = e
        reader = readers[p.shard_id]
        if isinstance(reader, UnreadableShard):
            res.outcome, res.detail = CORRUPT, f"its shard cannot be read ({reader.why}): corruption at rest, not drift"
        elif bad := reader.check(p.position):
            e = bad[0]
            res.outcome = CORRUPT
            res.detail = (
                f"tensor {e.tensor}, bytes [{e.begin}, {e.end}) of the shard {e.problem}: corruption at rest, not drift"
            )
        else:
            sample, stored = _stored(reader, p.position, torch.float32, p.sample_id if cfg.regenerate else None)
            if sample.id != p.sample_id:  # sound bytes, other tokens: packed under the wrong id
                res.outcome, res.detail = CORRUPT, f"its stored tokens hash to {sample.id}, not to its id"
            else:
                try:
                    recomputed, layers = route.recompute(sample)
                except Unchecked as e:
                    res.outcome, res.detail = UNCHECKED, str(e)
                else:
                    compare_sample(res, cfg.capture_points, stored, recomputed, tolerance, layers)
        if progress:
            progress(done, len(chosen))
    return rep


def exclude_bad(loc: Location, rep: AuditReport) -> tuple[list[str], list[str]]:
    """`--requeue-bad`: each failing or corrupt sample's copy no longer committed by its index
    (reason `audit: ...`, or `corrupt: ...` as `reconcile --verify` writes), so that reconcile sends
    it back to the queue. Returns (samples excluded, index files rewritten)."""
    drop: dict[str, dict[str, str]] = {}
    for r in rep.bad:
        why = f"corrupt: {r.detail}" if r.outcome == CORRUPT else f"audit {stamp(rep.at)}: {r.outcome}: {r.detail}"
        drop.setdefault(r.shard_id, {})[r.sample_id] = why
    rewritten = [shard for shard in sorted(drop) if exclude_in_index(loc, shard, drop[shard])]
    return [s for shard in sorted(drop) for s in drop[shard]], rewritten
