"""The shard layout in storage and its streaming writer.

`shards/<id>.safetensors` holds `input_ids` `[N]` int32, `loss_mask` `[N]` uint8,
`hidden_states` `[N, K, H]` (storage dtype), `offsets` `[S+1]` int64 and, for fp8 runs,
`hidden_scale` `[N, K]` float32; tensors lie in sorted name order and the metadata lists the
sample ids in order. `index/<id>.json` lists the samples, their token counts and offsets, the
shard's size and sha256 (harvest.formats.index); it is written only after the shard and commits it.

A shard is up to a few GiB, so it is never built in memory: `plan_shard` reads only the spool
files' headers and fixes the layout (and with it the header bytes), and `write_shard` copies
each tensor's bytes straight out of the spool files into the output, undecoded, through one
small buffer. The same samples in the same order give the same bytes (and the same id), which
is what lets a collector that crashed mid-commit re-pack and overwrite instead of duplicate.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

import torch

from harvest.config import FINAL_POST_NORM
from harvest.formats.dtypes import dtype_name
from harvest.formats.fp8 import is_fp8
from harvest.formats.index import FORMAT, ShardError, ShardIndex
from harvest.formats.spool import SCALE, SpoolEntry, SpoolError
from harvest.formats.stformat import Planned, encode_header
from harvest.ids import check_id, shard_id_for

SHARDS = "shards"
COPY_BUFFER = 8 << 20


def shard_file(shard_id: str) -> str:
    return f"{SHARDS}/{check_id(shard_id, 'shard id')}.safetensors"


@dataclass(frozen=True)
class ShardPlan:
    """Everything about a shard except its tensor bytes: decided from spool headers alone."""

    shard_id: str
    entries: tuple[SpoolEntry, ...]
    tensors: tuple[Planned, ...]
    header: bytes
    offsets: tuple[int, ...]
    dtype: torch.dtype
    capture_points: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    @property
    def sample_ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def index(self, sha256: str) -> ShardIndex:
        """The index document that commits this shard once its bytes (with `sha256`) are stored."""
        return ShardIndex(
            format=FORMAT,
            shard_id=self.shard_id,
            shard=shard_file(self.shard_id),
            samples=self.sample_ids,
            tokens=[e.num_tokens for e in self.entries],
            offsets=list(self.offsets),
            bytes=self.nbytes,
            sha256=sha256,
            dtype=dtype_name(self.dtype),
            capture_points=list(self.capture_points),
            final_state=FINAL_POST_NORM,  # every engine's final point is HF's post-norm state (harvest.config)
        )


def plan_shard(
    entries: Sequence[SpoolEntry], run: str, capture_points: Sequence[int], dtype: torch.dtype
) -> ShardPlan:
    """The layout of a shard of `entries` (checked spool files, in this order)."""
    if not entries:
        raise ShardError("a shard needs at least one sample")
    ids = [e.id for e in entries]
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + e.num_tokens)
    n, k = offsets[-1], len(capture_points)
    hidden = entries[0].spans["hidden_states"].shape[2]
    for e in entries:
        hs = e.spans["hidden_states"]
        if hs.dtype != dtype or hs.shape[1:] != (k, hidden):
            raise ShardError(f"{e.path}: hidden_states {hs.dtype} {list(hs.shape)} do not fit a shard of {dtype} [*, {k}, {hidden}]")
    shapes = {
        "hidden_states": (dtype, (n, k, hidden)),
        "input_ids": (torch.int32, (n,)),
        "loss_mask": (torch.uint8, (n,)),
        "offsets": (torch.int64, (len(offsets),)),
    }
    if is_fp8(dtype):
        shapes[SCALE] = (torch.float32, (n, k))
    tensors = tuple(Planned(name, *shapes[name]) for name in sorted(shapes))
    meta = {
        "format": FORMAT,
        "run": run,
        "sample_ids": json.dumps(ids),
        "capture_points": json.dumps(list(capture_points)),
    }
    return ShardPlan(
        shard_id_for(ids), tuple(entries), tensors, encode_header(tensors, meta), tuple(offsets), dtype, tuple(capture_points)
    )


def write_shard(plan: ShardPlan, out: BinaryIO, progress: Callable[[int], None] | None = None) -> str:
    """Stream the shard into `out` (header, then each tensor's rows copied from the spool files
    in sample order); returns the sha256 of everything written. Memory: two copy buffers.

    The checksum runs on a second thread (hashlib releases the GIL on large buffers) while this
    one reads and writes the next buffer, so hashing adds no time when I/O is the bound."""
    digest = hashlib.sha256()
    bufs = [memoryview(bytearray(COPY_BUFFER)) for _ in range(2)]
    pending: list[Future | None] = [None, None]
    written = 0
    with ThreadPoolExecutor(1, thread_name_prefix="shard-sha256") as hasher:

        def emit(data, slot: int | None = None) -> None:
            nonlocal written
            out.write(data)
            fut = hasher.submit(digest.update, data)
            if slot is not None:
                pending[slot] = fut
            written += len(data)
            if progress:
                progress(written)

        emit(plan.header)
        turn = 0
        for t in plan.tensors:
            if t.name == "offsets":
                emit(struct.pack(f"<{len(plan.offsets)}q", *plan.offsets))
                continue
            for e in plan.entries:
                span = e.spans[t.name]
                with open(e.path, "rb", buffering=0) as f:
                    f.seek(span.begin)
                    left = span.end - span.begin
                    while left:
                        turn ^= 1
                        if pending[turn] is not None:
                            pending[turn].result()  # its last bytes are hashed: the buffer is free
                        buf = bufs[turn]
                        got = f.readinto(buf[: min(left, COPY_BUFFER)])
                        if not got:
                            raise SpoolError(f"{e.path}: ends inside tensor {t.name} (spool file truncated)")
                        emit(buf[:got], turn)
                        left -= got
    if written != plan.nbytes:
        raise ShardError(f"shard {plan.shard_id}: wrote {written} bytes, planned {plan.nbytes}")
    return digest.hexdigest()
