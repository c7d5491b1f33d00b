"""A spool file: one finished sample waiting on a node for the collector.

`<spool>/<sample_id>.safetensors` (the spool dir's names, temps and durability are
harvest.node.spooldir's) holds the tokens, the loss mask and the hidden states `[T, K, H]`
already in the run's storage dtype (with their `hidden_scale` `[T, K]` when that is fp8), so the
collector only concatenates: it checks each file's header against the run and then copies tensor
bytes without decoding them. The metadata records the crc32 of each tensor's bytes as the worker
verified them (`crc32`, harvest.formats.crc): the shard's per-sample sums are the same numbers,
so the collector compares what it copied with them before it commits anything (a file changed on
the node's disk is a `SpoolDamaged`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harvest.errors import InputError
from harvest.formats.filecopy import copy_range, write_all
from harvest.ids import check_id

if TYPE_CHECKING:
    import torch

    from harvest.formats.stformat import TensorSpan

# torch and the tensor framing are imported where a sample's tensors are, not at import: the
# spool dir (harvest.node.spooldir) serves `harvest status`, `requeue` and `janitor`, which load no torch.

SCALE = "hidden_scale"


class SpoolError(InputError, ValueError):
    """A spool file that does not hold what the run stores (or is not a spool file at all)."""


class SpoolDamaged(SpoolError):
    """A spool file whose bytes changed after its worker wrote them: unreadable, shorter than its
    header says, or with bytes whose crc32 is not the one recorded. Its sample is extracted again."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def truncated(path: str, name: str) -> SpoolDamaged:
    return SpoolDamaged(f"{path}: ends inside tensor {name} (spool file truncated)", path)


def unreadable(path: str, e: OSError) -> SpoolDamaged:
    return SpoolDamaged(f"{path}: unreadable spool file ({e})", path)


@dataclass
class SpooledSample:
    id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # [T, K, H] in the storage dtype
    hidden_scale: torch.Tensor | None = None  # float32 [T, K], only for fp8 storage
    # Where `hidden_states`' very bytes already lie, in order: (file, begin, end) ranges of the
    # worker's claimed dump files. Where those are on the spool's filesystem, the spool file takes
    # them from there by the kernel (cloned where the filesystem shares blocks) instead of from the
    # tensor; empty, or elsewhere: from the tensor.
    hidden_from: tuple[tuple[str, int, int], ...] = ()
    # A regenerated conversation's generated-dataset entry (JSON, harvest.formats.generated), kept in
    # the file's metadata: the collector commits it with the sample's hidden states, in one index.
    generation: str | None = None
    # The crc32 of `hidden_states`' bytes where the worker knows it from the engine's verified sums
    # (harvest.workers.claim); None: summed from the tensor as the file is encoded.
    hidden_crc32: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class SpoolEntry:
    """A checked spool file: where each tensor's bytes lie, so they can be copied undecoded."""

    id: str
    path: str
    num_tokens: int
    spans: dict[str, TensorSpan]
    generation: str | None = None  # SpooledSample.generation
    crc32: dict[str, int] = field(default_factory=dict)  # tensor name -> crc32 of its bytes, as its worker wrote them


def encode_sample(s: SpooledSample, run: str) -> list[tuple[str, bytes | memoryview]]:
    """`s`'s spool file as (tensor name, bytes) in file order, the header first (named "")."""
    import torch

    from harvest.formats.crc import FIELD, encode_sums, tensor_crc32
    from harvest.formats.stformat import BLOCK, encode_parts

    tensors = {
        "input_ids": s.input_ids.to(torch.int32).contiguous(),
        "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
        "hidden_states": s.hidden_states.contiguous(),
    }
    if s.hidden_scale is not None:
        tensors[SCALE] = s.hidden_scale.to(torch.float32).contiguous()
    # data on a block: the collector's kernel copy into a shard can then clone it (harvest.formats.filecopy)
    sums = {name: tensor_crc32(t) for name, t in tensors.items() if name != "hidden_states" or s.hidden_crc32 is None}
    if s.hidden_crc32 is not None:
        sums["hidden_states"] = s.hidden_crc32
    meta = {"sample_id": s.id, "run": run, FIELD: encode_sums(sums)}
    if s.generation is not None:
        meta["generation"] = s.generation
    return list(zip(["", *sorted(tensors)], encode_parts(tensors, meta, BLOCK), strict=True))


