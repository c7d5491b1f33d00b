"""The EAGLE-3 training item, cut from a reader sample.

`input_ids` [T] and `loss_mask` [T] (int64), `hidden_state` [T, H] (the final, post-norm hidden
state, the drafter's target-side input) and `aux_hidden_state` [T, (K-1)*H] (the other capture
points concatenated in ascending layer order: `[T, 3H]` for the EAGLE-3 preset).
"""

from __future__ import annotations

from typing import Any

import torch

from harvest.config import RunConfig
from harvest.errors import ConfigurationError


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


def eagle3_item(sample: dict[str, Any], cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Split a reader sample (`hidden_states` [T, K, H]) into the EAGLE-3 training item."""
    hs = sample["hidden_states"]
    k = final_slot(cfg)
    t, n = hs.shape[0], hs.shape[1]
    # the final state first or last: the others are one slice, copied without a gather
    if k == 0:
        aux = hs[:, 1:]
    elif k == n - 1:
        aux = hs[:, : n - 1]
    else:
        aux = hs[:, [i for i in range(n) if i != k]]
    return {
        "input_ids": sample["input_ids"].to(torch.int64),
        "loss_mask": sample["loss_mask"].to(torch.int64),
        "hidden_state": hs[:, k].contiguous(),
        "aux_hidden_state": aux.reshape(t, -1).contiguous(),
    }


def read_dtype(cfg: RunConfig, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype training data is handed out in: `dtype`, else as stored, except that fp8
    values mean nothing without their scales, so fp8 runs give dequantized bf16."""
    if dtype is None and cfg.storage_dtype == "fp8_e4m3":
        return torch.bfloat16
    return dtype
