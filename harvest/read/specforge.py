"""`harvest export --format specforge`: SpecForge 0.2.0's offline EAGLE-3 feature files.

`<dest>/<shard_id>/data_<sample_id>.ckpt`, each a `torch.save` dict with `input_ids` [T] and
`loss_mask` [T] (int64), `hidden_state` [1, T, H] (the final state after the model's norm, which
SpecForge's `TargetHead` turns into the target logits with lm_head alone) and `aux_hidden_state`
[1, T, 3H] (the three aux points ascending, concatenated). SpecForge's `OfflineManifestReader`
lists `*.ckpt` recursively (sorted), so the shard folders need no index of their own.

bf16 by default: `TargetHead` is bf16 and casts nothing, so fp16 or fp32 files fail at training
time (another dtype is written on request, with a warning). Files are named by shard and sample
id, not by position, so a run that grew since the last export maps every sample to the same file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from harvest.ids import check_id
from harvest.read.eagle3 import eagle3_item
from harvest.read.reader import RunReader

DTYPE = torch.bfloat16  # what SpecForge's TargetHead computes in


def sample_file(dest: str, shard_id: str, sample_id: str) -> str:
    return os.path.join(dest, check_id(shard_id, "shard id"), f"data_{check_id(sample_id, 'sample id')}.ckpt")


def write_sample(
    sample: dict[str, Any], reader: RunReader, path: str, atomic: Callable[[str, Callable[[str], None]], None]
) -> None:
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

    atomic(path, save)