def write_encoded(
    fd: int, parts: list[tuple[str, bytes | memoryview]], hidden_from: tuple[tuple[str, int, int], ...] = ()
) -> int:
    """A spool file's `parts` (from `encode_sample`) written into `fd` from offset 0; returns its size.
    With `hidden_from`, the hidden states' bytes are copied by the kernel from those ranges
    (cloned where the filesystem shares blocks) instead of from the tensor."""
    pos = 0
    for name, piece in parts:
        if name == "hidden_states" and hidden_from:
            pos = _copy_ranges(hidden_from, fd, pos, len(piece))
        else:
            pos = write_all(fd, piece, pos)
    return pos


def _copy_ranges(ranges: tuple[tuple[str, int, int], ...], fd: int, pos: int, nbytes: int) -> int:
    """The bytes of `ranges` at `pos` of `fd`, by the kernel; they must be exactly `nbytes`."""
    if sum(end - begin for _, begin, end in ranges) != nbytes:
        raise ValueError(f"hidden_from spans do not hold the {nbytes} bytes of hidden_states")
    for path, begin, end in ranges:
        src = os.open(path, os.O_RDONLY)
        try:
            copy_range(src, begin, fd, pos, end - begin)
        finally:
            os.close(src)
        pos += end - begin
    return pos


def read_sample(path: str) -> SpooledSample:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        return SpooledSample(
            check_id(meta.get("sample_id", ""), "sample id"),
            f.get_tensor("input_ids"),
            f.get_tensor("loss_mask"),
            f.get_tensor("hidden_states"),
            f.get_tensor(SCALE) if SCALE in f.keys() else None,  # noqa: SIM118 - safe_open's handle has keys(), not __contains__
            generation=meta.get("generation"),
        )


def inspect_sample(path: str, sid: str, num_points: int, hidden_size: int, dtype: torch.dtype) -> SpoolEntry:
    """Read only the header of `path` and check it is sample `sid` as the run stores it, that the
    file holds all the bytes the header names, and that it records their crc32s. A file that
    cannot be read, is shorter than its header says, or whose sums are unreadable is a
    `SpoolDamaged`; one that does not match the run (or records no sums) a `SpoolError`."""
    import torch

    from harvest.formats.crc import FIELD, parse_sums
    from harvest.formats.fp8 import is_fp8
    from harvest.formats.stformat import FormatError, read_file_header

    try:
        spans, meta = read_file_header(path)
        size = os.stat(path).st_size
    except (OSError, FormatError, KeyError, TypeError, ValueError) as e:
        raise SpoolDamaged(f"{path}: unreadable spool file ({e})", path) from None
    if meta.get("sample_id") != sid:
        raise SpoolError(f"{path}: holds sample {meta.get('sample_id')!r}, its name says {sid}")
    ids = spans.get("input_ids")
    if ids is None or ids.dtype != torch.int32 or len(ids.shape) != 1:
        raise SpoolError(f"{path}: input_ids must be int32 [T]")
    t = ids.shape[0]
    want = {
        "input_ids": (torch.int32, (t,)),
        "loss_mask": (torch.uint8, (t,)),
        "hidden_states": (dtype, (t, num_points, hidden_size)),
    }
    if is_fp8(dtype):
        want[SCALE] = (torch.float32, (t, num_points))
    if set(spans) != set(want):
        raise SpoolError(f"{path}: tensors {sorted(spans)}, the run stores {sorted(want)}")
    for name, (dt, shape) in want.items():
        got = spans[name]
        if got.dtype != dt or got.shape != shape:
            raise SpoolError(f"{path}: {name} is {got.dtype} {list(got.shape)}, the run stores {dt} {list(shape)}")
    generation = meta.get("generation")
    if generation is not None and not isinstance(generation, str):
        raise SpoolError(f"{path}: its generation metadata is not text")
    if FIELD not in meta:
        raise SpoolError(f"{path}: records no crc32 of its tensors (written by a worker without them)")
    try:
        sums = parse_sums(meta, want)
    except ValueError as e:
        raise SpoolDamaged(f"{path}: {e}", path) from None
    end = max(span.end for span in spans.values())
    if size < end:
        raise SpoolDamaged(f"{path}: {size} bytes, its header names {end} (spool file truncated)", path)
    return SpoolEntry(sid, path, t, spans, generation, sums)
