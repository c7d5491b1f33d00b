"""The spool: finished samples waiting on a node for the collector.

One file a sample, `<spool>/<sample_id>.safetensors`, written atomically, holding the tokens,
the loss mask and the hidden states `[T, K, H]` already in the run's storage dtype (with their
`hidden_scale` `[T, K]` when that is fp8), so the collector only concatenates: it checks each
file's header against the run and then copies tensor bytes without decoding them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harvest.formats.filecopy import copy_range, start_writeback, write_all
from harvest.ids import check_id
from harvest.node.paths import private_dir
from harvest.storage import TEMP_PREFIX

if TYPE_CHECKING:
    import torch

    from harvest.formats.stformat import TensorSpan

# torch and the tensor framing are imported where a sample's tensors are, not at import: the
# spool dir's names and ids serve `harvest status`, `requeue` and `janitor`, which load no torch.

_NAME = re.compile(r"([0-9a-f]{32})\.safetensors")
SCALE = "hidden_scale"


class SpoolError(ValueError):
    """A spool file that does not hold what the run stores (or is not a spool file at all)."""


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


_ID_FILE = ".spool-id"


def spool_identity(spool_dir: str) -> str:
    """A random id for this spool dir, made once by whoever uses it first, shared by every
    worker and the collector that mount it (their host names differ under docker compose)."""
    path = os.path.join(private_dir(spool_dir, "spool dir"), _ID_FILE)
    while True:
        try:
            with open(path, encoding="ascii") as f:
                sid = check_id(f.read().strip(), "spool id")
            clear_dead_temps(spool_dir)
            return sid
        except FileNotFoundError:
            pass
        tmp = os.path.join(spool_dir, f"{_ID_FILE}.{os.getpid()}.{os.urandom(4).hex()}")
        with open(tmp, "w", encoding="ascii") as f:
            f.write(os.urandom(16).hex())
        try:
            os.link(tmp, path)  # the first one wins; the others read the winner's id
        except (FileExistsError, FileNotFoundError):
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def rotate_spool_identity(spool_dir: str, revoked: str) -> str:
    """A new id for a spool dir whose id `revoked` was reclaimed (harvest.state.spools). Every
    process of the spool calls this when it learns of the revocation, and all end with one new
    id: under a lock, the first replaces the file (only while it still holds `revoked`), the
    others read the id it wrote."""
    path = os.path.join(private_dir(spool_dir, "spool dir"), _ID_FILE)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        current = spool_identity(spool_dir)
        if current != revoked:
            return current
        tmp = os.path.join(spool_dir, f"{_ID_FILE}.{os.getpid()}.{os.urandom(4).hex()}")
        new = os.urandom(16).hex()
        with open(tmp, "w", encoding="ascii") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return new
    finally:
        os.close(fd)


TEMP_MAX_AGE_S = 3600.0  # far longer than a job takes to write and commit its spool files


def clear_dead_temps(spool_dir: str) -> None:
    """Temporary id files of processes killed while making the id (their pid is gone), and the
    temporary sample files of workers killed before their batch's commit. Those go by age, not
    pid: workers in other containers share the spool with pids this process cannot see."""
    now = time.time()
    for name in os.listdir(spool_dir):
        if name.startswith(TEMP_PREFIX):
            path = os.path.join(spool_dir, name)
            with contextlib.suppress(FileNotFoundError):
                if now - os.lstat(path).st_mtime > TEMP_MAX_AGE_S:
                    os.unlink(path)
            continue
        if not name.startswith(_ID_FILE + "."):
            continue
        pid = name[len(_ID_FILE) + 1 :].split(".")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(spool_dir, name))
        except PermissionError:
            pass  # alive, someone else's


def spool_path(spool_dir: str, sid: str) -> str:
    return os.path.join(spool_dir, f"{check_id(sid, 'sample id')}.safetensors")


def set_aside_path(path: str) -> str:
    """Where a spool file that does not match the run is kept for a person to look at; the
    spool's listing skips it."""
    return os.path.join(os.path.dirname(path), f".bad-{os.path.basename(path)}")


def _parts(s: SpooledSample, run: str) -> list[tuple[str, bytes | memoryview]]:
    """(tensor name, bytes) in file order, the header first (named "")."""
    import torch

    from harvest.formats.stformat import BLOCK, encode_parts

    tensors = {
        "input_ids": s.input_ids.to(torch.int32).contiguous(),
        "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
        "hidden_states": s.hidden_states.contiguous(),
    }
    if s.hidden_scale is not None:
        tensors[SCALE] = s.hidden_scale.to(torch.float32).contiguous()
    # data on a block: the collector's kernel copy into a shard can then clone it (harvest.formats.filecopy)
    return list(zip(["", *sorted(tensors)], encode_parts(tensors, {"sample_id": s.id, "run": run}, BLOCK)))


