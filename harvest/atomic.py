"""A local file that appears whole or not at all.

The one way harvest writes a file in place on a local filesystem: the bytes go to a temporary
name in the file's own directory (so the rename cannot cross filesystems), are fsynced, and the
temporary file is renamed over the final name (or, for a writer that must not replace what is
there, hard-linked to it); the directory is fsynced too where the rename itself must survive a
power cut. A reader that lists the directory sees the old file or the new one, never a part.
Writers that make a whole folder (a model's `save_pretrained`, a dataset's `save_to_disk`) build it
under a temporary name beside it and rename it into place, or move its files into an existing
folder one rename each (`atomic_folder`).

Temporary names stay each folder's contract, not this module's: a writer passes the prefix its
folder's owner declares (`harvest.storage.TEMP_PREFIX` for output folders) or the exact temporary
path (the dump dir's `harvest.node.dumpdir.temp_chunk_path`), so the sweepers that remove the
temporary files of killed writers keep finding them.

Standard library only: the engine process (the dump writer), the node-local writers and the
storage layer all import it, and the engine's venv need not have fsspec.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

Bytes = bytes | bytearray | memoryview


def write_atomic(
    path: str,
    data: Bytes | Iterable[Bytes],
    *,
    prefix: str | None = None,
    temp: str | None = None,
    fsync: bool = True,
    fsync_dir: bool = False,
    exclusive: bool = False,
) -> bool:
    """Write `data` (bytes, or pieces written in order: a caller need not join, i.e. copy, them;
    a generator streams) to `path`, whole or not at all. Returns True, or False when `exclusive`
    and `path` already existed (it is left as it was).

    The temporary file is either made here, `prefix` + random in `path`'s directory, mode 0644
    (readers, trainers among them, are often another user), or `temp`, an exact path in that
    directory, created as `open(temp, "wb")` would. `fsync`: the file's bytes are durable before
    the rename (False where the directory is tmpfs, or a later `syncfs` covers them). `fsync_dir`:
    the rename too, once done. `exclusive`: published by a hard link, which fails if `path`
    exists (atomic on POSIX filesystems and NFS), instead of a rename over it. The temporary file
    never outlives the call."""
    if (prefix is None) == (temp is None):
        raise ValueError("write_atomic takes exactly one of prefix= and temp=")
    folder = os.path.dirname(path) or "."
    if temp is None:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    else:
        fd, tmp = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), temp
    try:
        with os.fdopen(fd, "wb") as f:
            if temp is None:
                os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600
            for piece in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(piece)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                unlink_quiet(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    if fsync_dir:
        fsync_directory(folder)
    return True


@contextlib.contextmanager
def atomic_path(path: str, *, prefix: str, fsync: bool = True, fsync_dir: bool = False) -> Iterator[str]:
    """For writers that take a file name (safetensors' `save_file`, a library's `save`): yields a
    temporary path, `prefix` + random in `path`'s directory; when the block ends normally the
    file is made 0644, fsynced (`fsync`) and renamed over `path` (then the directory fsynced,
    `fsync_dir`); when it raises, the temporary file is removed."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    if fsync_dir:
        fsync_directory(folder)


@contextlib.contextmanager
def atomic_folder(path: str, *, prefix: str, into: bool = False, last: Iterable[str] = ()) -> Iterator[str]:
    """For writers that make a folder of files: yields a temporary folder, `prefix` + random,
    beside `path` (or inside it, `into`). When the block ends normally it is renamed to `path`,
    which must not exist or be empty (else OSError: another builder's folder is there); or,
    `into`, each of its entries is renamed into the existing folder `path`, the names in `last`
    (the file that names the others) after the rest, so each file appears whole and a reader that
    goes by `last` sees the old set or the new one. Nothing is fsynced (what is built this way can
    be built again). The temporary folder never outlives the block."""
    last = set(last)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=path if into else os.path.dirname(os.path.abspath(path)))
    moved = False
    try:
        yield tmp
        if into:
            for name in sorted(os.listdir(tmp), key=lambda n: n in last):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
        else:
            os.replace(tmp, path)
            moved = True
    finally:
        if not moved:
            shutil.rmtree(tmp, ignore_errors=True)


def fsync_directory(folder: str) -> None:
    """Make the names in `folder` (a rename, a link, a removal) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    """`path` removed if it is there (a file some other step may have removed already)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(path)
