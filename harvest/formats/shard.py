"""The shard layout in storage, planned from the spool files' headers.

`shards/<id>.safetensors` holds `input_ids` `[N]` int32, `loss_mask` `[N]` uint8,
`hidden_states` `[N, K, H]` (storage dtype), `offsets` `[S+1]` int64 and, for fp8 runs,
`hidden_scale` `[N, K]` float32; tensors lie in sorted name order and the metadata lists the
sample ids in order. With a codec (harvest.formats.codec) `hidden_states` is `[M]` uint8: each
sample's coded bytes in sample order; the metadata adds the codec and the raw dtype and shape.
`index/<id>.json` lists the samples, their token counts and offsets (and coded byte offsets), the
shard's size and sha256 (harvest.formats.index); it is written only after the shard and commits it.

A shard is up to a few GiB, so it is never built in memory: `plan_shard` reads only the spool
files' headers and fixes the layout (and with it the header bytes); harvest.formats.shard_write
then copies the tensor bytes from the spool files, undecoded. The same samples in the same order
give the same bytes, so a collector that crashed mid-commit re-packs its recorded shard under the
record's name and overwrites instead of duplicating.

A sample's rows of a tensor are its spool file's tensor, byte for byte, so the crc32s packing
takes (`ShardSums`) must be the ones its worker recorded in that file: the collector commits
nothing where they differ (`ShardPlan.damaged`). With a codec, the hidden states are coded first
(`encode_shard`: harvest.formats.coded), their sums taken over the raw bytes as they are coded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from harvest.config import FINAL_POST_NORM
from harvest.formats.codec import NONE, check_codec
from harvest.formats.coded import Coded, encode_samples
from harvest.formats.dtypes import dtype_name
from harvest.formats.fp8 import is_fp8
from harvest.formats.index import CODED_FORMAT, FORMAT, ShardError, ShardIndex
from harvest.formats.spool import SCALE, SpoolDamaged, SpoolEntry
from harvest.formats.stformat import BLOCK, Planned, encode_header
from harvest.ids import check_id, shard_id_for

SHARDS = "shards"


def _offsets(sizes: Iterable[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))


def shard_file(shard_id: str) -> str:
    return f"{SHARDS}/{check_id(shard_id, 'shard id')}.safetensors"


@dataclass(frozen=True)
class ShardSums:
    """What packing learned of the bytes it stored: the shard's sha256 and, per sample, the
    checksums readers verify on every ranged read (harvest.formats.index, `crc32`)."""

    sha256: str
    crc32: list[list[int]]


@dataclass(frozen=True)
class ShardPlan:
    """Everything about a shard except its tensor bytes: decided from spool headers alone (and,
    with a codec, from the coded sizes: `encode_shard`)."""

    shard_id: str
    entries: tuple[SpoolEntry, ...]
    tensors: tuple[Planned, ...]
    header: bytes
    offsets: tuple[int, ...]
    dtype: torch.dtype
    capture_points: tuple[int, ...]
    run: str = ""
    codec: str = NONE
    coded: tuple[Coded, ...] = ()  # per sample, once coded; empty for `none`, and before `encode_shard`

    @property
    def needs_encoding(self) -> bool:
        return self.codec != NONE and not self.coded

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    @property
    def sample_ids(self) -> list[str]:
        return [e.id for e in self.entries]

    @property
    def crc32_tensors(self) -> list[str]:
        """The tensors each sample has a crc32 of: every per-token tensor, in the shard's order."""
        return [t.name for t in self.tensors if t.name != "offsets"]

    def index(self, sums: ShardSums) -> ShardIndex:
        """The index document that commits this shard once its bytes (with `sums`) are stored."""
        doc = ShardIndex(
            format=CODED_FORMAT if self.coded else FORMAT,
            shard_id=self.shard_id,
            shard=shard_file(self.shard_id),
            samples=self.sample_ids,
            tokens=[e.num_tokens for e in self.entries],
            offsets=list(self.offsets),
            bytes=self.nbytes,
            sha256=sums.sha256,
            dtype=dtype_name(self.dtype),
            capture_points=list(self.capture_points),
            final_state=FINAL_POST_NORM,  # every engine's final point is HF's post-norm state (harvest.config)
            crc32=[list(c) for c in sums.crc32],
            crc32_tensors=self.crc32_tensors,
        )
        if self.coded:
            doc["codec"] = self.codec
            doc["coded_offsets"] = _offsets(c.nbytes for c in self.coded)
        return doc

    def damaged(self, sums: ShardSums) -> dict[str, SpoolDamaged]:
        """The samples whose bytes, as packed, do not have the crc32s their spool files record (the
        worker's: harvest.formats.spool), each with what differs. Empty: the index's sums are the
        workers'."""
        out = {}
        for e, got in zip(self.entries, sums.crc32 or (), strict=False):
            bad = [
                f"{name} has crc32 {c} as copied, its worker recorded {e.crc32.get(name)}"
                for name, c in zip(self.crc32_tensors, got, strict=True)
                if e.crc32.get(name) != c
            ]
            if bad:
                out[e.id] = SpoolDamaged(f"{e.path}: {'; '.join(bad)} (spool file damaged on the node)", e.path)
        return out


