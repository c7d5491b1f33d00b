"""The shard layout in storage (DESIGN 4.5): many samples on one token axis, plus the index
file that commits it.

`shards/<id>.safetensors` holds `input_ids` `[N]`, `loss_mask` `[N]`, `hidden_states`
`[N, K, H]` and `offsets` `[S+1]`; `index/<id>.json` lists the sample ids, their token
counts and offsets, the shard's size and checksum. Readers trust only shards that have an
index file, and fetch one sample with byte-range reads computed from the safetensors header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch


from harvest.ids import check_id, shard_id_for
from harvest.spool import SpooledSample
from harvest.stformat import encode
from harvest.storage import Location

FORMAT = "harvest-shard-1"
SHARDS, INDEX = "shards", "index"
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}


class ShardError(ValueError):
    """A shard or index file that does not follow the layout."""


def shard_file(shard_id: str) -> str:
    return f"{SHARDS}/{check_id(shard_id, 'shard id')}.safetensors"


def index_file(shard_id: str) -> str:
    return f"{INDEX}/{check_id(shard_id, 'shard id')}.json"


def build_shard(samples: Sequence[SpooledSample], run: str, capture_points: Sequence[int]) -> tuple[str, bytes, dict]:
    """Concatenate samples into shard bytes and the index document that will commit them."""
    if not samples:
        raise ShardError("a shard needs at least one sample")
    ids = [s.id for s in samples]
    sid = shard_id_for(ids)
    lens = [s.num_tokens for s in samples]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    tensors = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples]),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples]),
        "hidden_states": torch.cat([s.hidden_states for s in samples]),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    meta = {
        "format": FORMAT,
        "run": run,
        "sample_ids": json.dumps(ids),
        "capture_points": json.dumps(list(capture_points)),
    }
    data = encode(tensors, meta)
    index = {
        "format": FORMAT,
        "shard_id": sid,
        "shard": shard_file(sid),
        "samples": ids,
        "tokens": lens,
        "offsets": offsets,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "dtype": str(tensors["hidden_states"].dtype).removeprefix("torch."),
        "capture_points": list(capture_points),
    }
    return sid, data, index


@dataclass
class _TensorInfo:
    dtype: torch.dtype
    shape: list[int]
    begin: int  # absolute byte offset in the file

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class ShardReader:
    """Random access into one committed shard by byte ranges: the header once, then only the
    rows asked for, so a sample can be read from object storage without the whole shard."""

    def __init__(self, loc: Location, index: dict) -> None:
        self.loc, self.index = loc, index
        self.name = index["shard"]
        head = loc.read_range(self.name, 0, 8)
        (hlen,) = struct.unpack("<Q", head)
        if hlen > 100_000_000:
            raise ShardError(f"{self.name}: header of {hlen} bytes is not plausible")
        header = json.loads(loc.read_range(self.name, 8, 8 + hlen))
        self.metadata = header.pop("__metadata__", {})
        base = 8 + hlen
        self.tensors = {}
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ShardError(f"{self.name}: unsupported dtype {info['dtype']}")
            self.tensors[name] = _TensorInfo(_DTYPES[info["dtype"]], info["shape"], base + info["data_offsets"][0])
        if json.loads(self.metadata.get("sample_ids", "[]")) != index["samples"]:
            raise ShardError(f"{self.name}: sample ids differ from its index file")

    def rows(self, tensor: str, start: int, end: int) -> torch.Tensor:
        t = self.tensors[tensor]
        rb = t.row_bytes
        raw = self.loc.read_range(self.name, t.begin + start * rb, t.begin + end * rb)
        return torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape([end - start, *t.shape[1:]])

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.index["offsets"][i], self.index["offsets"][i + 1]
        return {name: self.rows(name, a, b) for name in ("input_ids", "loss_mask", "hidden_states")}
