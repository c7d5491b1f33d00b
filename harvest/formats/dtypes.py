"""The storage-dtype vocabulary: the names a run, the CLI and the index file use for dtypes.

torch is imported where a dtype is used, not at import: `harvest run` publishes the run and
starts its workers before it pays for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Storage dtype (as a run and `--dtype` name it) -> the torch dtype's name.
STORAGE_DTYPES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8_e4m3": "float8_e4m3fn",  # with a float32 scale per token and capture point (harvest.formats.fp8)
}
# What a reader or an export may convert to: every storage dtype but fp8, which is dequantized.
READ_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")


def storage_torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype: torch.dtype = getattr(torch, STORAGE_DTYPES[name])
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """How the index file names the storage dtype (`bfloat16`, `float8_e4m3fn`, ...)."""
    return str(dtype).removeprefix("torch.")
