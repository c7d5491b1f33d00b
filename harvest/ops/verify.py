"""Every committed sample of a run read back and checked against what was packed.

Readers check each sample they hand out (harvest.read.shard_reader), but only when it is read;
`verify_run`, behind `harvest reconcile --verify`, reads them all: each committed sample's ranges
against its crc32s. A shard that cannot be opened (its header or offsets damaged,
its file gone) fails every sample it commits.

With `exclude`, each corrupt sample is listed in its index's `excluded` (reason `corrupt: ...`),
so no reader reads it and reconcile, which sends a done sample that no index commits back to
the queue, has it extracted again. Where another index still commits a sound copy, that copy is
the one read from then on. No Redis: it works on the output alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from harvest.formats.index import ShardIndex, committed_samples
from harvest.ops.dedupe import exclude_in_index, read_indexes
from harvest.read.shard_reader import ShardReader, UnreadableShard
from harvest.storage import Location


@dataclass(frozen=True)
class Corruption:
    """One corrupt sample copy: where (shard, tensor, byte range of the shard file) and what."""

    shard_id: str
    sample_id: str
    tensor: str | None  # None: the shard as a whole failed (unreadable)
    begin: int
    end: int
    problem: str

    @property
    def reason(self) -> str:
        """The `excluded` reason recorded in the index."""
        where = f"tensor {self.tensor}, bytes" if self.tensor else "the whole shard, bytes"
        return f"corrupt: {where} [{self.begin}, {self.end}) {self.problem}"

    def line(self) -> str:
        return f"sample {self.sample_id} of shard {self.shard_id}: {self.reason}"


@dataclass
class VerifyReport:
    shards: int = 0  # shards with committed samples, checked
    samples: int = 0  # committed sample copies checked
    corrupt: list[Corruption] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)  # shard ids whose index now excludes a corrupt sample

    def line(self) -> str:
        text = f"verified {self.samples} samples in {self.shards} shards: {len(self.corrupt)} corrupt"
        if self.rewritten:
            text += f", excluded from {len(self.rewritten)} index files"
        return text


def verify_run(
    loc: Location, exclude: bool = False, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check every committed sample of the run folder `loc` (`<out>/<run>`); with `exclude`, drop
    each corrupt one from its index. `progress(checked, total)` is told after each sample."""
    docs = read_indexes(loc)
    total = sum(len(committed_samples(d)) for d in docs)
    rep = VerifyReport()
    for doc in docs:
        samples = committed_samples(doc)
        if not samples:
            continue
        rep.shards += 1
        bad = _check_samples(loc, doc, samples, lambda: _tick(rep, 1, progress, total))
        rep.corrupt += bad
        if exclude and bad:
            reasons: dict[str, str] = {}
            for c in bad:
                reasons.setdefault(c.sample_id, c.reason)  # a sample's first corrupt tensor names it
            if exclude_in_index(loc, doc["shard_id"], reasons):
                rep.rewritten.append(doc["shard_id"])
    return rep


def _tick(rep: VerifyReport, n: int, progress: Callable[[int, int], None] | None, total: int) -> None:
    rep.samples += n
    if progress:
        progress(rep.samples, total)


def _whole_shard(doc: ShardIndex, samples: list[str], problem: str) -> list[Corruption]:
    return [Corruption(doc["shard_id"], s, None, 0, doc["bytes"], problem) for s in samples]


def _check_samples(loc: Location, doc: ShardIndex, samples: list[str], tick: Callable[[], None]) -> list[Corruption]:
    try:
        reader = ShardReader(loc, doc)
    except UnreadableShard as e:
        return _whole_shard(doc, samples, f"cannot be read: {e.why}")
    position = {s: i for i, s in enumerate(doc["samples"])}
    bad = []
    for s in samples:
        bad += [Corruption(doc["shard_id"], s, e.tensor, e.begin, e.end, e.problem) for e in reader.check(position[s])]
        tick()
    return bad