class SpoolBatch:
    """A job's spool files, made durable together and only then put in place.

    `add` writes each sample under a temporary name (`.tmp-<sample>.<pid>`, streamed, no fsync);
    `commit` makes them all durable at once (one `syncfs` of the spool's filesystem, or one
    fsync a file where syncfs is missing), renames them into place and fsyncs the spool dir once.
    Per-file fsyncs cost a disk flush each; one flush per job lets the disk take the job's bytes
    as a single stream. Only after `commit` returns may the worker mark the samples spooled: a
    crash or power loss before that leaves at most temporary files (cleared by age when a
    process next opens the spool, `spool_identity`) and the samples queued, so their job runs again. Owner: the worker
    process that made the batch, for the life of one job."""

    def __init__(self, spool_dir: str, run: str) -> None:
        self.spool_dir, self.run = spool_dir, run
        os.makedirs(spool_dir, exist_ok=True)
        self._dev = os.stat(spool_dir).st_dev
        self._temps: list[tuple[str, str]] = []  # (temp path, final path)

    def _by_kernel(self, s: SpooledSample) -> bool:
        """Copy the dump's bytes by the kernel only when the dumps lie on the spool's filesystem:
        from elsewhere (dumps on tmpfs, the usual GPU-node layout) the kernel would refuse, and
        the tensor, already read, is written as it is."""
        try:
            return bool(s.hidden_from) and all(os.stat(p).st_dev == self._dev for p, _, _ in s.hidden_from)
        except FileNotFoundError:
            return False

    def add(self, s: SpooledSample) -> int:
        """Write `s` under a temporary name; returns its size in bytes. A failed write leaves
        nothing, and the files added before it can still be committed."""
        final = spool_path(self.spool_dir, s.id)
        # unique even across containers (same small pids) running the same sample at once
        tmp = os.path.join(self.spool_dir, f"{TEMP_PREFIX}{s.id}.{os.getpid()}.{os.urandom(4).hex()}")
        parts = _parts(s, self.run)
        by_kernel = self._by_kernel(s)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                pos = 0
                for name, piece in parts:
                    if name == "hidden_states" and by_kernel:
                        pos = _copy_ranges(s.hidden_from, fd, pos, len(piece))
                    else:
                        pos = write_all(fd, piece, pos)
                start_writeback(fd)  # the disk takes this file while the job assembles the next
            finally:
                os.close(fd)
        except BaseException:  # disk full mid-file: the batch keeps only complete files
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._temps.append((tmp, final))
        return pos

    def commit(self) -> None:
        """Durable, then in place: flush every file, rename each, fsync the dir. On an error
        the files not yet renamed are removed (the caller keeps their samples queued)."""
        if not self._temps:
            return
        try:
            dfd = os.open(self.spool_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if not _syncfs(dfd):
                    for tmp, _ in self._temps:
                        fd = os.open(tmp, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                while self._temps:
                    tmp, final = self._temps[0]
                    os.replace(tmp, final)
                    self._temps.pop(0)
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for tmp, _ in self._temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._temps.clear()


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


_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(fd: int) -> bool:
    """syncfs(2) of the filesystem holding `fd`: True when done, False where unavailable."""
    fn = getattr(_libc, "syncfs", None)
    if fn is None:
        return False
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")
    return True


def write_sample(spool_dir: str, s: SpooledSample, run: str) -> int:
    """One sample's spool file, durable and in place (a batch of one)."""
    batch = SpoolBatch(spool_dir, run)
    n = batch.add(s)
    batch.commit()
    return n


def read_sample(path: str) -> SpooledSample:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        return SpooledSample(
            check_id(meta.get("sample_id", ""), "sample id"),
            f.get_tensor("input_ids"),
            f.get_tensor("loss_mask"),
            f.get_tensor("hidden_states"),
            f.get_tensor(SCALE) if SCALE in f.keys() else None,
        )


def inspect_sample(path: str, sid: str, num_points: int, hidden_size: int, dtype: torch.dtype) -> SpoolEntry:
    """Read only the header of `path` and check it is sample `sid` as the run stores it."""
    import torch

    from harvest.formats.fp8 import is_fp8
    from harvest.formats.stformat import FormatError, read_file_header

    try:
        spans, meta = read_file_header(path)
    except (OSError, FormatError, KeyError, TypeError, ValueError) as e:
        raise SpoolError(f"{path}: unreadable spool file ({e})") from None
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
    return SpoolEntry(sid, path, t, spans)


def list_spooled(spool_dir: str) -> list[tuple[str, str, int]]:
    """(sample_id, path, bytes) of complete spool files, oldest first."""
    out = []
    try:
        entries = list(os.scandir(spool_dir))
    except FileNotFoundError:
        return []
    for e in entries:
        m = _NAME.fullmatch(e.name)
        if m and e.is_file(follow_symlinks=False):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:  # packed and deleted by the collector since the scandir
                continue
            out.append((st.st_mtime_ns, m.group(1), e.path, st.st_size))
    out.sort()
    return [(sid, path, size) for _, sid, path, size in out]
