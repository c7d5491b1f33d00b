"""What `harvest run` prints when it ends, and its exit status.

Its tokens and bytes are what the index files commit, read from them (the truth), not from
counters that an interrupted commit skipped or a repair outdated. Bytes: each committed sample's
share of its shard's bytes, by tokens (a shard's bytes times the tokens of the samples it
commits, kept copies only, over all its tokens). A shard every sample of which is committed
there counts exactly its size, so a clean run's bytes are its shard files' sizes; a shard's
excluded copies (a duplicate `reconcile --dedupe` dropped, a corrupt copy `audit --requeue-bad`
or `reconcile --verify` dropped, both re-extracted elsewhere) count nothing. Per-token tensors
are the bulk of a shard, so a sample's share is its bytes in the shard but for its part of the
header and the offsets, which no sample owns.

Its exit status: 0 when every sample of the dataset is committed or failed with a reason and
every row was good; 1 when samples failed or rows were bad; 75 (EX_TEMPFAIL, as a Redis lost
past --redis-wait: the same command finishes it) when samples of the dataset are neither
committed nor failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harvest.config import RunConfig
from harvest.errors import HarvestError
from harvest.state.connection import REDIS_LOST_EXIT

UNFINISHED_EXIT = REDIS_LOST_EXIT  # temporary, as a Redis lost: the same command resumes


def committed_totals(cfg: RunConfig) -> tuple[int, int] | None:
    """(tokens, bytes) the run's index files commit (each sample's kept copy once; bytes as the
    module says), or None when the output cannot be read now."""
    from harvest.formats.index import INDEX, kept_copies, parse_index
    from harvest.formats.runfile import run_location

    try:
        loc = run_location(cfg.out_url, cfg.run)
        docs = [parse_index(loc.read_json(f"{INDEX}/{n}"), loc.path(INDEX, n)) for n in loc.list(INDEX, ".json")]
    except (OSError, HarvestError):
        return None
    kept = kept_copies(docs).kept
    tokens = nbytes = 0
    for d in docs:
        mine = sum(t for s, t in zip(d["samples"], d["tokens"], strict=False) if kept.get(s) == d["shard_id"])
        tokens += mine
        nbytes += d["bytes"] * mine // max(1, sum(d["tokens"]))
    return tokens, nbytes


@dataclass
class RunSummary:
    run: str
    out: str
    enqueued: int
    skipped: int
    bad_rows: int
    done: int
    failed: int
    tokens: int
    bytes: int
    seconds: float
    failure_reasons: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # child name -> times the supervisor restarted it
    produced: str = ""  # the producer's own summary line (rows, overlong, truncated...)
    where: str = ""  # how the operator's commands reach the run: `--work-dir DIR` or `--redis URL`
    started: bool = True  # False: nothing was queued or spooled, no engine or worker was started
    generated: tuple[int, int] | None = None  # a --regenerate run's conversations written, tokens generated
    missing: str = ""  # harvest.ops.coverage.Coverage.missing_line: the dataset's samples not settled
    stray: str = ""  # harvest.ops.coverage.Coverage.stray_line: the run's samples the dataset no longer holds
    again: int = 0  # samples of the dataset enqueued again after the extraction (a Redis that lost them)

    @property
    def exit_status(self) -> int:
        """0 when every sample of the dataset is committed or failed and every row was good; 75
        when some are neither; else 1 when samples failed or rows were bad."""
        if self.missing:
            return UNFINISHED_EXIT
        return 1 if self.failed or self.bad_rows else 0

    def lines(self) -> list[str]:
        bad = f"  bad rows: {self.bad_rows}"
        if self.bad_rows:
            bad += " (each reported above on stderr with its file and line)"
        out = [
            f"run {self.run} -> {self.out}",
            f"  samples: {self.done} done, {self.failed} failed ({self.enqueued} enqueued now, {self.skipped} already known)",
            bad,
            f"  tokens: {self.tokens}, bytes: {self.bytes}, seconds: {self.seconds:.1f}",
        ]
        if self.produced:
            out.append(f"  produced: {self.produced}")
        if self.again:
            out.append(
                f"  enqueued again: {self.again} samples of the dataset that Redis had lost (a producer pass "
                "after the extraction)"
            )
        if self.stray:
            out.append(f"  not in the dataset: {self.stray}")
        if self.generated is not None:
            out.append(
                f"  generated: {self.generated[0]} conversations written, {self.generated[1]} tokens (the "
                "engine's work: a conversation failed after its turns and requeued is written again)"
            )
        if not self.started:
            out.append("  nothing to extract: no engine or worker was started")
        for reason, n in sorted(self.failure_reasons.items(), key=lambda kv: -kv[1]):
            out.append(f"  failed because {reason}: {n}")
        if self.restarts:
            out.append("  restarted: " + ", ".join(f"{n} {k}x" for n, k in sorted(self.restarts.items())))
        out.append(f"  status: harvest status --run {self.run} {self.where}")
        if self.missing:
            out.append(f"  unfinished: {self.missing}: run the same `harvest run` command again to finish them")
        if self.failed:
            out.append(
                f"  requeue the failed: harvest requeue --run {self.run} {self.where} --all  (then run the "
                "same `harvest run` again)"
            )
        return out