def plan_shard(
    entries: Sequence[SpoolEntry],
    run: str,
    capture_points: Sequence[int],
    dtype: torch.dtype,
    shard_id: str | None = None,
    codec: str = NONE,
) -> ShardPlan:
    """The layout of a shard of `entries` (checked spool files, in this order), named `shard_id`
    (a collector's fresh name, harvest.ids.new_shard_id; default: the digest of the samples).
    With a `codec` other than none, the plan is to be coded (`encode_shard`) before it is written."""
    if not entries:
        raise ShardError("a shard needs at least one sample")
    k = len(capture_points)
    hidden = entries[0].spans["hidden_states"].shape[2]
    for e in entries:
        hs = e.spans["hidden_states"]
        if hs.dtype != dtype or hs.shape[1:] != (k, hidden):
            raise ShardError(
                f"{e.path}: hidden_states {hs.dtype} {list(hs.shape)} do not fit a shard of {dtype} [*, {k}, {hidden}]"
            )
    sid = check_id(shard_id, "shard id") if shard_id else shard_id_for([e.id for e in entries])
    return _layout(sid, tuple(entries), run, tuple(capture_points), dtype, check_codec(codec), ())


def _layout(
    shard_id: str,
    entries: tuple[SpoolEntry, ...],
    run: str,
    capture_points: tuple[int, ...],
    dtype: torch.dtype,
    codec: str,
    coded: tuple[Coded, ...],
) -> ShardPlan:
    ids = [e.id for e in entries]
    offsets = _offsets(e.num_tokens for e in entries)
    n, k = offsets[-1], len(capture_points)
    hidden = entries[0].spans["hidden_states"].shape[2]
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "hidden_states": (torch.uint8, (sum(c.nbytes for c in coded),)) if coded else (dtype, (n, k, hidden)),
        "input_ids": (torch.int32, (n,)),
        "loss_mask": (torch.uint8, (n,)),
        "offsets": (torch.int64, (len(offsets),)),
    }
    if is_fp8(dtype):
        shapes[SCALE] = (torch.float32, (n, k))
    tensors = tuple(Planned(name, *shapes[name]) for name in sorted(shapes))
    meta = {
        "format": CODED_FORMAT if coded else FORMAT,
        "run": run,
        "sample_ids": json.dumps(ids),
        "capture_points": json.dumps(list(capture_points)),
    }
    if coded:
        meta.update(
            {
                "codec": codec,
                "hidden_states_dtype": dtype_name(dtype),
                "hidden_states_shape": json.dumps([n, k, hidden]),
            }
        )
    return ShardPlan(
        shard_id,
        entries,
        tensors,
        encode_header(tensors, meta, BLOCK),
        tuple(offsets),
        dtype,
        capture_points,
        run,
        codec,
        coded,
    )


def encode_shard(plan: ShardPlan, path: str) -> ShardPlan:
    """`plan` with each sample's hidden states coded into the scratch file `path`
    (harvest.formats.coded.encode_samples)."""
    coded = encode_samples(plan.entries, plan.dtype, path)
    return _layout(plan.shard_id, plan.entries, plan.run, plan.capture_points, plan.dtype, plan.codec, coded)
