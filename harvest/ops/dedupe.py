"""One committed copy per sample: the extra copies excluded in their index files.

Two index files can commit the same sample (a commit repeated after a lost node, two runners on
one output). Readers already read one copy (harvest.formats.index.kept_copies, the one in the
smallest shard id) and warn; `dedupe_run`, behind `harvest reconcile --dedupe`, makes storage
say the same: each index holding a copy that is not kept is rewritten, whole (`write_atomic`),
to list it in `excluded` with the shard that keeps it. The bytes stay in their shard; only the
index stops committing them, so no reader's answer changes.

Safe while the run goes on: collectors only ever create new index files, never rewrite one, so
an index rewritten here loses nothing of theirs, and a new index that lands meanwhile is simply
dealt with by the next run. Idempotent: an excluded copy no longer counts, so a second run finds
nothing to do. No Redis: it works on the output alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from harvest.formats.claims import Claim, claim_file
from harvest.formats.index import (
    INDEX,
    ShardIndex,
    encode_index,
    index_file,
    kept_copies,
    parse_index,
    with_excluded,
)
from harvest.storage import Location, retry


@dataclass
class DedupeReport:
    samples: list[str] = field(default_factory=list)  # samples that had more than one committed copy
    rewritten: list[str] = field(default_factory=list)  # shard ids whose index now excludes a copy

    def line(self) -> str:
        return (
            f"deduplicated {len(self.samples)} samples committed by more than one shard "
            f"({len(self.rewritten)} index files rewritten)"
        )


def read_indexes(loc: Location) -> list[ShardIndex]:
    """Every index file of the run folder `loc`, parsed, by shard id."""
    names = retry(lambda: loc.list(INDEX, ".json"), f"listing {loc.path(INDEX)}")
    return [
        parse_index(
            retry(lambda n=n: loc.read_json(f"{INDEX}/{n}"), f"reading {loc.path(INDEX, n)}"), loc.path(INDEX, n)
        )
        for n in names
    ]


def exclude_in_index(loc: Location, shard_id: str, reasons: Mapping[str, str]) -> bool:
    """Rewrite shard `shard_id`'s index file, whole, so that it no longer commits the samples of
    `reasons` ({sample: why}); False when it already did not (nothing written). The file is read
    again just before, so a repair that rewrote it meanwhile keeps its exclusions."""
    name = index_file(shard_id)
    fresh = parse_index(retry(lambda: loc.read_json(name), f"reading {loc.path(name)}"), loc.path(name))
    doc = with_excluded(fresh, reasons)
    if doc == fresh:
        return False
    retry(lambda: loc.write_atomic(name, encode_index(doc)), f"writing {loc.path(name)}")
    return True


def dedupe_run(loc: Location) -> DedupeReport:
    """Exclude every extra committed copy of a sample from its index, in the run folder `loc`
    (`<out>/<run>`); the copy kept is the one readers read."""
    copies = kept_copies(read_indexes(loc))
    drop: dict[str, dict[str, str]] = {}  # shard id -> {sample: reason}
    for sample, others in copies.extra.items():
        for shard in others:
            drop.setdefault(shard, {})[sample] = f"duplicate: kept in shard {copies.kept[sample]}"
    rep = DedupeReport(samples=list(copies.extra))
    rep.rewritten = [shard for shard in sorted(drop) if exclude_in_index(loc, shard, drop[shard])]
    for sample in copies.extra:
        _claim_for(loc, sample, copies.kept[sample])
    return rep


def _claim_for(loc: Location, sample: str, shard: str) -> None:
    """Point the sample's claim (harvest.formats.claims) at the copy kept, so a collector that
    meets it later finds it committed, not abandoned in an index that now excludes it."""
    name = claim_file(sample)
    raw = retry(lambda: loc.read_bytes(name) if loc.exists(name) else None, f"reading {loc.path(name)}")
    held = Claim.from_bytes(raw) if raw is not None else None
    if held is None or held.shard != shard:
        body = Claim(shard, held.ledger if held else "").to_bytes()
        retry(lambda: loc.write_atomic(name, body), f"writing {loc.path(name)}")
