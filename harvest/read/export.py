"""Export a run as the files a drafter trainer reads, checked against what that trainer expects.

Both trainers train EAGLE-3 on three aux points and the final state, in that order (aux
ascending: the order vLLM and SGLang capture them, and harvest's). `trainer_points` refuses any
other set before a file is written, naming `--layers`; `layer_notes` says which trainer flag a
non-default aux set needs. The layouts are in their own modules: `harvest.read.specforge`
(per-sample `.ckpt`) and `harvest.read.speculators` (an Arrow dataset, `hidden_states/hs_{row}`,
`token_freq.pt`). Every file is written to a temporary name and renamed, so an existing file is
complete: an interrupted export re-run keeps those and writes only the rest.

`in_place` writes only the small part, and the trainer reads the hidden states from the run
itself, by byte range: for speculators the dataset, `token_freq.pt` and the manifest, read through
the `harvest` hidden-states backend (harvest.read.speculators_backend); for SpecForge a pointer
file per sample with its tokens (harvest.read.specforge_feed).

A corrupt sample (its stored bytes fail their checksum, or its shard cannot be opened at all:
harvest.read.shard_reader) does not stop an export: every other sample is exported, and the
report names each corrupt one with its shard
(`harvest export` then exits 1), so a re-run after `harvest reconcile --verify` has dropped and
re-extracted them writes just those.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import harvest.read.specforge as specforge
import harvest.read.specforge_feed as specforge_feed
from harvest.atomic import atomic_path
from harvest.config import RunConfig
from harvest.errors import HarvestError, StorageError
from harvest.progress import progress as progress_display
from harvest.read.damage import CorruptSample, UnreadableShard
from harvest.read.eagle3 import read_dtype
from harvest.read.final_norm import FinalNorm, FinalNormError
from harvest.read.reader import RunReader
from harvest.read.speculators import export_speculators
from harvest.read.trainers import EXPORT_FORMATS, TRAINER_NAMES, ExportError
from harvest.storage import TEMP_PREFIX


class ExportStorageError(StorageError, OSError):
    """The run's output (RUN_URL) could not be read, or DEST written: the storage's own words."""


@dataclass
class ExportReport:
    written: int = 0
    skipped: int = 0
    notes: list[str] = field(default_factory=list)  # for the user: trainer flags this export needs, dtype warnings
    # (sample id, why) of samples not exported: their bytes failed their check, or their shard cannot be opened
    corrupt: list[tuple[str, CorruptSample | UnreadableShard]] = field(default_factory=list)


def trainer_points(cfg: RunConfig, fmt: str) -> tuple[list[int], int]:
    """The run's (aux points, final point), refused unless they are three aux points and the final state."""
    final = cfg.final_point
    aux = [p for p in cfg.capture_points if p != final]
    if final is None or len(aux) != 3:
        L = cfg.num_layers or "L"
        raise ExportError(
            f"run {cfg.run!r} captured layers {cfg.capture_points} of a {cfg.num_layers}-layer model; "
            f"{TRAINER_NAMES[fmt]} trains EAGLE-3 on three aux layers and the final state (index {L}): "
            "re-run with --layers eagle3, --layers <draft config.json>, or --layers a,b,c," + str(L)
        )
    return aux, final


def layer_notes(fmt: str, aux: list[int], num_layers: int) -> list[str]:
    """The trainer flags a non-default aux set needs (none for the `eagle3` preset, both trainers' default)."""
    if not num_layers or aux == [2, num_layers // 2, num_layers - 3]:
        return []
    if fmt == "speculators":
        return [
            f"train with --target-layer-ids {' '.join(map(str, aux))} (this run's aux layers; the default is "
            f"{2} {num_layers // 2} {num_layers - 3})"
        ]
    sglang = [p - 1 for p in aux]
    return [
        f"train a draft whose config has eagle_config.eagle_aux_hidden_state_layer_ids {sglang} (SGLang's ids "
        f"of this run's aux layers {aux}), or set model.aux_hidden_state_layer_ids {sglang}"
    ]


def export_run(
    run_url: str,
    fmt: str,
    dest: str,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    model: str | None = None,
    in_place: bool = False,
) -> ExportReport:
    """Write every committed sample of the run at `run_url` into `dest` as `fmt`; files already
    there are kept. Hidden states in `dtype` (default: bf16 for SpecForge, else as stored; fp8
    runs give bf16). `model`: the run's checkpoint here (default: the run's model path), whose
    final norm the speculators export reads. Every OSError on the way (reading `run_url`, writing
    `dest`: both the user's storage, an object store's with no file name) is an ExportStorageError
    with the storage's message. `in_place`: no hidden states in `dest`; the trainer reads them from
    `run_url` (so it must stay readable from the training machine)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    try:
        return _export(run_url, fmt, dest, dtype, progress, model, in_place)
    except OSError as e:
        if isinstance(e, HarvestError):  # an OSError that already says what to fix
            raise
        # Reads of the run name their object (harvest.storage.named); a write or a library's error
        # that names none is told with the export it stopped.
        named = e.filename is not None or run_url in str(e) or dest in str(e)
        raise ExportStorageError(str(e) if named else f"{e} (exporting {run_url} to {dest})") from e


def _export(
    run_url: str, fmt: str, dest: str, dtype: torch.dtype | None, progress: bool, model: str | None, in_place: bool
) -> ExportReport:
    reader = RunReader(run_url)
    aux, _ = trainer_points(reader.config, fmt)
    rep = ExportReport(notes=layer_notes(fmt, aux, reader.config.num_layers))
    if fmt == "speculators":
        try:
            norm = FinalNorm.from_checkpoint(model or reader.config.model, "pass --model with its path here")
            norm.unapply(torch.ones(1, reader.config.hidden_size))  # refused (1 + w) or zero norms: before any file
            rep.written, rep.skipped, rep.corrupt = export_speculators(
                reader, dest, read_dtype(reader.config, dtype), norm, _atomic, progress, in_place
            )
        except FinalNormError as e:
            raise ExportError(str(e)) from None
        return rep
    if dtype is not None and dtype != specforge.DTYPE:
        rep.notes.append(
            f"warning: SpecForge reads bf16 only (its TargetHead is bf16 and casts nothing): "
            f"these {str(dtype).removeprefix('torch.')} files fail at training time"
        )
    dtype = dtype or specforge.DTYPE
    with progress_display(f"export {fmt}", " samples", total=len(reader), enabled=progress) as bar:
        for shard in reader.shard_ids():
            os.makedirs(os.path.join(dest, shard), exist_ok=True)
            for sid in reader.shard_samples(shard):
                path = specforge.sample_file(dest, shard, sid)
                if os.path.exists(path):
                    rep.skipped += 1
                else:
                    try:
                        if in_place:  # the tokens now (checked); the hidden states when SpecForge loads the file
                            specforge_feed.write_pointer(reader, sid, dtype, path, _atomic)
                        else:
                            specforge.write_sample(reader.get(sid, dtype), reader, path, _atomic)
                    except (CorruptSample, UnreadableShard) as e:
                        rep.corrupt.append((sid, e))
                    else:
                        rep.written += 1
                bar.update(1)
    return rep


def _atomic(path: str, write: Callable[[str], None]) -> None:
    """How the trainers' layouts write each file: `write(tmp)` to a temporary name, renamed to
    `path` (harvest.atomic). Not fsynced: a killed export leaves no partial file, a power cut may."""
    with atomic_path(path, prefix=TEMP_PREFIX, fsync=False) as tmp:
        write(tmp)
