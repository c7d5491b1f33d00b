"""What the training feed sees of a run: an epoch's view (the index files listed when it starts)
and, when following a live run, the shards committed after that, until the run is settled.

**The view.** A sample exists for the feed once an index file commits it (never a shard whose
index is not written); of several copies it reads the one `harvest.formats.index.kept_copies`
keeps among the view's indexes, and never an excluded one. The view is a list of shard ids, so
every rank can be handed rank 0's (harvest.read.feed agrees on it through torch.distributed)
and a saved state can name it exactly.

**The tail.** A follower lists the index again every `poll_s` once its part of the view is read.
Each new index's samples that no earlier index of this epoch committed are dealt by sample id
(`harvest.read.partition.owner`): readers list at their own moments and share nothing, yet each
late sample goes to one of them, and every later copy of it (a reclaim committed it twice) to the
same one, which skips what it already gave. The tail ends after the first listing made once the
run's `settled.json` exists (harvest.formats.settled: every index is written before it); with no
new index file for `wait_s` and no marker, it raises `FeedStalled`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from harvest.config import RunConfig
from harvest.errors import ServiceError
from harvest.formats.index import INDEX, ShardError, ShardIndex, committed_samples, kept_copies, parse_index
from harvest.formats.settled import SETTLED, read_settled
from harvest.read.damage import UnreadableShard
from harvest.read.partition import owner
from harvest.read.shard_reader import ShardReader
from harvest.storage import Location


class FeedStalled(ServiceError, TimeoutError):
    """A followed run committed nothing new for the feed's `wait_s` and is not settled."""


def list_shards(loc: Location) -> list[str]:
    """The shard ids whose index file is in the run now, sorted."""
    return [n.removesuffix(".json") for n in loc.list(INDEX, ".json")]


@dataclass
class Shards:
    """The index documents a feed has read (each once) and its open shards (per process)."""

    loc: Location
    cfg: RunConfig
    docs: dict[str, ShardIndex] = field(default_factory=dict)
    _open: dict[str, ShardReader | UnreadableShard] = field(default_factory=dict)
    _positions: dict[str, dict[str, int]] = field(default_factory=dict)

    def doc(self, shard_id: str) -> ShardIndex:
        if shard_id not in self.docs:
            where = self.loc.path(INDEX, f"{shard_id}.json")
            try:
                doc = parse_index(self.loc.read_json(f"{INDEX}/{shard_id}.json"), where)
            except FileNotFoundError:
                raise ShardError(
                    f"{where}: the index file is gone (a state names a shard the run no longer commits)"
                ) from None
            if doc["final_state"] != self.cfg.final_state:
                raise ShardError(
                    f"{where}: final state {doc['final_state']!r}, but the run records {self.cfg.final_state!r}"
                )
            self.docs[shard_id] = doc
        return self.docs[shard_id]

    def view(self, names: Iterable[str]) -> list[tuple[str, list[str]]]:
        """(shard id, the samples read from it, as packed) for the shards `names`, in id order, each
        sample once (`kept_copies`), shards left with none left out."""
        docs = [self.doc(n) for n in sorted(set(names))]
        kept = kept_copies(docs).kept
        out = []
        for doc in docs:
            mine = [s for s in committed_samples(doc) if kept[s] == doc["shard_id"]]
            if mine:
                out.append((doc["shard_id"], mine))
        return out

    def position(self, shard_id: str, sample_id: str) -> int:
        """Where `sample_id` lies in its shard (its row in the index's lists)."""
        if shard_id not in self._positions:
            self._positions[shard_id] = {s: i for i, s in enumerate(self.doc(shard_id)["samples"])}
        return self._positions[shard_id][sample_id]

    def reader(self, shard_id: str, want: Iterable[int] = (), cap: int | None = None) -> ShardReader:
        """The open shard (`want`, `cap`: ShardReader's, when this opens it); one that cannot be
        opened fails every later call the same way."""
        got = self._open.get(shard_id)
        if got is None:
            try:
                got = ShardReader(self.loc, self.doc(shard_id), want, cap)
            except UnreadableShard as e:
                got = e
            self._open[shard_id] = got
        if isinstance(got, UnreadableShard):
            raise got
        return got


def tail(
    shards: Shards, seen: set[str], known: set[str], part: int, parts: int, poll_s: float, wait_s: float
) -> Iterator[list[tuple[str, str]]]:
    """Each listing's new samples for `part` of `parts`, as (shard id, sample id) in shard-id order,
    until the run is settled. `seen`: shard ids already dealt this epoch; `known`: samples already
    dealt (both updated). Raises FeedStalled after `wait_s` without a new index or the marker."""
    loc = shards.loc
    last_new = time.monotonic()
    while True:
        settled = read_settled(loc) is not None  # before the listing: it then holds every index
        new = [n for n in list_shards(loc) if n not in seen]
        if new:
            last_new = time.monotonic()
            mine = []
            for shard_id in new:
                seen.add(shard_id)
                for s in committed_samples(shards.doc(shard_id)):
                    if s not in known:
                        known.add(s)
                        if owner(s, parts) == part:
                            mine.append((shard_id, s))
            if mine:
                yield mine
        if settled:
            return
        waited = time.monotonic() - last_new
        if waited >= wait_s:
            raise FeedStalled(
                f"{loc.url()}: no new index file for {waited:.0f}s and the run is not settled (no {SETTLED}); "
                f"{len(known)} samples committed so far this epoch. Is the run still going? "
                f"(`harvest status --run {shards.cfg.run}`) Pass wait_s= to wait longer, or follow=False to "
                "read only what is committed"
            )
        time.sleep(min(poll_s, wait_s - waited))
