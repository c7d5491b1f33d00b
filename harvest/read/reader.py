"""Read a finished (or growing) run from `<out>/<run>`, local or any fsspec URL.

Only shards with an index file exist for the reader. Opening a run reads the index files
(small); a sample is fetched with range reads of its rows (harvest.read.shard_reader), never by
downloading its shard. Hidden states come back in the stored dtype, or converted on request
(fp8 is dequantized with its per-token scales).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from harvest.config import RunConfig
from harvest.formats.index import INDEX, ShardError, ShardIndex, parse_index
from harvest.read.shard_reader import ShardReader
from harvest.state.runstore import read_run_json
from harvest.storage import Location


class RunReader:
    def __init__(self, url: str, dtype: torch.dtype | None = None) -> None:
        """`dtype`: default conversion of `hidden_states` for `get` (None: as stored)."""
        self.loc = Location.from_url(url)
        self.dtype = dtype
        self.config: RunConfig = read_run_json(self.loc)
        self._where: dict[str, tuple[str, int]] = {}
        self._indexes: dict[str, ShardIndex] = {}
        self._shards: dict[str, ShardReader] = {}
        for name in self.loc.list(INDEX, ".json"):
            doc = parse_index(self.loc.read_json(f"{INDEX}/{name}"), self.loc.path(INDEX, name))
            sid = doc["shard_id"]
            if doc["final_state"] != self.config.final_state:
                raise ShardError(f"{self.loc.path(INDEX, name)}: final state {doc['final_state']!r}, but the run "
                                 f"records {self.config.final_state!r}")
            self._indexes[sid] = doc
            for i, sample in enumerate(doc["samples"]):
                if sample in self._where:
                    raise ShardError(f"sample {sample} is in two shards: {self._where[sample][0]} and {sid}")
                self._where[sample] = (sid, i)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    @property
    def sample_ids(self) -> list[str]:
        """Every committed sample, in storage order (shard by shard, as packed)."""
        return list(self._where)

    @property
    def capture_points(self) -> list[int]:
        return list(self.config.capture_points)

    def shard_ids(self) -> list[str]:
        return list(self._indexes)

    def shard_samples(self, shard_id: str) -> list[str]:
        return list(self._indexes[shard_id]["samples"])

    def _shard(self, shard_id: str) -> ShardReader:
        if shard_id not in self._shards:
            self._shards[shard_id] = ShardReader(self.loc, self._indexes[shard_id])
        return self._shards[shard_id]

    def get(self, sample_id: str, dtype: torch.dtype | None = None) -> dict:
        """`input_ids` [T] int32, `loss_mask` [T] uint8, `hidden_states` [T, K, H] (in `dtype`,
        else the reader's, else as stored, with `hidden_scale` [T, K] for fp8),
        `capture_points`, `sample_id`."""
        try:
            shard_id, i = self._where[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id} is not in any committed shard of {self.loc.url()}") from None
        out: dict = self._shard(shard_id).sample(i, dtype or self.dtype)
        out["capture_points"] = self.capture_points
        out["sample_id"] = sample_id
        return out

    def tokens(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample's `input_ids` [T] int32 and `loss_mask` [T] uint8 without its hidden states
        (both come with the first read of their shard, a few bytes a token)."""
        shard_id, i = self._where[sample_id]
        shard = self._shard(shard_id)
        a, b = shard.index["offsets"][i], shard.index["offsets"][i + 1]
        return shard.rows("input_ids", a, b), shard.rows("loss_mask", a, b)

    def __iter__(self) -> Iterator[dict]:
        for sid in self._where:
            yield self.get(sid)

    def total_tokens(self) -> int:
        return sum(sum(doc["tokens"]) for doc in self._indexes.values())

    def total_bytes(self) -> int:
        return sum(doc["bytes"] for doc in self._indexes.values())


def hidden_at(sample: dict, point: int) -> torch.Tensor:
    """The `[T, H]` hidden states of one capture point (HF hidden_states index)."""
    return sample["hidden_states"][:, sample["capture_points"].index(point)]
