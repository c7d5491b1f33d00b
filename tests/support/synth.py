"""Synthetic spooled samples for collector, shard, reader and export tests (no engine needed)."""

from __future__ import annotations

import numpy as np
import torch

from harvest.config import RunConfig
from harvest.formats.fp8 import to_storage
from harvest.formats.spool import SpooledSample
from harvest.ids import sample_id
from harvest.node.spooldir import write_sample

POINTS = [2, 4, 5, 8]  # eagle3 preset of an 8-layer model
HIDDEN = 16


def make_config(
    out_url: str,
    run: str = "r",
    dtype: str = "bf16",
    shard_bytes: int = 1 << 30,
    hidden: int = HIDDEN,
    codec: str = "none",
) -> RunConfig:
    return RunConfig(
        run=run,
        model="synthetic",
        capture_points=POINTS,
        hidden_size=hidden,
        out_url=out_url,
        storage_dtype=dtype,
        shard_bytes=shard_bytes,
        num_layers=8,
        codec=codec,
    )


def make_sample(seed: int, n: int, cfg: RunConfig) -> tuple[SpooledSample, torch.Tensor]:
    """A sample with `n` tokens: (as spooled in the run's dtype, its float32 hidden states)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30000, (n,), generator=g, dtype=torch.int32)
    mask = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8)
    hs = torch.randn(n, len(cfg.capture_points), cfg.hidden_size, generator=g) * (1 + seed % 7)
    sid = sample_id(ids.numpy(), mask.numpy().astype(np.uint8))
    stored, scale = to_storage(hs, cfg.torch_dtype)
    return SpooledSample(sid, ids, mask, stored, scale), hs


def spool_samples(spool_dir: str, cfg: RunConfig, lengths: list[int], seed0: int = 0) -> list[SpooledSample]:
    out = []
    for i, n in enumerate(lengths):
        s, _ = make_sample(seed0 + i, n, cfg)
        write_sample(spool_dir, s, cfg.run)
        out.append(s)
    return out
