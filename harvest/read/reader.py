"""Read a finished (or growing) run from `<out>/<run>`, local or any fsspec URL.

Only shards with an index file exist for the reader, and of those only the samples the index
commits (harvest.formats.index.committed_samples: not excluded by a repair). Opening a run reads
the index files (small); a sample is fetched with range reads of its rows, each checked against
its crc32 (harvest.read.shard_reader: a corrupt sample fails alone, with `CorruptSample`), never
by downloading its shard. Hidden states come back in the stored dtype, or converted on request
(fp8 is dequantized with its per-token scales).

On an object store, requests that stay local are read ahead (harvest.read.coalesce; a local
folder reads one sample a request). A request is local when the one before it was in the same
shard or the shard before (storage order), or it follows one of the last few requests by a few
samples (a loader's threads reorder a sequential pass slightly). The shard's samples not yet
asked for in this pass over it (those after it first) are then read with it, each run of them
adjacent in storage in one ranged read (runs other than the request's are read when first asked
for), within a window that doubles with each local request up to COALESCE_BYTES and carries on
from shard to shard (a shard the window mostly covers is read whole, with its header), and held
until asked for: at most HOLD windows in all, the oldest shard's dropped first (read again if
asked for). Any other request resets the window, so random access over a run of many shards
reads what it asks for and next to nothing more. Safe to share between threads.

A sample committed by two index files (a commit repeated after a lost node, say) does not make
the run unreadable: the reader reads the copy `kept_copies` chooses (the one in the smallest
shard id, as `harvest reconcile --dedupe` does), says so once per open, and yields it once.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from harvest.config import ConfigError, RunConfig
from harvest.errors import HarvestError
from harvest.formats.index import INDEX, ShardError, ShardIndex, kept_copies, read_index
from harvest.formats.runfile import RUN_FILE, read_run_json
from harvest.read.coalesce import cap_for
from harvest.read.damage import UnreadableShard
from harvest.read.shard_reader import ShardReader
from harvest.storage import Location

log = logging.getLogger("harvest.read")

HOLD = 2  # bytes read ahead and not asked for yet, over all shards: at most this many windows' cap
NEAR = 8  # a request within this many samples after one of the last NEAR requests is sequential


class RunReader:
    def __init__(self, url: str, dtype: torch.dtype | None = None, coalesce_bytes: int | None = None) -> None:
        """`dtype`: default conversion of `hidden_states` for `get` (None: as stored).
        `coalesce_bytes`: the read-ahead window's cap (0: none; None: harvest.read.coalesce.cap_for)."""
        self.loc = Location.from_url(url)
        self.dtype = dtype
        self._cap = cap_for(self.loc.is_local, coalesce_bytes)
        self.config: RunConfig = _run_config(self.loc)
        self._indexes: dict[str, ShardIndex] = {}
        self._shards: dict[str, ShardReader] = {}
        self._unreadable: dict[str, UnreadableShard] = {}
        for name in self.loc.list(INDEX, ".json"):
            doc = read_index(self.loc, name)
            if doc["final_state"] != self.config.final_state:
                raise ShardError(
                    f"{self.loc.describe(f'{INDEX}/{name}')}: final state {doc['final_state']!r}, but "
                    f"the run records {self.config.final_state!r}"
                )
            self._indexes[doc["shard_id"]] = doc
        self._lock = threading.Lock()  # the read-ahead's state below
        self._opening: dict[str, threading.Lock] = {}
        self._recent: deque[int] = deque(maxlen=NEAR)  # run positions (in `sample_ids`) of the last requests
        self._last_shard: str | None = None  # the shard of the last request
        self._asked: dict[str, set[int]] = {}  # per shard, the samples asked for in this pass over it
        self._window = 0  # bytes read ahead with the next sequential request
        self._holding: dict[str, None] = {}  # shards that may hold bytes read ahead, the oldest first
        dt = self.config.torch_dtype
        self._token_bytes = len(self.config.capture_points) * self.config.hidden_size * dt.itemsize
        copies = kept_copies(self._indexes.values())
        self.duplicates: dict[str, list[str]] = copies.extra  # sample -> the other shards that also commit it
        self._where: dict[str, tuple[str, int]] = {}
        self._by_shard: dict[str, list[str]] = {}
        for shard_id in sorted(self._indexes):
            position = {s: i for i, s in enumerate(self._indexes[shard_id]["samples"])}
            mine = [s for s in self._indexes[shard_id]["samples"] if copies.kept.get(s) == shard_id]
            self._by_shard[shard_id] = mine
            self._where.update((s, (shard_id, position[s])) for s in mine)
        self._rank = {s: k for k, s in enumerate(self._where)}  # each sample's place in storage order
        self._positions = {shard: [self._where[s][1] for s in mine] for shard, mine in self._by_shard.items() if mine}
        self._shard_no = {shard: n for n, shard in enumerate(self._positions)}
        if copies.extra:
            sample, others = next(iter(copies.extra.items()))
            n = len(copies.extra)
            log.warning(
                "%s: %d %s committed by more than one shard (e.g. %s, read from shard %s, also in %s); "
                "each is read once, from the shard with the smallest id; `harvest reconcile --dedupe` removes "
                "the extra copies from the index",
                self.loc.root if self.loc.is_local else self.loc.url(),
                n,
                "sample is" if n == 1 else "samples are",
                sample,
                copies.kept[sample],
                ", ".join(others),
            )

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    @property
    def sample_ids(self) -> list[str]:
        """Every committed sample once, in storage order (shards by id, samples as packed)."""
        return list(self._where)

    @property
    def capture_points(self) -> list[int]:
        return list(self.config.capture_points)

    def shard_ids(self) -> list[str]:
        """The shards this reader reads samples from, by id (a shard whose every sample is excluded,
        or read from another shard, is not among them)."""
        return [s for s, samples in self._by_shard.items() if samples]

    def shard_samples(self, shard_id: str) -> list[str]:
        """The samples read from `shard_id`, as packed: each sample of the run is in exactly one
        shard's list, so dealing out shards deals out every sample once."""
        return list(self._by_shard[shard_id])

    def shard_of(self, sample_id: str) -> str:
        """The shard `sample_id` is read from."""
        return self._locate(sample_id)[0]

    def _locate(self, sample_id: str) -> tuple[str, int]:
        try:
            return self._where[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id} is not in any committed shard of {self.loc.url()}") from None

    def _shard(self, shard_id: str, want: list[int] | None = None) -> ShardReader:
        """The open shard (`want`: the samples about to be read from it, ShardReader's); one that
        cannot be opened (UnreadableShard: damaged or gone, not a passing storage error) is tried
        once, and its error given again for its other samples."""
        if shard_id not in self._shards:
            with self._lock:
                opening = self._opening.setdefault(shard_id, threading.Lock())
            with opening:  # one thread opens it; others asking meanwhile wait for that
                if shard_id not in self._shards:
                    if shard_id in self._unreadable:
                        raise self._unreadable[shard_id]
                    try:
                        self._shards[shard_id] = ShardReader(self.loc, self._indexes[shard_id], want or (), self._cap)
                    except UnreadableShard as e:
                        self._unreadable[shard_id] = e
                        raise
        return self._shards[shard_id]

    def _ahead(self, sample_id: str, shard_id: str) -> list[int]:
        """The samples of `shard_id` to read with `sample_id` (rows of its index, ascending) when
        the request is local: the shard's samples not asked for in this pass over it, those after
        it in storage order first, within the window."""
        k = self._rank[sample_id]
        _, i = self._where[sample_id]
        with self._lock:
            local = (
                self._last_shard is not None
                and 0 <= self._shard_no[shard_id] - self._shard_no[self._last_shard] <= 1
                or any(0 < k - r <= NEAR for r in self._recent)
            )
            asked = self._asked.setdefault(shard_id, set())
            if i in asked:  # a new pass over the shard (the next epoch)
                asked.clear()
            asked.add(i)
            self._recent.append(k)
            self._last_shard = shard_id
            if not local or self._cap <= 0:
                self._window = 0
                return []
            offsets = self._indexes[shard_id]["offsets"]
            size = (offsets[i + 1] - offsets[i]) * self._token_bytes
            self._window = min(self._cap, max(2 * self._window, 2 * size))
            budget, out = self._window - size, []
            mine = self._positions[shard_id]
            j = k - self._rank[self._by_shard[shard_id][0]]
            for p in mine[j + 1 :] + mine[:j]:
                if p in asked:
                    continue
                size = (offsets[p + 1] - offsets[p]) * self._token_bytes
                if size > budget:
                    break
                budget -= size
                out.append(p)
            return sorted(out)

    def held_bytes(self) -> int:
        """Bytes read ahead and not asked for yet (at most HOLD windows)."""
        return sum(shard.held_bytes() for shard in list(self._shards.values()))

    def _hold(self, shard_id: str) -> None:
        """Note that `shard_id` read ahead; drop the oldest holdings while they pass HOLD windows."""
        with self._lock:
            self._holding.pop(shard_id, None)
            self._holding[shard_id] = None
            held = {s: self._shards[s].held_bytes() for s in self._holding if s in self._shards}
            for s in [s for s, n in held.items() if n == 0]:
                del self._holding[s], held[s]
            total = sum(held.values())
            for s in list(self._holding):
                if total <= HOLD * self._cap or s == shard_id:
                    break
                self._shards[s].drop_held()
                total -= held.pop(s, 0)
                del self._holding[s]

    def get(self, sample_id: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """`input_ids` [T] int32, `loss_mask` [T] uint8, `hidden_states` [T, K, H] (in `dtype`,
        else the reader's, else as stored, with `hidden_scale` [T, K] for fp8),
        `capture_points`, `sample_id`. Raises CorruptSample if its stored bytes fail their crc32,
        UnreadableShard if its shard cannot be opened."""
        shard_id, i = self._locate(sample_id)
        ahead = self._ahead(sample_id, shard_id)
        shard = self._shard(shard_id, [i, *ahead])
        out: dict[str, Any] = shard.sample(i, dtype or self.dtype, ahead)
        if ahead:
            self._hold(shard_id)
        out["capture_points"] = self.capture_points
        out["sample_id"] = sample_id
        return out

    def tokens(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample's `input_ids` [T] int32 and `loss_mask` [T] uint8 without its hidden states
        (both come with the first read of their shard, a few bytes a token), checked as `get`'s."""
        shard_id, i = self._locate(sample_id)
        shard = self._shard(shard_id)
        a, b = shard.index["offsets"][i], shard.index["offsets"][i + 1]
        return shard.rows("input_ids", a, b), shard.rows("loss_mask", a, b)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for sid in self._where:
            yield self.get(sid)

    def total_tokens(self) -> int:
        """Tokens of the samples this reader yields, each sample counted once."""
        return sum(self._indexes[shard]["tokens"][i] for shard, i in self._where.values())

    def total_bytes(self) -> int:
        """Bytes of the committed shard files in storage: what the run takes there (extra copies of
        a sample and excluded samples included, as they stay in their shards)."""
        return sum(doc["bytes"] for doc in self._indexes.values())


def hidden_at(sample: dict[str, Any], point: int) -> torch.Tensor:
    """The `[T, H]` hidden states of one capture point (HF hidden_states index)."""
    hidden: torch.Tensor = sample["hidden_states"][:, sample["capture_points"].index(point)]
    return hidden


def _run_config(loc: Location) -> RunConfig:
    """The run in `loc`'s run.json; whatever is wrong with it (garbled, fields of another harvest)
    is a ConfigError that names the file."""
    where = loc.describe(RUN_FILE)
    try:
        return read_run_json(loc)
    except HarvestError as e:
        if where in str(e) or loc.path(RUN_FILE) in str(e):
            raise
        raise ConfigError(f"{where}: {e}") from None
    except ValueError as e:  # not JSON, or fields of the wrong type
        raise ConfigError(
            f"{where} is not a harvest run.json ({type(e).__name__}: {e}): garbled, or not written by harvest"
        ) from None
    except TypeError as e:  # a field a RunConfig does not take as it is
        raise ConfigError(f"{where} is not a harvest run.json ({e})") from None
