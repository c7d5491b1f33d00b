"""Byte ranges moved from file to file by the kernel, not through Python.

The spool and shard files are concatenations of byte ranges of other files (a dump's hidden
states into a spool file, spool files' tensors into a shard). `copy_file_range(2)` moves such a
range without it ever entering this process: on filesystems that share blocks between files
(XFS with reflink, btrfs, and others) a block-aligned range is cloned, which writes no data at
all; elsewhere (ext4) the kernel copies page to page, which is still cheaper than a read and a
write from Python. Both files' formats put their tensor data on a filesystem block
(harvest.formats.stformat.BLOCK) so that the ranges are aligned.

Where the kernel refuses (files on different filesystems: kernels before 5.3 and from 5.19 on
refuse those; filesystems without the call; special files), or answers 0 bytes where there is
data (some FUSE, overlay and network filesystems), the range is copied with `pread`/`pwrite`
through one buffer instead: the same bytes, more slowly. Callers copy by the kernel only within
one filesystem anyway (harvest.formats.spool, harvest.collector.collector).
"""

from __future__ import annotations

import ctypes
import errno
import os

BUFFER = 8 << 20
_FALLBACK = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.ETXTBSY, errno.EPERM}


class ShortFile(OSError):
    """The source file ended inside the range being copied."""


def write_all(fd: int, data: bytes | memoryview, pos: int) -> int:
    """Write all of `data` at `pos` of `fd` (its position does not move); returns the end."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    return pos


def copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
    """Copy `n` bytes at `src_off` of fd `src` to `dst_off` of fd `dst` (neither fd's position
    moves). Raises ShortFile when `src` ends first."""
    kernel = hasattr(os, "copy_file_range")
    while n:
        if kernel:
            try:
                got = os.copy_file_range(src, dst, n, src_off, dst_off)
            except OSError as e:
                if e.errno not in _FALLBACK:
                    raise
                kernel = False
                continue
        else:
            data = os.pread(src, min(n, BUFFER), src_off)
            got = len(data)
            write_all(dst, data, dst_off)
        if not got:
            if kernel and os.pread(src, 1, src_off):
                kernel = False  # 0 with data there: some filesystems (FUSE, overlay, NFS) do that
                continue
            raise ShortFile(errno.EIO, f"the file ends {n} bytes before the end of the range")
        src_off, dst_off, n = src_off + got, dst_off + got, n - got


_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing `nbytes` at `offset` of `fd` (0: to the end) to the disk
    now, without waiting for it (sync_file_range(2), SYNC_FILE_RANGE_WRITE). A writer that does
    this as it goes keeps the disk busy while it copies and hashes the next bytes, so the fsync
    (or syncfs) that makes the file durable finds little left to write. Durability still comes
    only from that fsync; where the call is missing this does nothing."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
