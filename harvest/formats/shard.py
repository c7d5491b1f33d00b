"""The shard layout in storage and its streaming writer.

`shards/<id>.safetensors` holds `input_ids` `[N]` int32, `loss_mask` `[N]` uint8,
`hidden_states` `[N, K, H]` (storage dtype), `offsets` `[S+1]` int64 and, for fp8 runs,
`hidden_scale` `[N, K]` float32; tensors lie in sorted name order and the metadata lists the
sample ids in order. With a codec (harvest.formats.codec) `hidden_states` is `[M]` uint8: each
sample's coded bytes in sample order; the metadata adds the codec and the raw dtype and shape.
`index/<id>.json` lists the samples, their token counts and offsets (and coded byte offsets), the
shard's size and sha256 (harvest.formats.index); it is written only after the shard and commits it.

A shard is up to a few GiB, so it is never built in memory: `plan_shard` reads only the spool
files' headers and fixes the layout (and with it the header bytes), and the tensor bytes go
straight from the spool files into the output, undecoded: `copy_shard` has the kernel move them
into a local file on the spool's filesystem (cloning blocks where the filesystem can: the header
is padded to a block, and so are the spool files'), `write_shard` streams them through two small
buffers into anything else (an upload, a file on another filesystem). The same samples in the
same order give the same bytes, which is what lets a collector that crashed mid-commit re-pack
its recorded shard under the record's name and overwrite instead of duplicate.

Both writers also sum what they store on the thread that already sees every byte (the sha256
hasher): the shard's sha256 and, per sample, one crc32 per per-token tensor over exactly that
sample's rows (`ShardSums`), which the index records and every ranged read verifies
(harvest.read.shard_reader). No byte is read a second time for them. A sample's rows of a tensor
are its spool file's tensor, byte for byte, so its sums must be the ones its worker recorded in
that file: the collector commits nothing where they differ (`ShardPlan.damaged`), and the index's
sums are then the workers'. With a codec, the hidden states are coded first (`encode_shard`:
harvest.formats.coded), their sums taken over the raw bytes as they are coded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import BinaryIO

import torch

from harvest.config import FINAL_POST_NORM
from harvest.formats.codec import NONE, check_codec
from harvest.formats.coded import Coded, encode_samples
from harvest.formats.dtypes import dtype_name
from harvest.formats.filecopy import ShortFile, copy_range, start_writeback, write_all
from harvest.formats.fp8 import is_fp8
from harvest.formats.index import CODED_FORMAT, FORMAT, ShardError, ShardIndex
from harvest.formats.spool import SCALE, SpoolDamaged, SpoolEntry, truncated, unreadable
from harvest.formats.stformat import BLOCK, Planned, encode_header
from harvest.ids import check_id, shard_id_for

SHARDS = "shards"


def _offsets(sizes: Iterable[int]) -> list[int]:
    return list(accumulate(sizes, initial=0))
COPY_BUFFER = 8 << 20


def shard_file(shard_id: str) -> str:
    return f"{SHARDS}/{check_id(shard_id, 'shard id')}.safetensors"


@dataclass(frozen=True)
class ShardSums:
    """What packing learned of the bytes it stored: the shard's sha256 and, per sample, the
    checksums readers verify on every ranged read (harvest.formats.index, `crc32`)."""

    sha256: str
    crc32: list[list[int]] | None = None


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
        )
        if sums.crc32 is not None:
            doc["crc32"] = [list(c) for c in sums.crc32]
            doc["crc32_tensors"] = self.crc32_tensors
        if self.coded:
            doc["codec"] = self.codec
            doc["coded_offsets"] = _offsets(c.nbytes for c in self.coded)
        return doc

    def damaged(self, sums: ShardSums) -> dict[str, SpoolDamaged]:
        """The samples whose bytes, as packed, do not have the crc32s their spool files record (the
        worker's: harvest.formats.spool), each with what differs. Empty: the index's sums are the
        workers'."""
        out = {}
        for e, got in zip(self.entries, sums.crc32 or ()):
            bad = [f"{name} has crc32 {c} as copied, its worker recorded {e.crc32.get(name)}"
                   for name, c in zip(self.crc32_tensors, got) if e.crc32.get(name) != c]
            if bad:
                out[e.id] = SpoolDamaged(f"{e.path}: {'; '.join(bad)} (spool file damaged on the node)", e.path)
        return out


def plan_shard(
    entries: Sequence[SpoolEntry], run: str, capture_points: Sequence[int], dtype: torch.dtype,
    shard_id: str | None = None, codec: str = NONE,
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
            raise ShardError(f"{e.path}: hidden_states {hs.dtype} {list(hs.shape)} do not fit a shard of {dtype} [*, {k}, {hidden}]")
    sid = check_id(shard_id, "shard id") if shard_id else shard_id_for([e.id for e in entries])
    return _layout(sid, tuple(entries), run, tuple(capture_points), dtype, check_codec(codec), ())


def _layout(shard_id: str, entries: tuple[SpoolEntry, ...], run: str, capture_points: tuple[int, ...],
            dtype: torch.dtype, codec: str, coded: tuple[Coded, ...]) -> ShardPlan:
    ids = [e.id for e in entries]
    offsets = _offsets(e.num_tokens for e in entries)
    n, k = offsets[-1], len(capture_points)
    hidden = entries[0].spans["hidden_states"].shape[2]
    shapes = {
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
        meta.update({"codec": codec, "hidden_states_dtype": dtype_name(dtype),
                     "hidden_states_shape": json.dumps([n, k, hidden])})
    return ShardPlan(shard_id, entries, tensors, encode_header(tensors, meta, BLOCK), tuple(offsets), dtype,
                     capture_points, run, codec, coded)


def encode_shard(plan: ShardPlan, path: str) -> ShardPlan:
    """`plan` with each sample's hidden states coded into the scratch file `path`
    (harvest.formats.coded.encode_samples)."""
    coded = encode_samples(plan.entries, plan.dtype, path)
    return _layout(plan.shard_id, plan.entries, plan.run, plan.capture_points, plan.dtype, plan.codec, coded)


def _pieces(plan: ShardPlan) -> Iterator[bytes | tuple[str, int, int, str]]:
    """The shard in order: bytes to write (the header, the offsets), or (spool file, begin,
    length, tensor name) ranges to copy."""
    if plan.needs_encoding:
        raise ShardError(f"shard {plan.shard_id}: its {plan.codec} hidden states are not coded yet (encode_shard)")
    yield plan.header
    for t in plan.tensors:
        if t.name == "offsets":
            yield struct.pack(f"<{len(plan.offsets)}q", *plan.offsets)
            continue
        if t.name == "hidden_states" and plan.coded:
            for c in plan.coded:
                yield c.path, c.begin, c.nbytes, t.name
            continue
        for e in plan.entries:
            span = e.spans[t.name]
            yield e.path, span.begin, span.end - span.begin, t.name


class _Crcs:
    """The crc32 of each (sample, per-token tensor) range of a shard, fed the shard's bytes in
    order, in pieces cut anywhere (the read-back thread of `copy_shard` reads spans that straddle
    samples). The ranges come from `_pieces`, so they are the layout itself. It runs on a thread
    of its own beside the sha256 (both release the GIL), so the two sums cost the time of one
    where a core is free. Coded hidden states are not summed here: their sums are of the raw
    bytes, taken as they were coded (`encode_shard`)."""

    def __init__(self, plan: ShardPlan) -> None:
        slot = {name: j for j, name in enumerate(plan.crc32_tensors)}
        self.crc = [[0] * len(slot) for _ in plan.entries]
        self.ranges: list[tuple[int, int, list[int], int]] = []  # (begin, end, that sample's crcs, slot)
        pos, seen = 0, dict.fromkeys(slot, 0)
        for piece in _pieces(plan):
            if isinstance(piece, bytes):
                pos += len(piece)
                continue
            _, _, n, name = piece
            if name == "hidden_states" and plan.coded:
                self.crc[seen[name]][slot[name]] = plan.coded[seen[name]].crc32
            else:
                self.ranges.append((pos, pos + n, self.crc[seen[name]], slot[name]))
            seen[name] += 1
            pos += n
        self.pos = self.k = 0

    def update(self, data: bytes | memoryview) -> None:
        pos, end, ranges = self.pos, self.pos + len(data), self.ranges
        while self.k < len(ranges) and ranges[self.k][0] < end:
            begin, stop, crcs, j = ranges[self.k]
            lo, hi = max(begin, pos), min(stop, end)
            if lo < hi:
                crcs[j] = zlib.crc32(data[lo - pos : hi - pos], crcs[j])
            if stop > end:
                break
            self.k += 1
        self.pos = end


def _ranges(plan: ShardPlan, bufs: list[memoryview], wait: Callable[[int], None]) -> Iterator[tuple[memoryview | bytes, int]]:
    """The shard's bytes read in order into the two buffers in turn, each yielded with the slot
    it lies in (-1 for bytes of the plan); `wait(slot)` is called before a buffer is reused."""
    turn = 0
    for piece in _pieces(plan):
        if isinstance(piece, bytes):
            yield piece, -1
            continue
        path, begin, left, name = piece
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise unreadable(path, e) from None
        with f:
            f.seek(begin)
            while left:
                turn ^= 1
                wait(turn)
                try:
                    got = f.readinto(bufs[turn][: min(left, COPY_BUFFER)])
                except OSError as e:
                    raise unreadable(path, e) from None
                if not got:
                    raise truncated(path, name)
                yield bufs[turn][:got], turn
                left -= got


def write_shard(plan: ShardPlan, out: BinaryIO, progress: Callable[[int], None] | None = None) -> ShardSums:
    """Stream the shard into `out` (header, then each tensor's rows copied from the spool files
    in sample order); returns the sha256 of everything written and each sample's crc32s. Memory:
    two copy buffers.
    For an upload, or a file on another filesystem than the spool's; a file on the spool's
    filesystem takes `copy_shard`.

    The checksums run on a second thread (hashlib and zlib release the GIL on large buffers)
    while this one reads and writes the next buffer, so they add no time when I/O is the bound."""
    sha, crcs = hashlib.sha256(), _Crcs(plan)
    bufs = [memoryview(bytearray(COPY_BUFFER)) for _ in range(2)]
    pending: list[tuple[Future, Future] | None] = [None, None]
    written = 0

    def wait(slot: int) -> None:
        for fut in pending[slot] or ():
            fut.result()  # its last bytes are summed: the buffer is free

    plan_bytes: list[Future] = []  # the header's and the offsets' sums (a buffer's are awaited in `wait`)
    with ThreadPoolExecutor(1, thread_name_prefix="shard-sha256") as hasher, \
            ThreadPoolExecutor(1, thread_name_prefix="shard-crc32") as crcer:
        for data, slot in _ranges(plan, bufs, wait):
            out.write(data)
            futs = hasher.submit(sha.update, data), crcer.submit(crcs.update, data)
            if slot >= 0:
                pending[slot] = futs
            else:
                plan_bytes += futs
            written += len(data)
            if progress:
                progress(written)
        for fut in plan_bytes + [f for futs in pending for f in futs or ()]:
            fut.result()
    if written != plan.nbytes:
        raise ShardError(f"shard {plan.shard_id}: wrote {written} bytes, planned {plan.nbytes}")
    return ShardSums(sha.hexdigest(), crcs.crc)


class _Copied:
    """How far the copier has got, for the thread hashing behind it."""

    def __init__(self) -> None:
        self.pos, self.done, self.cond = 0, False, threading.Condition()

    def advance(self, pos: int, done: bool = False) -> None:
        with self.cond:
            self.pos, self.done = pos, self.done or done
            self.cond.notify()

    def wait_past(self, pos: int) -> tuple[int, bool]:
        with self.cond:
            self.cond.wait_for(lambda: self.pos > pos or self.done)
            return self.pos, self.done


def copy_shard(plan: ShardPlan, fd: int, progress: Callable[[int], None] | None = None) -> ShardSums:
    """Write the shard into the empty local file `fd` (opened for reading and writing), its
    tensor bytes moved by the kernel (harvest.formats.filecopy: cloned where the filesystem
    shares blocks, copied in the kernel elsewhere); returns its sha256 and each sample's crc32s.
    The checksums are not on that path: a second thread reads back what has been copied so far,
    from `fd` itself (so the sums are of the very bytes in the file, and from the page cache), and
    sums it while the kernel copies the next ranges; this thread waits for it only at the end.
    Each range's writeback is started as soon as it is copied, so the caller's fsync waits for
    little."""
    copied = _Copied()

    def digest() -> ShardSums:
        sha, crcs, at = hashlib.sha256(), _Crcs(plan), 0
        buf = memoryview(bytearray(COPY_BUFFER))
        while True:
            upto, done = copied.wait_past(at)
            while at < upto:
                got = os.preadv(fd, [buf[: min(upto - at, COPY_BUFFER)]], at)
                if not got:
                    raise ShardError(f"shard {plan.shard_id}: {at} bytes read back, {upto} written")
                crc = crcer.submit(crcs.update, buf[:got])  # beside the sha256, over the same buffer
                sha.update(buf[:got])
                crc.result()
                at += got
            if done:
                return ShardSums(sha.hexdigest(), crcs.crc)

    with ThreadPoolExecutor(1, thread_name_prefix="shard-sha256") as hasher, \
            ThreadPoolExecutor(1, thread_name_prefix="shard-crc32") as crcer:
        hashed = hasher.submit(digest)
        pos = 0
        try:
            for piece in _pieces(plan):
                if isinstance(piece, bytes):
                    pos = write_all(fd, piece, pos)
                else:
                    path, begin, n, name = piece
                    try:
                        src = os.open(path, os.O_RDONLY)
                    except OSError as e:
                        raise unreadable(path, e) from None
                    try:
                        copy_range(src, begin, fd, pos, n)
                    except ShortFile:
                        raise truncated(path, name) from None
                    finally:
                        os.close(src)
                    start_writeback(fd, pos, n)  # the disk writes this range while the next is copied
                    pos += n
                copied.advance(pos)
                if progress:
                    progress(pos)
            copied.advance(pos, done=True)
            result = hashed.result()
        finally:
            copied.advance(pos, done=True)  # an error or a kill: the hasher stops where the copy did
    if pos != plan.nbytes:
        raise ShardError(f"shard {plan.shard_id}: wrote {pos} bytes, planned {plan.nbytes}")
    return result
