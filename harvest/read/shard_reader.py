"""Reading one committed shard by byte ranges, from any fsspec store.

Opening a shard costs one ranged read (the safetensors header; a second one only if the
header is longer than the first guess); the token ids, loss mask, offsets and fp8 scales are
small (a few bytes a token) and fetched whole once; each sample's hidden states are then one
ranged read of exactly its rows. A trainer on S3 never downloads a shard it only samples from.
"""

from __future__ import annotations

import json

import torch

from harvest.formats.fp8 import dequantize, is_fp8
from harvest.formats.index import ShardError, ShardIndex
from harvest.formats.shard import shard_file
from harvest.formats.spool import SCALE
from harvest.formats.stformat import BLOCK, FormatError, TensorSpan, header_length, parse_header, tensor_from_bytes
from harvest.storage import Location

_SMALL = ("input_ids", "loss_mask", "offsets")


class ShardReader:
    """Random access into one committed shard (`index`: its parsed index, harvest.formats.index)."""

    def __init__(self, loc: Location, index: ShardIndex) -> None:
        self.loc, self.index = loc, index
        self.name: str = shard_file(index["shard_id"])  # from the checked id, never a path read from storage
        if index.get("shard", self.name) != self.name:
            raise ShardError(f"index of shard {index['shard_id']} names {index['shard']!r}, expected {self.name}")
        # The header is ~0.5 KiB plus the sample ids (35 bytes each), padded so the data starts on a
        # block (stformat.BLOCK): guess that, rounded up to a block, so one read usually does.
        guess = 1024 + 40 * len(index["samples"])
        head = loc.read_range(self.name, 0, -(-guess // BLOCK) * BLOCK)
        try:
            n = header_length(head, self.name)
            raw = head[8 : 8 + n] if len(head) >= 8 + n else loc.read_range(self.name, 8, 8 + n)
            self.tensors, self.metadata = parse_header(raw, self.name)
        except FormatError as e:
            raise ShardError(str(e)) from None
        if json.loads(self.metadata.get("sample_ids", "[]")) != index["samples"]:
            raise ShardError(f"{self.name}: sample ids differ from its index file")
        missing = {"hidden_states", *_SMALL} - set(self.tensors)
        if missing:
            raise ShardError(f"{self.name}: lacks tensors {sorted(missing)}")
        self.dtype: torch.dtype = self.tensors["hidden_states"].dtype
        self._small: dict[str, torch.Tensor] = {}
        if list(self._whole("offsets").tolist()) != list(index["offsets"]):
            raise ShardError(f"{self.name}: offsets differ from its index file")

    def __len__(self) -> int:
        return len(self.index["samples"])

    def _read(self, span: TensorSpan, start: int, end: int) -> torch.Tensor:
        rb = span.row_bytes
        raw = self.loc.read_range(self.name, span.begin + start * rb, span.begin + end * rb)
        if len(raw) != (end - start) * rb:
            raise ShardError(f"{self.name}: short read ({len(raw)} of {(end - start) * rb} bytes): truncated shard?")
        return tensor_from_bytes(raw, span.dtype, (end - start, *span.shape[1:]))

    def _whole(self, name: str) -> torch.Tensor:
        if name not in self._small:
            span = self.tensors[name]
            self._small[name] = self._read(span, 0, span.shape[0])
        return self._small[name]

    def rows(self, tensor: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of one tensor, as stored."""
        if tensor in _SMALL or tensor == SCALE:
            return self._whole(tensor)[start:end].clone()
        return self._read(self.tensors[tensor], start, end)

    def sample(self, i: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """`input_ids` [T] int32, `loss_mask` [T] uint8 and `hidden_states` [T, K, H]: as stored
        when `dtype` is None (fp8 shards then add `hidden_scale` [T, K]), else converted to
        `dtype` (fp8 dequantized with its per-token scales)."""
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        out = {name: self.rows(name, a, b) for name in ("input_ids", "loss_mask", "hidden_states")}
        if is_fp8(self.dtype):
            scale = self.rows(SCALE, a, b)
            if dtype is None or is_fp8(dtype):
                out[SCALE] = scale
            else:
                out["hidden_states"] = dequantize(out["hidden_states"], scale, dtype)
        elif dtype is not None and dtype != self.dtype:
            if is_fp8(dtype):
                raise ShardError(f"{self.name}: stored as {self.dtype}; fp8 is chosen when the run is created, not on read")
            out["hidden_states"] = out["hidden_states"].to(dtype)
        return out
