"""The spool: finished samples waiting on a node for the collector (DESIGN 4.4).

One file a sample, `<spool>/<sample_id>.safetensors`, written atomically, holding the tokens,
the loss mask and the hidden states `[T, K, H]` already in the run's storage dtype, so the
collector only concatenates.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save

from harvest.ids import check_id
from harvest.storage import atomic_write_local

_NAME = re.compile(r"([0-9a-f]{32})\.safetensors")


@dataclass
class SpooledSample:
    id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # [T, K, H]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def spool_path(spool_dir: str, sid: str) -> str:
    return os.path.join(spool_dir, f"{check_id(sid, 'sample id')}.safetensors")


def encode_sample(s: SpooledSample, run: str) -> bytes:
    tensors = {
        "input_ids": s.input_ids.to(torch.int32).contiguous(),
        "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
        "hidden_states": s.hidden_states.contiguous(),
    }
    return save(tensors, metadata={"sample_id": s.id, "run": run})


def write_sample(spool_dir: str, s: SpooledSample, run: str) -> int:
    data = encode_sample(s, run)
    atomic_write_local(spool_path(spool_dir, s.id), data)
    return len(data)


def read_sample(path: str) -> SpooledSample:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        return SpooledSample(
            check_id(meta.get("sample_id", ""), "sample id"),
            f.get_tensor("input_ids"),
            f.get_tensor("loss_mask"),
            f.get_tensor("hidden_states"),
        )


def list_spooled(spool_dir: str) -> list[tuple[str, str, int]]:
    """(sample_id, path, bytes) of complete spool files, oldest first."""
    out = []
    try:
        entries = list(os.scandir(spool_dir))
    except FileNotFoundError:
        return []
    for e in entries:
        m = _NAME.fullmatch(e.name)
        if m and e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            out.append((st.st_mtime_ns, m.group(1), e.path, st.st_size))
    out.sort()
    return [(sid, path, size) for _, sid, path, size in out]
