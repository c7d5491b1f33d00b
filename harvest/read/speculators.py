"""`harvest export --format speculators`: exactly what speculators' trainer reads with `--data-path DEST`
(speculators 0.9.0, `speculators.train.data.ArrowDataset` with hs-connectors' `FileTransfer`):

- an Arrow dataset saved with `datasets` at DEST: columns `input_ids`, `loss_mask` (int64 lists)
  and `seq_len`, torch-formatted, as speculators' own preprocessing saves it;
- `DEST/hidden_states/hs_{row}.safetensors`: `token_ids` [T] int64 (the trainer drops a sample,
  with only a warning, whose ids differ from its row's `input_ids`) and `hidden_states` [T, 4, H]:
  the three aux points ascending, then the final state *before* the model's norm (vLLM's layer
  id L: the trainer applies the norm and lm_head itself). harvest stores the state after the
  norm, so the last slot is `y / w` (harvest.read.final_norm);
- `DEST/token_freq.pt`: {token id: count over loss-masked tokens}, what `--draft-vocab-size`
  builds the draft vocabulary from (without it the trainer silently keeps the full vocabulary),
  counted as speculators' `save_token_frequency_distribution` counts.

Row r is one sample for good: `DEST/harvest-export.json` plans the rows (sample ids in row order)
before any file is written, and a re-run after the run grew keeps those rows and appends the new
samples. Hidden-state files are written to a temporary name and renamed, so an existing one is
complete and kept. The dataset and token_freq.pt are rewritten for all rows at every export
(token ids only: small); the trainer's cached `d2t-*.npy` / `t2d-*.npy`, derived from the old
token_freq.pt, are removed when the counts change.

In place (`--in-place`, harvest.read.speculators_backend): only the small part is written, the
dataset, `token_freq.pt` and the manifest, which then also records the run's URL and the dtype,
beside `harvest-final-norm.safetensors` (the final norm's weight and eps): no `hidden_states/`.
speculators' `--hidden-states-backend harvest` reads each row from the run's shards by byte range
and computes the same tensors (`speculators_tensors`) the files would hold. A DEST keeps the form
it was first exported in.

A row whose sample is corrupt (harvest.read.shard_reader: CorruptSample, UnreadableShard) gets no
file; every other
row's is written, but the dataset and token_freq.pt, which list every row, are left as the last
complete export wrote them (or absent), so DEST never names a row it has no file for: the re-run
after `harvest reconcile --verify` has re-extracted the sample completes it.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file

from harvest.atomic import atomic_folder
from harvest.progress import progress as progress_display
from harvest.read.damage import CorruptSample, UnreadableShard
from harvest.read.final_norm import FinalNorm
from harvest.read.reader import RunReader
from harvest.read.trainers import ExportError
from harvest.storage import TEMP_PREFIX, atomic_write_local

MANIFEST = "harvest-export.json"
HIDDEN = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
FINAL_NORM = "harvest-final-norm.safetensors"  # in place: the norm the backend undoes, so training needs no checkpoint
PRE_NORM = "final:pre-norm (y / w of harvest's post-norm state)"


def hs_file(dest: str, row: int) -> str:
    return os.path.join(dest, HIDDEN, f"hs_{int(row)}.safetensors")


def export_speculators(
    reader: RunReader,
    dest: str,
    dtype: torch.dtype | None,
    norm: FinalNorm,
    atomic: Callable[[str, Callable[[str], None]], None],
    progress: bool = True,
    in_place: bool = False,
) -> tuple[int, int, list[tuple[str, CorruptSample | UnreadableShard]]]:
    """Write (or complete) the speculators dataset of `reader`'s run at `dest`; (written, kept,
    the corrupt samples whose rows could not be written). `in_place`: no hidden-state files, the
    rows are read from the run by the `harvest` backend (every row counts as written)."""
    if importlib.util.find_spec("datasets") is None:  # checked before any file is written
        raise ExportError(
            "the speculators export saves its dataset with the `datasets` package: "
            "pip install 'harvest[speculators]' (or datasets)"
        )
    rows = _plan_rows(reader, dest, dtype, in_place)
    if in_place:
        atomic(
            os.path.join(dest, FINAL_NORM),
            lambda tmp: save_file(
                {"weight": norm.weight.contiguous()},
                tmp,
                metadata={"eps": repr(norm.eps), "model_type": norm.model_type},
            ),
        )
    else:
        os.makedirs(os.path.join(dest, HIDDEN), exist_ok=True)
    written = kept = 0
    corrupt: list[tuple[str, CorruptSample | UnreadableShard]] = []
    ids_col, mask_col = [], []
    freq: Counter[int] = Counter()
    with progress_display("export speculators", unit=" samples", total=len(rows), enabled=progress) as bar:
        for row, sid in enumerate(rows):
            bar.update(1)
            path = hs_file(dest, row)
            try:
                if in_place:
                    ids, mask = reader.tokens(sid)  # checked against their crc32s; the hidden states at read time
                    written += 1
                elif os.path.exists(path):
                    ids, mask = reader.tokens(sid)
                    kept += 1
                else:
                    sample = reader.get(sid, dtype)
                    ids, mask = sample["input_ids"], sample["loss_mask"]
                    atomic(path, partial(save_file, speculators_tensors(sample, norm)))
                    written += 1
            except (CorruptSample, UnreadableShard) as e:
                corrupt.append((sid, e))
                continue
            ids, mask = ids.to(torch.int64), mask.to(torch.int64)
            ids_col.append(ids.tolist())
            mask_col.append(mask.tolist())
            freq.update(ids[mask.bool()].tolist())
    if corrupt:
        return written, kept, corrupt  # the dataset would name rows without a file: left as it was
    freq_path = os.path.join(dest, TOKEN_FREQ)
    old_freq = torch.load(freq_path, weights_only=True) if os.path.exists(freq_path) else None
    if old_freq != dict(freq):  # the trainer's vocab mappings cached from the old counts are stale
        for stale in glob.glob(os.path.join(dest, "d2t-*.npy")) + glob.glob(os.path.join(dest, "t2d-*.npy")):
            os.unlink(stale)
    _save_dataset(dest, ids_col, mask_col)
    atomic(freq_path, lambda tmp: _save_freq(dict(freq), tmp))
    return written, kept, corrupt


def speculators_tensors(sample: dict[str, Any], norm: FinalNorm) -> dict[str, torch.Tensor]:
    """A reader sample as speculators reads a row: `token_ids` [T] int64, `hidden_states` [T, K, H]
    with the last slot the pre-norm state `y / w`, in the sample's dtype (the export's files and the
    in-place backend both go through here, so they hold the same bytes). The last slot is replaced
    in `sample`'s own tensor (a reader's sample owns it): no second copy of the aux slots."""
    hs = sample["hidden_states"].contiguous()
    hs[:, -1] = norm.unapply(hs[:, -1]).to(hs.dtype)
    return {"token_ids": sample["input_ids"].to(torch.int64).contiguous(), "hidden_states": hs}


def _plan_rows(reader: RunReader, dest: str, dtype: torch.dtype | None, in_place: bool) -> list[str]:
    """Sample ids in row order: the rows planned by an earlier export, then the run's new samples.
    Written to the manifest before any row is, so a row never changes sample. In place, the
    manifest also names the run's URL and the dtype rows are read in."""
    path = os.path.join(dest, MANIFEST)
    old: list[str] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("run") != reader.config.run or doc.get("format") != "speculators":
            raise ExportError(
                f"{dest} holds the {doc.get('format')} export of run {doc.get('run')!r}, not of run "
                f"{reader.config.run!r}: choose another DEST"
            )
        if bool(doc.get("in_place")) != in_place:
            was, now = (
                ("in place", "with hidden-state files")
                if doc.get("in_place")
                else ("with hidden-state files", "in place")
            )
            raise ExportError(f"{dest} holds this run's export {was}; to export it {now}, choose another DEST")
        old = list(doc.get("samples", []))
        gone = [s for s in old if s not in reader]
        if gone:
            raise ExportError(
                f"{dest}: {len(gone)} exported samples (first {gone[0]}) are not in the run "
                f"at {reader.loc.url()}: choose another DEST"
            )
    elif os.path.isdir(dest) and os.listdir(dest):
        raise ExportError(f"{dest} is not empty and holds no harvest export: choose an empty or new DEST")
    seen = set(old)
    rows = old + [s for s in reader.sample_ids if s not in seen]
    if rows != old or not old or in_place:
        os.makedirs(dest, exist_ok=True)
        doc = {
            "format": "speculators",
            "run": reader.config.run,
            "capture_points": reader.capture_points,
            "slots": reader.config.slots()[:-1] + [PRE_NORM],
            "samples": rows,
        }
        if in_place:  # what the backend needs besides the rows (the URL: where the run is read from now)
            doc.update(
                in_place=True, run_url=reader.loc.url(), dtype=str(dtype).removeprefix("torch.") if dtype else None
            )
        atomic_write_local(path, json.dumps(doc, indent=1).encode())
    return rows


