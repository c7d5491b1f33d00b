"""The safetensors file layout, read and written in pieces, always with the same bytes.

`safetensors.torch.save` needs every tensor in memory at once and returns the whole file as
bytes. A shard is up to a few GiB, so the collector writes it as a header followed by tensor
bytes streamed from the spool files, and readers fetch the header and then byte ranges. Both
need the layout itself: an 8-byte little-endian header length, a JSON header (dtype, shape,
`data_offsets` relative to the end of the header, and `__metadata__` strings), then the data.

harvest frames every file it writes here rather than with `safetensors.torch.save`: that
library keeps metadata in a Rust HashMap, so the same tensors serialize to different header
bytes in different processes, and harvest promises that a repeated write (a retried job, a
re-packed shard after a crash) produces identical bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harvest.errors import InputError

DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "I32": torch.int32,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "U8": torch.uint8,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000


class FormatError(InputError, ValueError):
    """Bytes that are not a safetensors file harvest can use."""


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in its file (`begin`, `end` absolute)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n


def header_length(first8: bytes, where: str) -> int:
    if len(first8) < 8:
        raise FormatError(f"{where}: shorter than a safetensors header")
    n: int = struct.unpack("<Q", first8[:8])[0]
    if n > MAX_HEADER:
        raise FormatError(f"{where}: header of {n} bytes is not plausible")
    return n


def parse_header(raw: bytes, where: str) -> tuple[dict[str, TensorSpan], dict[str, str]]:
    """(tensors, metadata) from the JSON header; `raw` is the header only (after the 8 bytes)."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise FormatError(f"{where}: header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    base = 8 + len(raw)
    tensors = {}
    for name, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise FormatError(f"{where}: tensor {name} has unsupported dtype {info.get('dtype')}")
        a, b = info["data_offsets"]
        tensors[name] = TensorSpan(DTYPES[info["dtype"]], tuple(info["shape"]), base + a, base + b)
    return tensors, meta


def read_file_header(path: str) -> tuple[dict[str, TensorSpan], dict[str, str]]:
    """The header of a local safetensors file, without reading its data."""
    with open(path, "rb") as f:
        n = header_length(f.read(8), path)
        return parse_header(f.read(n), path)


@dataclass(frozen=True)
class Planned:
    """A tensor to be written: its dtype and shape (its bytes are streamed later, in order)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


BLOCK = 4096  # a filesystem block: where dump, spool and shard files start their tensor data


def encode_header(tensors: Sequence[Planned], metadata: Mapping[str, str], align: int = 8) -> bytes:
    """The 8-byte length and JSON header for `tensors` laid out in the given order (metadata
    keys sorted), padded with spaces (as safetensors does) so the data starts at a multiple of
    `align`: 8 keeps every dtype aligned in memory; `BLOCK` also puts the data on a filesystem
    block, which lets the kernel clone it between files instead of copying it (harvest.formats.shard)."""
    header: dict[str, Any] = {"__metadata__": {k: str(metadata[k]) for k in sorted(metadata)}}
    pos = 0
    for t in tensors:
        header[t.name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


def tensor_from_bytes(raw: bytes | bytearray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    buf = raw if isinstance(raw, bytearray) else bytearray(raw)
    if not buf:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without a copy when it is contiguous on CPU."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


def encode_parts(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, align: int = 8
) -> list[bytes | memoryview]:
    """A file as its pieces (header, then each tensor's bytes, sorted by name), without joining
    them: written one after another they make `encode`'s bytes, without a copy of the data."""
    names = sorted(tensors)
    plan = [Planned(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
    return [encode_header(plan, metadata or {}, align), *(tensor_bytes(tensors[n]) for n in names)]


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None, align: int = 8) -> bytes:
    """A whole file in memory, tensors in sorted name order: same inputs, same bytes."""
    return b"".join(encode_parts(tensors, metadata, align))
