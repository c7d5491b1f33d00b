"""Writing a planned shard (harvest.formats.shard.ShardPlan): its bytes copied from the spool files,
undecoded, and summed on the way.

`copy_shard` has the kernel move the tensor bytes into a local file on the spool's filesystem
(cloning blocks where it can); `write_shard` streams them through two small buffers into anything
else. Both sum what they store on a thread that already sees every byte: the shard's sha256 and,
per sample, one crc32 per per-token tensor (`ShardSums`), so no byte is read a second time.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from harvest.formats.filecopy import ShortFile, copy_range, start_writeback, write_all
from harvest.formats.index import ShardError
from harvest.formats.shard import ShardPlan, ShardSums
from harvest.formats.spool import truncated, unreadable

COPY_BUFFER = 8 << 20


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


def _ranges(
    plan: ShardPlan, bufs: list[memoryview], wait: Callable[[int], None]
) -> Iterator[tuple[memoryview | bytes, int]]:
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
    pending: list[tuple[Future[Any], Future[Any]] | None] = [None, None]
    written = 0

    def wait(slot: int) -> None:
        for fut in pending[slot] or ():
            fut.result()  # its last bytes are summed: the buffer is free

    plan_bytes: list[Future[Any]] = []  # the header's and the offsets' sums (a buffer's are awaited in `wait`)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="shard-sha256") as hasher,
        ThreadPoolExecutor(1, thread_name_prefix="shard-crc32") as crcer,
    ):
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

    with (
        ThreadPoolExecutor(1, thread_name_prefix="shard-sha256") as hasher,
        ThreadPoolExecutor(1, thread_name_prefix="shard-crc32") as crcer,
    ):
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
