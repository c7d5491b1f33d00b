"""fp8 e4m3 storage with a per-token, per-capture-point scale.

Hidden states of different capture points differ by orders of magnitude (the residual stream
grows with depth; the final state is normalised), and so do tokens (attention sinks), so one
scale per tensor would flush most values to zero. Each `[H]` row gets its own float32 scale
`amax / 448`, stored beside the fp8 values as `hidden_scale` `[T, K]`; the cost is 4 bytes per
row against H bytes of data.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, K, H]` floats -> (`[T, K, H]` e4m3, `[T, K]` float32 scales); all-zero rows get scale 1."""
    x = hidden.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype` (computed in float32, then cast)."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


def to_storage(hidden: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hidden states in the run's storage dtype, with their scales when that dtype is fp8."""
    if is_fp8(dtype):
        return quantize(hidden)
    return hidden.to(dtype), None
