"""torch.utils.data datasets over a run, shaped for EAGLE-3 drafter training.

Each item holds `input_ids` [T] and `loss_mask` [T] (int64), `hidden_state` [T, H] (the final,
post-norm hidden state, the drafter's target-side input) and `aux_hidden_state` [T, (K-1)*H]
(the other capture points concatenated in ascending layer order: `[T, 3H]` for the EAGLE-3
preset). The map-style dataset gives random access by index; the iterable one streams shard
by shard (good locality on object storage) and splits shards between DataLoader workers and
distributed ranks. Both open their reader lazily in each process, so they survive pickling
into DataLoader workers.

Each sample comes once, even where storage holds two copies of it (harvest.read.reader). A
sample whose stored bytes fail their checksum is one bad item, not a failed run: the map-style
dataset raises `CorruptSample` for that index (the caller asked for that item); the iterable
one logs it once, by name, and goes on with the rest of the epoch (a shard that cannot be opened
at all is skipped the same way, named once).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.read.reader import RunReader
from harvest.read.shard_reader import CorruptSample, UnreadableShard

log = logging.getLogger("harvest.read")


class NoFinalState(ConfigurationError, ValueError):
    """The run did not capture the final hidden state, which EAGLE-3 training needs."""


def final_slot(cfg: RunConfig) -> int:
    """Where the final hidden state lies on the capture axis; refuses runs without it."""
    final = cfg.final_point
    if final is None:
        raise NoFinalState(
            f"run {cfg.run!r} captured layers {cfg.capture_points} of a {cfg.num_layers}-layer model, "
            f"not the final hidden state (index {cfg.num_layers}): re-run with --layers eagle3"
        )
    return cfg.capture_points.index(final)


def eagle3_item(sample: dict, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Split a reader sample (`hidden_states` [T, K, H]) into the EAGLE-3 training item."""
    hs = sample["hidden_states"]
    k = final_slot(cfg)
    others = [i for i in range(hs.shape[1]) if i != k]
    t = hs.shape[0]
    return {
        "input_ids": sample["input_ids"].to(torch.int64),
        "loss_mask": sample["loss_mask"].to(torch.int64),
        "hidden_state": hs[:, k].contiguous(),
        "aux_hidden_state": hs[:, others].reshape(t, -1).contiguous(),
    }


def read_dtype(cfg: RunConfig, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype training data is handed out in: `dtype`, else as stored, except that fp8
    values mean nothing without their scales, so fp8 runs give dequantized bf16."""
    if dtype is None and cfg.storage_dtype == "fp8_e4m3":
        return torch.bfloat16
    return dtype


class _Lazy:
    def __init__(self, url: str, dtype: torch.dtype | None) -> None:
        self.url, self.dtype = url, dtype
        self._reader: RunReader | None = None
        self._pid = -1

    @property
    def reader(self) -> RunReader:
        if self._reader is None or self._pid != os.getpid():
            self._reader, self._pid = RunReader(self.url), os.getpid()
            self.dtype = read_dtype(self._reader.config, self.dtype)
        return self._reader

    def item(self, sample_id: str) -> dict[str, torch.Tensor]:
        r = self.reader
        return eagle3_item(r.get(sample_id, self.dtype), r.config)

    def __getstate__(self) -> dict:
        return {"url": self.url, "dtype": self.dtype, "_reader": None, "_pid": -1}


class HiddenStateDataset(Dataset):
    """Map-style: item i is the i-th committed sample (storage order, fixed when opened)."""

    def __init__(self, url: str, dtype: torch.dtype | None = None) -> None:
        self._lazy = _Lazy(url, dtype)
        self.sample_ids = self._lazy.reader.sample_ids

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._lazy.item(self.sample_ids[i])


class HiddenStateIterable(IterableDataset):
    """Iterable: shards in order (or shuffled per epoch with `seed`), samples within a shard in
    packing order. Shards are dealt round-robin to `rank`/`world_size` and then to DataLoader
    workers, so every sample is yielded exactly once per epoch across all of them."""

    def __init__(
        self, url: str, dtype: torch.dtype | None = None, seed: int | None = None, rank: int = 0, world_size: int = 1
    ) -> None:
        self._lazy = _Lazy(url, dtype)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0
        self._logged: set[str] = set()  # corrupt samples and shards this process has named already

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Samples in the run: all ranks together (a progress figure; each rank sees ~1/world_size)."""
        return len(self._lazy.reader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        r = self._lazy.reader
        shards = r.shard_ids()
        if self.seed is not None:
            random.Random(self.seed + self.epoch).shuffle(shards)
        shards = shards[self.rank :: self.world_size]
        info = get_worker_info()
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        for shard in shards:
            for sid in r.shard_samples(shard):
                try:
                    item = self._lazy.item(sid)
                except CorruptSample as e:
                    self._log(sid, "skipping sample %s of shard %s: %s", sid, shard, e)
                    continue
                except UnreadableShard as e:  # none of the shard reads
                    self._log(shard, "skipping shard %s (%d samples): %s", shard, len(r.shard_samples(shard)), e)
                    break
                yield item

    def _log(self, key: str, msg: str, *args: object) -> None:
        """Name a corrupt sample or shard once per process, however many epochs meet it."""
        if key not in self._logged:
            self._logged.add(key)
            log.error(msg, *args)
