"""SpecForge reads a run in place: feature files that point into the run's shards.

SpecForge 0.2's offline data plane (`specforge train` with `data.hidden_states_path`) lists
`*.ckpt` files (`OfflineManifestReader`: one `file://` SampleRef per file, no file opened), and
every consumer of a ref loads the file with `load_feature_file` = `torch.load(path,
weights_only=False, mmap=True)` and then asks the loaded object for keys (`key in raw`,
`raw[key]`): `LocalFeatureStore.get` for training and evaluation, `count_effective_feature_tokens`
for the draft vocabulary, `ingest_offline_features` for a disaggregated producer. The store is
fixed (`build_offline_runtime` constructs a `LocalFeatureStore`; `specforge train` resolves only
the built-in algorithm registry), so the file itself is the one seam SpecForge's own command
offers without a patch: harvest writes a pointer in it.

A pointer file (`harvest export --format specforge --in-place`; same names as the export,
`<dest>/<shard>/data_<sample>.ckpt`, so SpecForge lists the samples in the same order) is a
`torch.save` of a `HarvestFeatures`: the run's URL, the sample id, its `input_ids` and
`loss_mask` (int64, a few bytes a token) and the dtype. Loading it gives that mapping back; its
`hidden_state` [1, T, H] and `aux_hidden_state` [1, T, 3H] are read from the run's shards by byte
range on first access (both in one read, each range checked against its crc32), exactly the
tensors the export's file would hold (harvest.read.specforge). Counting the vocabulary touches
only the tokens. Nothing is written on the training machine.

It rests on SpecForge's `weights_only=False`: a SpecForge that loaded feature files with
`weights_only=True` would refuse these files loudly (harvest's class is not an allowed global),
never read them wrong. What SpecForge lacks for a cleaner seam is in README ("Training a drafter").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from harvest.errors import ConfigurationError
from harvest.formats.index import ShardError
from harvest.read.eagle3 import eagle3_item
from harvest.read.reader import RunReader

FORMAT = 1  # of the pointer's pickled arguments; a newer harvest reads older pointers
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
_TOKENS = ("input_ids", "loss_mask")

_readers: dict[tuple[int, str], RunReader] = {}
_lock = threading.Lock()


class PointerError(ConfigurationError, ValueError):
    """A pointer file this harvest cannot follow (a newer format, or a sample gone from its run)."""


def run_reader(url: str, sample_id: str) -> RunReader:
    """This process's reader of the run at `url` (one per process and run, shared by SpecForge's
    loader threads); opened again when `sample_id` was committed after it was opened."""
    key = (os.getpid(), url)
    with _lock:
        reader = _readers.get(key)
        if reader is None or sample_id not in reader:
            reader = _readers[key] = RunReader(url)
        return reader


class HarvestFeatures(Mapping[str, Any]):
    """One sample's SpecForge features: tokens held, hidden states read from the run when asked."""

    def __init__(
        self, run_url: str, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, dtype: str
    ) -> None:
        self.run_url, self.sample_id, self.dtype = run_url, sample_id, dtype
        self._tensors: dict[str, torch.Tensor] = {"input_ids": input_ids, "loss_mask": loss_mask}

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _restore,
            (FORMAT, self.run_url, self.sample_id, self._tensors["input_ids"], self._tensors["loss_mask"], self.dtype),
        )

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in KEYS:
            raise KeyError(key)
        if key not in self._tensors:
            self._fetch()
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(KEYS)

    def __len__(self) -> int:
        return len(KEYS)

    def _fetch(self) -> None:
        reader = run_reader(self.run_url, self.sample_id)
        try:
            sample = reader.get(self.sample_id, getattr(torch, self.dtype))
        except KeyError:
            raise PointerError(
                f"sample {self.sample_id} is not committed in {self.run_url} (a repair excluded it?): "
                "export the run again with --in-place"
            ) from None
        item = eagle3_item(sample, reader.config)
        if not torch.equal(item["input_ids"], self._tensors["input_ids"]):  # ids derive from tokens: never expected
            raise ShardError(f"sample {self.sample_id} of {self.run_url}: stored tokens differ from its pointer's")
        self._tensors["hidden_state"] = item["hidden_state"].unsqueeze(0)
        self._tensors["aux_hidden_state"] = item["aux_hidden_state"].unsqueeze(0)


def _restore(
    fmt: int, run_url: str, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, dtype: str
) -> HarvestFeatures:
    """What unpickling a pointer file calls (torch.load): the features, nothing read yet."""
    if fmt > FORMAT:
        raise PointerError(f"a harvest pointer of format {fmt} (this harvest reads {FORMAT}): upgrade harvest")
    return HarvestFeatures(run_url, sample_id, input_ids, loss_mask, dtype)


def write_pointer(
    reader: RunReader,
    sample_id: str,
    dtype: torch.dtype,
    path: str,
    atomic: Callable[[str, Callable[[str], None]], None],
) -> None:
    """The pointer file of one sample at `path` (its tokens read and checked now)."""
    ids, mask = reader.tokens(sample_id)
    features = HarvestFeatures(
        reader.loc.url(), sample_id, ids.to(torch.int64), mask.to(torch.int64), str(dtype).removeprefix("torch.")
    )

    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses dot-names
            torch.save(features, f)

    atomic(path, save)
