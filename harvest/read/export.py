"""Export a run as the per-sample files drafter trainers read.

- `specforge`: `<dest>/<shard_id>/data_<sample_id>.ckpt`, each a `torch.save` dict with
  `input_ids` [T], `loss_mask` [T] (int64), `hidden_state` [1, T, H] (final hidden state) and
  `aux_hidden_state` [1, T, (K-1)H] (`[1, T, 3H]` for the EAGLE-3 preset), the layout of
  SpecForge's offline hidden-state files (it lists `*.ckpt` recursively).
- `speculators`: `<dest>/<shard_id>/<sample_id>.safetensors` with `token_ids` [T],
  `hidden_states` [T, K, H] (capture points ascending, the final state last; `[T, 4, H]` for
  EAGLE-3) and `loss_mask` [T].

Files are named by shard and sample id, not by position, so a run that grew since the last
export maps every sample to the same file. Each file is written to a temporary name and
renamed, so an existing file is complete: an interrupted export re-run skips those and
writes only the rest.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from harvest.ids import check_id
from harvest.read.dataset import eagle3_item, final_slot, read_dtype
from harvest.read.reader import RunReader
from harvest.read.trainers import EXPORT_FORMATS
from harvest.storage import TEMP_PREFIX


@dataclass
class ExportReport:
    written: int = 0
    skipped: int = 0


def _specforge(sample: dict, reader: RunReader, path: str) -> None:
    item = eagle3_item(sample, reader.config)
    data = {
        "input_ids": item["input_ids"],
        "loss_mask": item["loss_mask"],
        "hidden_state": item["hidden_state"].unsqueeze(0),
        "aux_hidden_state": item["aux_hidden_state"].unsqueeze(0),
    }
    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses dot-names
            torch.save(data, f)

    _atomic(path, save)


def _speculators(sample: dict, reader: RunReader, path: str) -> None:
    data = {
        "token_ids": sample["input_ids"].to(torch.int64).contiguous(),
        "hidden_states": sample["hidden_states"].contiguous(),
        "loss_mask": sample["loss_mask"].to(torch.int64).contiguous(),
    }
    _atomic(path, lambda tmp: save_file(data, tmp))


def _atomic(path: str, write: Callable[[str], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=os.path.dirname(path))
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def sample_file(dest: str, fmt: str, shard_id: str, sample_id: str) -> str:
    check_id(shard_id, "shard id")
    check_id(sample_id, "sample id")
    name = f"data_{sample_id}.ckpt" if fmt == "specforge" else f"{sample_id}.safetensors"
    return os.path.join(dest, shard_id, name)


def export_run(
    run_url: str, fmt: str, dest: str, dtype: torch.dtype | None = None, progress: bool = True
) -> ExportReport:
    """Write every committed sample of the run at `run_url` into `dest` as `fmt`; files already
    there are kept. Hidden states in `dtype` (default: as stored; fp8 runs give bf16)."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    reader = RunReader(run_url)
    dtype = read_dtype(reader.config, dtype)
    if fmt == "specforge":
        final_slot(reader.config)  # a run without the final state is refused before any file is written
    write = _specforge if fmt == "specforge" else _speculators
    rep = ExportReport()
    with tqdm(total=len(reader), desc=f"export {fmt}", unit=" samples", disable=not progress) as bar:
        for shard in reader.shard_ids():
            os.makedirs(os.path.join(dest, shard), exist_ok=True)
            for sid in reader.shard_samples(shard):
                path = sample_file(dest, fmt, shard, sid)
                if os.path.exists(path):
                    rep.skipped += 1
                else:
                    write(reader.get(sid, dtype), reader, path)
                    rep.written += 1
                bar.update(1)
    return rep