def _save_dataset(dest: str, ids: list[list[int]], mask: list[list[int]]) -> None:
    """The Arrow dataset at `dest`, saved beside the other files: built in a temp dir, then moved in
    (state.json, which names the data files, last: harvest.atomic), stale data files removed."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets.utils.logging import disable_progress_bar, enable_progress_bar, is_progress_bar_enabled

    features = Features(
        {"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")), "seq_len": Value("int64")}
    )
    ds = Dataset.from_dict({"input_ids": ids, "loss_mask": mask, "seq_len": [len(x) for x in ids]}, features=features)
    ds.set_format(type="torch")
    bars = is_progress_bar_enabled()
    disable_progress_bar()  # the export's own bar counts the samples
    try:
        with atomic_folder(dest, prefix=TEMP_PREFIX, into=True, last=["state.json"]) as tmp:
            ds.save_to_disk(tmp)
            names = os.listdir(tmp)
            for old in glob.glob(os.path.join(dest, "data-*.arrow")):
                if os.path.basename(old) not in names:
                    os.unlink(old)
    finally:
        if bars:
            enable_progress_bar()


def _save_freq(freq: dict[int, int], tmp: str) -> None:
    with open(tmp, "wb") as f:  # a file object: torch's zip writer refuses dot-names
        torch.save(freq, f)
