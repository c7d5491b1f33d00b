"""The map-style dataset over a run: item i is the i-th committed sample, as an EAGLE-3 training
item (harvest.read.eagle3); the training feed is harvest.read.feed.

It opens its storage lazily in each process, so it survives pickling into DataLoader workers. Each
sample comes once, even where storage holds two copies of it (harvest.read.reader). A sample
whose stored bytes fail their checksum raises `CorruptSample` for that index.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

from harvest.read.eagle3 import eagle3_item, read_dtype
from harvest.read.reader import RunReader


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

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "dtype": self.dtype, "_reader": None, "_pid": -1}


class HiddenStateDataset(Dataset[dict[str, torch.Tensor]]):
    """Map-style: item i is the i-th committed sample (storage order, fixed when opened)."""

    def __init__(self, url: str, dtype: torch.dtype | None = None) -> None:
        self._lazy = _Lazy(url, dtype)
        self.sample_ids = self._lazy.reader.sample_ids

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self._lazy.item(self.sample_ids[i])
