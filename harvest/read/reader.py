"""Read a finished (or growing) run from `<out>/<run>`, local or any fsspec URL.

Only shards with an index file exist for the reader, and of those only the samples the index
commits (harvest.formats.index.committed_samples: not excluded by a repair). Opening a run reads
the index files (small); a sample is fetched with range reads of its rows, each checked against
its crc32 (harvest.read.shard_reader: a corrupt sample fails alone, with `CorruptSample`), never
by downloading its shard. Hidden states come back in the stored dtype, or converted on request
(fp8 is dequantized with its per-token scales).

A sample committed by two index files (a commit repeated after a lost node, say) does not make
the run unreadable: the reader reads the copy `kept_copies` chooses (the one in the smallest
shard id, as `harvest reconcile --dedupe` does), says so once per open, and yields it once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from harvest.config import ConfigError, RunConfig
from harvest.errors import HarvestError
from harvest.formats.index import INDEX, ShardError, ShardIndex, kept_copies, read_index
from harvest.formats.runfile import RUN_FILE, read_run_json
from harvest.read.shard_reader import ShardReader, UnreadableShard
from harvest.storage import Location

log = logging.getLogger("harvest.read")


class RunReader:
    def __init__(self, url: str, dtype: torch.dtype | None = None) -> None:
        """`dtype`: default conversion of `hidden_states` for `get` (None: as stored)."""
        self.loc = Location.from_url(url)
        self.dtype = dtype
        self.config: RunConfig = _run_config(self.loc)
        self._indexes: dict[str, ShardIndex] = {}
        self._shards: dict[str, ShardReader] = {}
        self._unreadable: dict[str, UnreadableShard] = {}
        for name in self.loc.list(INDEX, ".json"):
            doc = read_index(self.loc, name)
            if doc["final_state"] != self.config.final_state:
                raise ShardError(f"{self.loc.describe(f'{INDEX}/{name}')}: final state {doc['final_state']!r}, but "
                                 f"the run records {self.config.final_state!r}")
            self._indexes[doc["shard_id"]] = doc
        copies = kept_copies(self._indexes.values())
        self.duplicates: dict[str, list[str]] = copies.extra  # sample -> the other shards that also commit it
        self._where: dict[str, tuple[str, int]] = {}
        self._by_shard: dict[str, list[str]] = {}
        for shard_id in sorted(self._indexes):
            position = {s: i for i, s in enumerate(self._indexes[shard_id]["samples"])}
            mine = [s for s in self._indexes[shard_id]["samples"] if copies.kept.get(s) == shard_id]
            self._by_shard[shard_id] = mine
            self._where.update((s, (shard_id, position[s])) for s in mine)
        if copies.extra:
            sample, others = next(iter(copies.extra.items()))
            n = len(copies.extra)
            log.warning("%s: %d %s committed by more than one shard (e.g. %s, read from shard %s, also in %s); "
                        "each is read once, from the shard with the smallest id; `harvest reconcile --dedupe` removes "
                        "the extra copies from the index", self.loc.root if self.loc.is_local else self.loc.url(), n,
                        "sample is" if n == 1 else "samples are", sample, copies.kept[sample], ", ".join(others))

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

    def _shard(self, shard_id: str) -> ShardReader:
        """The open shard; one that cannot be opened (UnreadableShard: damaged or gone, not a
        passing storage error) is tried once, and its error given again for its other samples."""
        if shard_id not in self._shards:
            if shard_id in self._unreadable:
                raise self._unreadable[shard_id]
            try:
                self._shards[shard_id] = ShardReader(self.loc, self._indexes[shard_id])
            except UnreadableShard as e:
                self._unreadable[shard_id] = e
                raise
        return self._shards[shard_id]

    def get(self, sample_id: str, dtype: torch.dtype | None = None) -> dict:
        """`input_ids` [T] int32, `loss_mask` [T] uint8, `hidden_states` [T, K, H] (in `dtype`,
        else the reader's, else as stored, with `hidden_scale` [T, K] for fp8),
        `capture_points`, `sample_id`. Raises CorruptSample if its stored bytes fail their crc32,
        UnreadableShard if its shard cannot be opened."""
        shard_id, i = self._locate(sample_id)
        out: dict = self._shard(shard_id).sample(i, dtype or self.dtype)
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

    def __iter__(self) -> Iterator[dict]:
        for sid in self._where:
            yield self.get(sid)

    def total_tokens(self) -> int:
        """Tokens of the samples this reader yields, each sample counted once."""
        return sum(self._indexes[shard]["tokens"][i] for shard, i in self._where.values())

    def total_bytes(self) -> int:
        """Bytes of the committed shard files in storage: what the run takes there (extra copies of
        a sample and excluded samples included, as they stay in their shards)."""
        return sum(doc["bytes"] for doc in self._indexes.values())


def hidden_at(sample: dict, point: int) -> torch.Tensor:
    """The `[T, H]` hidden states of one capture point (HF hidden_states index)."""
    return sample["hidden_states"][:, sample["capture_points"].index(point)]


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
        raise ConfigError(f"{where} is not a harvest run.json ({type(e).__name__}: {e}): garbled, or not "
                          "written by harvest") from None
    except TypeError as e:  # a field a RunConfig does not take as it is
        raise ConfigError(f"{where} is not a harvest run.json ({e})") from None
