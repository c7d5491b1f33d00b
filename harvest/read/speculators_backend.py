"""speculators reads a run in place: the `harvest` hidden-states backend of hs-connectors 0.9.

speculators 0.9's trainer loads row i's hidden states through `hs_connectors.HiddenStatesBackend`:
a class registry (`HiddenStatesBackend.registry`, filled by `@HiddenStatesBackend.register(name)`
as modules are imported), whose `--hidden-states-backend NAME` backend builds a
`HiddenStatesTransfer` (`from_train_args(args, data_path)`); the dataset then asks it
`get_cached(row)` for `{"token_ids" [T], "hidden_states" [T, 4, H]}`. This module is that backend
for harvest: `HarvestTransfer.get_cached(row)` reads the row's sample from the run's shards by
byte range (harvest.read.reader: local path or any fsspec URL, every range checked against its
crc32) and returns exactly the tensors `harvest export --format speculators` writes to
`hidden_states/hs_{row}.safetensors` (harvest.read.speculators: aux slots as stored, the last slot
the pre-norm state `y / w`). Nothing is written to the training machine's disk.

`DATA_PATH` is an in-place export (`harvest export --format speculators --in-place`): the Arrow
dataset, `token_freq.pt`, the row -> sample manifest naming the run's URL, and the final norm's
weight (`harvest-final-norm.safetensors`, H floats), so the trainer needs neither the hidden
states nor the run's checkpoint. `--harvest-run URL` reads the run from elsewhere (a copy, or
its URL as seen from the training machine).

How the backend gets into speculators' process: speculators and hs-connectors offer no plugin
discovery (no entry-point group, no environment variable; the registry is a class attribute
filled by imports), and speculators collects each backend's train flags once, when
`speculators.train.config.resolution` is first imported. So this module must be imported before
that: `harvest speculators-train ARGS` (harvest.cli.trainers) does it and then runs speculators'
own `speculators train` entry (`TrainConfig.resolve` + `speculators.train.cli.main`) with ARGS
unchanged; `torchrun ... -m harvest.cli speculators-train ARGS` is the multi-GPU form. A script of
one's own calls `harvest.read.speculators_backend.register()` before importing speculators.train.
DataLoader workers (speculators spawns them) unpickle the transfer and open their own reader.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer
from safetensors import safe_open

from harvest.errors import ConfigurationError
from harvest.read.damage import CorruptSample, UnreadableShard
from harvest.read.final_norm import FinalNorm
from harvest.read.reader import RunReader
from harvest.read.speculators import FINAL_NORM, MANIFEST, speculators_tensors

NAME = "harvest"
log = logging.getLogger("harvest.read")


class HarvestBackendError(ConfigurationError, ValueError):
    """The data path is not an export the harvest backend can read, or the backend was asked for
    what it does not do (generate hidden states, serve vLLM)."""


class HarvestTransfer(HiddenStatesTransfer):
    """Row r -> the sample `samples[r]` of the run at `run_url`, read in place. Picklable: the
    reader is opened lazily in each process (speculators' DataLoader workers are spawned)."""

    def __init__(self, run_url: str, samples: list[str], norm: FinalNorm, dtype: torch.dtype | None) -> None:
        self.run_url, self.samples, self.norm, self.dtype = run_url, list(samples), norm, dtype
        self._reader: RunReader | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self._named: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_reader=None, _pid=-1, _lock=None, _named=set())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reader(self, sample_id: str | None = None) -> RunReader:
        """This process's reader; opened again when `sample_id` was committed after it was opened
        (training that started while the run was still going)."""
        with self._lock:
            stale = self._reader is not None and sample_id is not None and sample_id not in self._reader
            if self._reader is None or self._pid != os.getpid() or stale:
                self._reader, self._pid = RunReader(self.run_url), os.getpid()
            return self._reader

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        """Row `file_idx`'s `token_ids` and `hidden_states`, as the export's file would hold them;
        None (speculators' `--on-missing` then decides) for a row past the manifest, a sample no
        longer in the run, or a corrupt one (named once, with the fix)."""
        if not 0 <= file_idx < len(self.samples):
            return None
        sid = self.samples[file_idx]
        try:
            reader = self.reader(sid)
            return speculators_tensors(reader.get(sid, self.dtype), self.norm)
        except KeyError:
            self._name(
                sid, "row %d: sample %s is not committed in %s (excluded by a repair?)", file_idx, sid, self.run_url
            )
        except (CorruptSample, UnreadableShard) as e:
            self._name(sid, "row %d: %s", file_idx, e)
        return None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise HarvestBackendError(
            "the harvest backend reads a run's committed samples; it generates nothing: train "
            "with --on-missing raise, skip or warn, and extract missing samples with harvest run"
        )

    def _name(self, key: str, msg: str, *args: object) -> None:
        if key not in self._named:
            self._named.add(key)
            log.error(msg, *args)


class HarvestBackend(HiddenStatesBackend):
    """`--hidden-states-backend harvest`: read the rows of an in-place export from its run."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--harvest-run",
            dest="harvest_run",
            type=str,
            default=None,
            help="harvest backend: the run's URL (<out>/<run>: a local path, s3://...); default: "
            "the URL the export recorded in DATA_PATH/harvest-export.json",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing: harvest extracts with its own engines (`harvest run`), not through vLLM's connector."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> HarvestTransfer:
        return open_transfer(data_path, getattr(args, "harvest_run", None))

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise HarvestBackendError("the harvest backend is for training: extract hidden states with `harvest run`")


def open_transfer(data_path: str, run_url: str | None = None) -> HarvestTransfer:
    """The transfer for an export at `data_path` (its manifest and final norm), reading the run at
    `run_url` or at the URL the export recorded."""
    try:
        with open(os.path.join(data_path, MANIFEST), encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise HarvestBackendError(
            f"{data_path} holds no {MANIFEST}: write it with `harvest export --format speculators "
            "--in-place --run-url RUN DATA_PATH`"
        ) from None
    if doc.get("format") != "speculators":
        raise HarvestBackendError(
            f"{data_path} holds a {doc.get('format')} export; speculators reads --format speculators"
        )
    norm_path = os.path.join(data_path, FINAL_NORM)
    if not os.path.exists(norm_path) or not doc.get("run_url"):
        raise HarvestBackendError(
            f"{data_path} is not an in-place export (it records no run URL or final norm): "
            "export it with `harvest export --format speculators --in-place`"
        )
    with safe_open(norm_path, framework="pt") as f:
        weight, eps = f.get_tensor("weight"), float(f.metadata()["eps"])
    dtype = getattr(torch, doc["dtype"]) if doc.get("dtype") else None
    return HarvestTransfer(run_url or doc["run_url"], doc["samples"], FinalNorm(weight, eps), dtype)


def register() -> type[HiddenStatesBackend]:
    """Put the backend in speculators' registry under `harvest` (idempotent); call it before
    `speculators.train.config` is first imported, which reads each backend's flags once."""
    registry = HiddenStatesBackend.registry
    if registry.get(NAME) is None:
        HiddenStatesBackend.register(NAME)(HarvestBackend)
    elif registry[NAME].__qualname__ != HarvestBackend.__qualname__:
        raise HarvestBackendError(f"another hidden-states backend is registered as {NAME!r}: {registry[NAME]!r}")
    backend: type[HiddenStatesBackend] = registry[NAME]
    return backend


register()
