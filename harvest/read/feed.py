"""The training feed: an iterable dataset over a run of EAGLE-3 items (harvest.read.eagle3).

Every rank and DataLoader worker gets an equal span of a seeded, shard-local order, read ahead on
a thread (a window of the order at a time, each shard's adjacent samples in one ranged read:
harvest.read.coalesce), resumable mid-epoch (`state_dict`), optionally following a live run (its
rules: harvest.read.partition, harvest.read.follow, harvest.read.readahead). It opens its storage
lazily in each process, so it survives pickling into DataLoader workers.

Each sample comes once, even where storage holds two copies of it (harvest.read.reader). A sample
whose stored bytes fail their checksum, or whose shard cannot be opened, is logged once, by name,
and the epoch goes on with the rest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from harvest.errors import ConfigurationError
from harvest.formats.index import ShardError
from harvest.formats.runfile import read_run_json
from harvest.formats.settled import read_settled
from harvest.read.coalesce import cap_for, windows
from harvest.read.damage import CorruptSample, UnreadableShard
from harvest.read.eagle3 import eagle3_item, read_dtype
from harvest.read.follow import Shards, list_shards, tail
from harvest.read.partition import (
    Stage,
    batch_count,
    delivered,
    digest,
    part_of,
    replay,
    sample_order,
    span_sizes,
    spans,
)
from harvest.read.readahead import ReadAhead
from harvest.settings import FeedSettings
from harvest.storage import Location

log = logging.getLogger("harvest.read")


STATE_FORMAT = "harvest-feed-1"


_IN_TAIL = (
    "a rank is past its part of the epoch's view, in a followed run's tail, whose order depends on "
    "when each shard appeared: save the state before the tail, or resume at the next epoch"
)


def _window_bytes(items: list[dict[str, torch.Tensor] | Exception]) -> int:
    return sum(t.numel() * t.element_size() for i in items if isinstance(i, dict) for t in i.values())


class HiddenStateIterable(IterableDataset[dict[str, torch.Tensor]]):
    """The training feed: every committed sample once per epoch, dealt in equal contiguous spans of
    a seeded order to `world_size` ranks x DataLoader workers, read ahead on a thread, resumable
    mid-epoch, optionally following a live run. The rules are harvest.read.partition's (order,
    spans, delivery, resume) and harvest.read.follow's (view, tail); docs/architecture.md,
    "Training feed", has the contract.

    - `seed`: None reads in storage order; else the order is shuffled by (seed, epoch): shards,
      then samples within `window` shards. `set_epoch(e)` at the start of every epoch, as with
      torch's DistributedSampler: it takes the epoch's view (rank 0's, under torch.distributed).
    - `batch_size`, `num_workers`: the DataLoader's, needed only by `state_dict(batches=...)` to
      know what the loop was handed; a DataLoader with another worker count is refused.
    - `drop_remainder`: every span exactly n // parts (equal step counts), else within one.
    - `readahead_bytes`: how far the read-ahead thread may run ahead (0: read in line).
    - `coalesce_bytes`: the order is fetched in windows of this many bytes, each shard's samples
      in a window read with one ranged read per run of them adjacent in storage, a shard mostly
      wanted read whole; 0: one read a sample; None: 64 MiB on object stores (256 MiB for a
      shuffled order, whose runs are shorter), 0 in a local folder (harvest.read.coalesce).
      Memory: `readahead_bytes` plus about two windows.
    - `follow`: after its part of the view, wait for the shards committed later, until the run
      is settled (`wait_s` without a new index file: FeedStalled).

    The epoch, its view and a loaded state travel to DataLoader workers when they start, so use
    `persistent_workers=False` (the default): persistent workers would keep epoch 0's order.
    """

    def __init__(
        self,
        url: str,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        *,
        batch_size: int = 1,
        num_workers: int | None = None,
        window: int = FeedSettings.shuffle_window,
        drop_remainder: bool = False,
        readahead_bytes: int = FeedSettings.readahead_bytes,
        coalesce_bytes: int | None = None,
        follow: bool = False,
        wait_s: float = FeedSettings.follow_wait_s,
        poll_s: float = FeedSettings.follow_poll_s,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigurationError(f"rank {rank} of world size {world_size}: a rank is in [0, world size)")
        if batch_size < 1 or window < 1 or (num_workers is not None and num_workers < 0):
            raise ConfigurationError(
                f"batch_size {batch_size}, window {window}, num_workers {num_workers}: "
                "batch_size and window are at least 1, num_workers at least 0"
            )
        self.url, self.dtype, self.seed, self.rank, self.world_size = url, dtype, seed, rank, world_size
        self.batch_size, self.num_workers, self.window = batch_size, num_workers, window
        self.drop_remainder, self.coalesce_bytes, self.epoch = drop_remainder, coalesce_bytes, 0
        self.readahead_bytes, self.follow, self.wait_s, self.poll_s = readahead_bytes, follow, wait_s, poll_s
        self._shards: Shards | None = None
        self._pid = -1
        self._view: list[str] = []  # shard ids of the epoch's view, agreed by every rank
        self._stages: list[Stage] = []  # the epoch's earlier passes (load_state_dict), for `_resume_epoch`
        self._resume_epoch: int | None = None
        self._digest: str | None = None
        self._consumed = 0  # positions of this part handed out by this process's last iteration
        self._logged: set[str] = set()  # corrupt samples and shards this process has named already
        self._view = self._agree(list_shards(self._store.loc))

    # -- the run, per process ----------------------------------------------------------------------

    @property
    def _store(self) -> Shards:
        if self._shards is None or self._pid != os.getpid():
            loc = Location.from_url(self.url)
            docs = self._shards.docs if self._shards is not None else {}
            self._shards, self._pid = Shards(loc, read_run_json(loc), dict(docs)), os.getpid()
            self.dtype = read_dtype(self._shards.cfg, self.dtype)
        return self._shards

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        store = state.pop("_shards")
        state["_docs"] = store.docs if store is not None else {}  # the index documents, read once
        state["_shards"], state["_pid"] = None, -1
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        docs = state.pop("_docs", {})
        self.__dict__.update(state)
        if docs:
            loc = Location.from_url(self.url)
            self._shards, self._pid = Shards(loc, read_run_json(loc), docs), os.getpid()

    def _agree(self, names: list[str]) -> list[str]:
        """Rank 0's view for every rank when torch.distributed runs this job: ranks that list a live
        run a moment apart would see different shards, and deal some samples twice or never."""
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            box = [names]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        if self.world_size > 1 and self.follow and read_settled(self._store.loc) is None:
            log.warning(
                "rank %d of %d lists the live run %s on its own (no torch.distributed): a shard committed "
                "between the ranks' listings is read twice or never",
                self.rank,
                self.world_size,
                self.url,
            )
        return names

    # -- epochs and the order ----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: the view is the index files committed now (unless a loaded state
        already fixed this epoch's). Call it on every rank, before iterating."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._view = self._agree(list_shards(self._store.loc))
        if self._resume_epoch is not None and self._resume_epoch != epoch:
            self._stages, self._resume_epoch, self._digest = [], None, None

    def _order(self) -> tuple[list[tuple[str, list[str]]], list[str]]:
        shards = self._store.view(self._view)
        return shards, sample_order(shards, self.seed, self.epoch, self.window)

    def _parts(self) -> tuple[int, int]:
        """(this process's part, parts) for the DataLoader worker it runs in."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        if self.num_workers is not None and max(self.num_workers, 1) != workers:
            raise ConfigurationError(
                f"the feed was told num_workers={self.num_workers}, its DataLoader runs "
                f"{workers if info is not None else 0}: give both the same"
            )
        return part_of(self.rank, worker, self.world_size, workers), self.world_size * workers

    def _deal(self, order: list[str], parts: int) -> list[list[str]]:
        """The spans of this epoch: of the whole order, or of what a resumed state left of it."""
        if self._resume_epoch != self.epoch:
            return spans(order, parts, self.drop_remainder)
        if digest(order) != self._digest:
            raise ShardError(
                f"{self.url}: the index files of the shards epoch {self.epoch}'s state names changed "
                "since it was saved (a repair excluded samples?): its order cannot be resumed exactly"
            )
        return spans(replay(order, self._stages), parts)

    def __len__(self) -> int:
        """Samples in this epoch's view: all ranks together (a follower's tail comes on top)."""
        return sum(len(s) for _, s in self._store.view(self._view))

    def samples(self) -> list[str]:
        """The sample ids this process's part reads this epoch, in order (the tail not included)."""
        part, parts = self._parts()
        return self._deal(self._order()[1], parts)[part]

    # -- iterating ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        part, parts = self._parts()
        shards, order = self._order()
        where = {s: shard for shard, samples in shards for s in samples}
        mine = self._deal(order, parts)[part]
        self._consumed = 0
        yield from self._read([(where[s], s) for s in mine])
        if self.follow:
            seen, known = set(self._view), set(order)
            for new in tail(self._store, seen, known, part, parts, self.poll_s, self.wait_s):
                yield from self._read(new)
        if self._resume_epoch == self.epoch and get_worker_info() is None:
            self._stages, self._resume_epoch, self._digest = [], None, None  # this process resumed it

    def _read(self, keys: list[tuple[str, str]]) -> Iterator[dict[str, torch.Tensor]]:
        """The samples `keys` in order: fetched a window at a time (`coalesce_bytes` of the order,
        each shard's samples in it read together, harvest.read.coalesce), windows read ahead."""
        store = self._store
        groups = windows(
            keys,
            self._size,
            cap_for(store.loc.is_local, self.coalesce_bytes, self.seed is not None),
            lambda key: key[0],
        )
        ahead = ReadAhead(groups, self._fetch, _window_bytes, self.readahead_bytes)
        for group, fetched in ahead:
            results = fetched if isinstance(fetched, list) else [fetched]  # a whole window failed: its first raises
            results.reverse()  # popped as handed out: the window's memory goes with its items
            for shard, sid in group[: len(results)]:
                got = results.pop()
                self._consumed += 1
                if isinstance(got, CorruptSample):
                    self._log(sid, "skipping sample %s of shard %s: %s", sid, shard, got)
                elif isinstance(got, UnreadableShard):  # none of the shard reads
                    n = len(store.doc(shard)["samples"])
                    self._log(shard, "skipping shard %s (%d samples): %s", shard, n, got)
                elif isinstance(got, Exception):
                    raise got
                else:
                    yield got

    def _size(self, key: tuple[str, str]) -> int:
        """A sample's hidden-state bytes as stored, from its index (before its shard is opened)."""
        shard, sid = key
        store = self._store
        offsets, i = store.doc(shard)["offsets"], store.position(shard, sid)
        cfg = store.cfg
        return (offsets[i + 1] - offsets[i]) * len(cfg.capture_points) * cfg.hidden_size * cfg.torch_dtype.itemsize

    def _fetch(self, group: list[tuple[str, str]]) -> list[dict[str, torch.Tensor] | Exception]:
        """One window of the order: each shard's samples in it read together (ShardReader.samples),
        each result (the item, or the exception reading it raised) in the window's order."""
        store = self._store
        cap = cap_for(store.loc.is_local, self.coalesce_bytes, self.seed is not None)
        wanted: dict[str, list[int]] = {}
        for shard, sid in group:
            wanted.setdefault(shard, []).append(store.position(shard, sid))
        got: dict[tuple[str, int], dict[str, torch.Tensor] | Exception] = {}
        for shard, positions in wanted.items():
            try:
                reader = store.reader(shard, positions, cap)
            except UnreadableShard as e:
                got.update(((shard, p), e) for p in positions)
                continue
            for p, sample in reader.samples(positions, self.dtype, cap=cap):
                got[shard, p] = sample if isinstance(sample, Exception) else self._item(sample)
        return [got[shard, store.position(shard, sid)] for shard, sid in group]

    def _item(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | Exception:
        try:
            return eagle3_item(sample, self._store.cfg)
        except Exception as e:  # noqa: BLE001 - in the sample's place, as a failed read
            return e

    # -- mid-epoch resume --------------------------------------------------------------------------

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where this epoch stands, for `load_state_dict`: the epoch, its view (shard ids), a digest
        of its order and, per stage, what every rank's every worker has handed to its loop.
        `batches`: the batches each rank's loop took from its DataLoader this epoch (its step count;
        ranks step together), with the feed's `batch_size` and `num_workers`. None: what this
        process's own iteration yielded (a DataLoader without workers); other ranks are taken to
        have taken as many batches. A position inside a followed run's tail is refused: its order
        depends on when each shard appeared."""
        order = self._order()[1]
        resumed = self._resume_epoch == self.epoch
        stages = list(self._stages) if resumed else []
        rest = replay(order, stages)
        if batches is None:
            if self.num_workers:
                raise ConfigurationError(
                    "with DataLoader workers the feed cannot see what its loop was handed: "
                    "pass state_dict(batches=<batches taken this epoch>)"
                )
            workers, own = 1, self._consumed
            steps = -(-own // self.batch_size)
        else:
            if self.num_workers is None:
                raise ConfigurationError(
                    "state_dict(batches=...) needs the DataLoader's worker count: give the feed "
                    "num_workers= (and batch_size=) as the DataLoader has them"
                )
            workers, own, steps = max(self.num_workers, 1), None, batches
        parts, drop = self.world_size * workers, self.drop_remainder and not resumed
        sizes = span_sizes(len(rest), parts, drop)
        consumed = [0] * parts
        for r in range(self.world_size):
            ids = [part_of(r, w, self.world_size, workers) for w in range(workers)]
            mine = [sizes[p] for p in ids]
            if own is not None and r == self.rank:
                if own > mine[0] and self.follow:
                    raise ConfigurationError(_IN_TAIL)
                consumed[ids[0]] = min(own, mine[0])
                continue
            total = sum(batch_count(n, self.batch_size) for n in mine)
            if steps > total and self.follow:  # that rank's loop is reading the tail
                raise ConfigurationError(_IN_TAIL)
            for p, n in zip(ids, delivered(mine, self.batch_size, min(steps, total)), strict=False):
                consumed[p] = n
        return {
            "format": STATE_FORMAT,
            "run": self._store.cfg.run,
            "epoch": self.epoch,
            "seed": self.seed,
            "window": self.window,
            "shards": list(self._view),
            "digest": digest(order),
            "stages": [st.to_json() for st in [*stages, Stage(parts, drop, tuple(consumed))]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of `state`'s epoch yields exactly the samples no rank's loop
        was handed before it was saved, dealt again over this job's ranks and workers (in equal
        spans, whatever their number now). Call it before the DataLoader starts its workers."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigurationError(f"not a feed state of this harvest ({STATE_FORMAT})")
        run = self._store.cfg.run
        if state["run"] != run or state["seed"] != self.seed or state["window"] != self.window:
            raise ConfigurationError(
                f"the state is of run {state['run']!r}, seed {state['seed']}, window "
                f"{state['window']}; this feed reads run {run!r} with seed {self.seed}, window "
                f"{self.window}: its order would differ"
            )
        self.epoch = int(state["epoch"])
        self._view = list(state["shards"])
        self._stages = [Stage.from_json(st) for st in state["stages"]]
        self._resume_epoch, self._digest = self.epoch, state["digest"]
        self._deal(self._order()[1], 1)  # the view still gives the state's order: checked now, not in a worker

    def _log(self, key: str, msg: str, *args: object) -> None:
        """Name a corrupt sample or shard once per process, however many epochs meet it."""
        if key not in self._logged:
            self._logged.add(key)
            log.error(msg, *args)
