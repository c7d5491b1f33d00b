"""fsspec access to the output, with the one write rule readers depend on: an object is
either absent or complete.

Local files are written to a temporary name in the same directory, fsynced and renamed.
Object stores get small documents whole in one call (`pipe_file`, one PUT) and shards as
multipart uploads that become visible only when completed (harvest.multipart), never a
streaming `open(..., 'wb')` that an exception could leave half-written.

Storage calls go through `retry`: transient errors (connection resets, timeouts, 5xx the
client gave up on) are retried with exponential backoff; persistent ones (no such bucket,
access denied, disk full) and exhausted retries become a `StorageError` whose message says
what to fix, so the collector stops with its spool intact instead of looping or losing data.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from harvest.atomic import unlink_quiet, write_atomic
from harvest.errors import InputError, StorageError  # StorageError: what every failure here is raised as
from harvest.settings import StorageSettings

log = logging.getLogger("harvest.storage")
T = TypeVar("T")
# The dot-name prefix of a file being written into an output folder; readers list only other names.
TEMP_PREFIX = ".tmp-"

# Environment read for s3:// URLs (flags of `harvest collect`/`run` set the HARVEST_ ones).
S3_ENDPOINT_VARS = ("HARVEST_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
S3_REGION_VARS = ("HARVEST_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION")
_PERSISTENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENAMETOOLONG}


class UnreadableDocument(InputError, ValueError):
    """A stored JSON document (an index, a claim) that does not parse: garbled or cut short. The
    message names it; who reads it adds the repair."""


def named(e: OSError, where: str) -> OSError:
    """`e`, naming `where` if it does not already: an object store's error often says only
    `Access Denied`. The same type (callers catch FileNotFoundError and the like), with its errno;
    an exception of a type of its own (a client library's) is left as it is."""
    if e.filename is not None or where in str(e) or type(e).__module__ != "builtins":
        return e
    new = type(e)(e.errno, e.strerror, where) if e.errno is not None and e.strerror else type(e)(f"{where}: {e}")
    new.__cause__ = e
    return new


def _first_env(names: tuple[str, ...]) -> str | None:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return None


def s3_options() -> dict:
    """s3fs options from the environment: endpoint (MinIO, Ceph, moto), region, credentials.
    Credentials stay in the environment only (never flags: they would show in `ps`)."""
    opts: dict = {}
    client: dict = {}
    endpoint = _first_env(S3_ENDPOINT_VARS)
    if endpoint:
        client["endpoint_url"] = endpoint
    region = _first_env(S3_REGION_VARS)
    if region:
        client["region_name"] = region
    if client:
        opts["client_kwargs"] = client
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        opts["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        opts["secret"] = os.environ["AWS_SECRET_ACCESS_KEY"]
        if os.environ.get("AWS_SESSION_TOKEN"):
            opts["token"] = os.environ["AWS_SESSION_TOKEN"]
    return opts


def _storage_options(protocol: str) -> dict:
    return s3_options() if protocol in ("s3", "s3a") else {}


def is_transient(e: BaseException) -> bool:
    """Worth retrying: the same call may succeed in a moment."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return False
    if isinstance(e, OSError) and e.errno in _PERSISTENT_ERRNOS:
        return False
    if isinstance(e, (TimeoutError, ConnectionError, OSError)):
        return True
    # botocore/aiohttp errors that s3fs did not translate (endpoint unreachable, read timeouts)
    name = type(e).__name__
    return any(
        k in name for k in ("Connection", "Timeout", "EndpointConnection", "ClientPayload", "ServerDisconnected")
    )


def retry(
    fn: Callable[[], T],
    what: str,
    attempts: int = StorageSettings.attempts,
    base_delay: float = StorageSettings.retry_delay_s,
    max_delay: float = StorageSettings.max_retry_delay_s,
) -> T:
    """`fn()` with transient failures retried (exponential backoff); a persistent storage
    failure (OSError), or the last transient one, raised as a StorageError naming `what`."""
    for i in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                if isinstance(e, OSError):
                    raise StorageError(f"{what} failed: {type(e).__name__}: {e}") from e
                raise  # not a storage problem (a bad document, a bug): as it is
            if i == attempts:
                raise StorageError(f"{what} failed after {attempts} attempts: {type(e).__name__}: {e}") from e
            delay = min(max_delay, base_delay * 2 ** (i - 1))
            log.warning("%s failed (%s: %s); retry %d/%d in %.1fs", what, type(e).__name__, e, i, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Location:
    """A filesystem and a root path in it (the run's output folder, or the output URL)."""

    fs: fsspec.AbstractFileSystem
    root: str

    @classmethod
    def from_url(cls, url: str) -> Location:
        if "://" not in url:
            return cls(LocalFileSystem(), os.path.abspath(url))
        protocol = url.split("://", 1)[0]
        fs, root = fsspec.core.url_to_fs(url, **_storage_options(protocol))
        return cls(fs, root.rstrip("/"))

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def child(self, *parts: str) -> Location:
        return Location(self.fs, posixpath.join(self.root, *parts))

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url(self) -> str:
        return self.fs.unstrip_protocol(self.root)

    def describe(self, name: str = "") -> str:
        """`name` here as a user would type it: a path in a local folder, a URL in an object store."""
        p = self.path(name) if name else self.root
        return p if self.is_local else self.fs.unstrip_protocol(p)

    @contextmanager
    def naming(self, name: str = "") -> Iterator[None]:
        """OSErrors raised inside name `name` here (`named`), whatever the store said."""
        try:
            yield
        except OSError as e:
            new = named(e, self.describe(name))
            if new is e:
                raise
            raise new from e

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def size(self, name: str) -> int:
        with self.naming(name):
            return int(self.fs.size(self.path(name)))

    def read_bytes(self, name: str) -> bytes:
        with self.naming(name):
            return self.fs.cat_file(self.path(name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `name`: one ranged GET on object stores."""
        if end <= start:
            return b""
        with self.naming(name):
            return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_json(self, name: str) -> Any:
        """The JSON document `name`; one that does not parse is an UnreadableDocument naming it."""
        data = self.read_bytes(name)
        try:
            return json.loads(data)
        except json.JSONDecodeError as e:
            why = f"{e.msg} at line {e.lineno} column {e.colno}"
        except (ValueError, RecursionError) as e:  # not UTF-8; nested past the parser's depth
            why = f"{type(e).__name__}: {e}"
        raise UnreadableDocument(f"{self.describe(name)} is not JSON ({why}): garbled or cut short")

    def list(self, folder: str, suffix: str = "") -> list[str]:
        """Names (not paths) in `folder`, sorted, fresh from the store; an absent folder is
        empty; dot-names (temporary files) are not listed."""
        p = self.path(folder)
        try:
            with self.naming(folder):
                entries = self.fs.ls(p, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in names if n.endswith(suffix) and not n.startswith(".")]

    def write_atomic(self, name: str, data: bytes) -> None:
        """A small document (index, run.json), whole or not at all."""
        path = self.path(name)
        if self.is_local:
            atomic_write_local(path, data)
        else:
            self.fs.pipe_file(path, data)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """`name` created whole with `data` only if it does not exist; False if it did. This is how
        writers that share nothing but the store agree on one winner: one conditional PUT
        (`If-None-Match: *`) on S3 and S3-compatible stores, a hard link of a complete, fsynced
        temporary file on local folders (atomic on POSIX filesystems and NFS)."""
        path = self.path(name)
        if not self.is_local:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileExistsError:  # s3fs's translation of 412 Precondition Failed
                return False
            return True
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return write_atomic(path, data, prefix=TEMP_PREFIX, exclusive=True)

    def delete_if(self, name: str, expected: bytes) -> bool:
        """Delete `name` only if it holds exactly `expected`; True if this call deleted it. On S3 the
        delete is conditional on the ETag read before the content (`If-Match`), so an object
        replaced in between is never deleted; on a local folder the file is first taken by an
        atomic rename, and put back when it is not the expected one."""
        path = self.path(name)
        if not self.is_local:
            try:
                etag = self.fs.info(path, refresh=True)["ETag"]
                if self.fs.cat_file(path) != expected:
                    return False
                bucket, key, _ = self.fs.split_path(path)
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
            except FileNotFoundError:
                return False
            except OSError as e:
                if "pre-condition" in str(e) or "Precondition" in str(e):
                    return False  # replaced since it was read: not ours to delete
                raise
            self.fs.invalidate_cache(path)
            return True
        taken = f"{os.path.dirname(path)}/{TEMP_PREFIX}del-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.rename(path, taken)
        except FileNotFoundError:
            return False
        with open(taken, "rb") as f:
            same = f.read() == expected
        if not same:
            try:
                os.link(taken, path)  # put back, unless a new one was created meanwhile
            except FileExistsError:
                pass
        unlink_quiet(taken)
        return same

    def local_staging_dir(self, folder: str) -> str | None:
        """Where to build a file that will become `folder/<name>`: the folder itself when the
        store is local (so committing is a rename, not a copy), else None (stage elsewhere)."""
        if not self.is_local:
            return None
        d = self.path(folder)
        os.makedirs(d, exist_ok=True)
        return d

    def put_file(self, local: str, name: str, progress: Callable[[int], None] | None = None) -> None:
        """Commit the complete local file `local` as `name` of a local store, whole or not at all:
        a rename when `local` already lies in the destination folder (it is consumed), else a
        copy to a temporary name, fsync, rename. Object stores take shards as multipart uploads
        streamed from the spool instead (harvest.multipart)."""
        path = self.path(name)
        if not self.is_local:
            raise ValueError(f"put_file is for local stores; {self.url()} takes shards through harvest.multipart")
        if os.path.dirname(os.path.abspath(local)) == os.path.dirname(path):
            if progress:
                progress(os.path.getsize(local))
            os.replace(local, path)
            return
        _copy_local_atomic(local, path, progress)

    def abort_uploads(self, name: str) -> int:
        """Abort unfinished multipart uploads of `name` (left by an uploader killed mid-upload):
        never visible as an object, but their parts are stored and billed until aborted.
        Returns how many were aborted; 0 on stores without multipart uploads. An upload gone between
        the listing and its abort (its uploader, or another process tending the same void shard,
        aborted or completed it) is not an error."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return 0
        bucket, key, _ = self.fs.split_path(self.path(name))
        uploads = call("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads") or []
        n = 0
        for u in uploads:
            if u["Key"] == key:
                try:
                    call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=u["UploadId"])
                except FileNotFoundError:  # s3fs's NoSuchUpload
                    continue
                n += 1
        return n

    def modified(self, name: str) -> float | None:
        """Last-modified time (Unix seconds) of `name`, None if the store does not say."""
        try:
            m = self.fs.modified(self.path(name))
        except (NotImplementedError, AttributeError):
            return None
        return m.timestamp()

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass


def _copy_local_atomic(src: str, dst: str, progress: Callable[[int], None] | None) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    write_atomic(dst, _read_pieces(src, progress), prefix=TEMP_PREFIX)


def _read_pieces(src: str, progress: Callable[[int], None] | None) -> Iterator[bytes]:
    """`src` in 8 MiB pieces; `progress` gets the bytes written so far after each."""
    done = 0
    with open(src, "rb") as inp:
        while buf := inp.read(8 << 20):
            yield buf
            done += len(buf)
            if progress:
                progress(done)


def atomic_write_local(path: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> None:
    """`path` appears whole or not at all (temp name, fsync, rename: harvest.atomic), its folder
    made if missing; `data` may be a list of pieces written in order, so a caller need not join
    (copy) them first."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data, prefix=TEMP_PREFIX)
