"""The spool dir: every name in it, who owns it, and how a spool file gets there durably.

The spool dir is node-local and shared by one node's workers (which write it) and its collector
(which packs it into shards); the bytes of one spool file are harvest.formats.spool's. Who owns
what in it:

- `<sample_id>.safetensors`: a finished sample. A worker's job writes it through a temporary name
  and renames it into place only once it is durable (`SpoolBatch.commit`); from then on it belongs
  to the spool until the collector deletes it (committed, or not the spool's to pack).
- `.tmp-<sample_id>.<pid>.<random>`: a sample file in flight, owned by the worker's `SpoolBatch`
  until its commit. One left by a killed worker is removed by age (`TEMP_MAX_AGE_S`), not pid:
  workers in other containers share the spool with pids this process cannot see.
- `.spool-id`: the spool's random id (`spool_identity`), made once by whoever opens the spool
  first; `rotate_spool_identity` replaces it, under `.spool-id.lock`, when the id was revoked
  (harvest.state.spools). `.spool-id.<pid>.<random>`: that file in flight, removed when its
  writer's pid is gone.
- `.bad-<name>`: a spool file that did not match the run or was damaged, set aside for a person
  (harvest.collector.integrity); the listing skips it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import time

from harvest.atomic import write_atomic
from harvest.formats.filecopy import start_writeback
from harvest.formats.spool import SpooledSample, encode_sample, write_encoded
from harvest.ids import check_id
from harvest.node.paths import private_dir
from harvest.storage import TEMP_PREFIX

# No torch at import: the spool dir's names, ids and listing serve `harvest status`, `requeue`
# and `janitor`, which load no torch (harvest.formats.spool imports it where tensors are).

_NAME = re.compile(r"([0-9a-f]{32})\.safetensors")
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
        # published by a hard link: the first one wins; the others read the winner's id
        try:
            write_atomic(path, os.urandom(16).hex().encode(), temp=_id_temp(spool_dir), fsync=False, exclusive=True)
        except FileNotFoundError:  # our temp file, removed by a process that cannot see our pid
            if not os.path.isdir(spool_dir):
                raise


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
        new = os.urandom(16).hex()
        write_atomic(path, new.encode(), temp=_id_temp(spool_dir))
        return new
    finally:
        os.close(fd)


def _id_temp(spool_dir: str) -> str:
    """The id file in flight: `clear_dead_temps` removes it once its writer's pid is gone."""
    return os.path.join(spool_dir, f"{_ID_FILE}.{os.getpid()}.{os.urandom(4).hex()}")


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
    """Where a spool file that does not match the run, or was damaged, is kept for a person to look
    at; the spool's listing skips it."""
    return os.path.join(os.path.dirname(path), f".bad-{os.path.basename(path)}")


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
        parts = encode_sample(s, self.run)
        hidden_from = s.hidden_from if self._by_kernel(s) else ()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                pos = write_encoded(fd, parts, hidden_from)
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
        the files not yet renamed are removed (the caller keeps their samples queued). Not
        `harvest.atomic.write_atomic`, which makes each file durable by itself: a batch takes one
        syncfs for all its files and one fsync of the dir for all its renames."""
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
