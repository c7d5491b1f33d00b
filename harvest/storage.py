"""fsspec access to the output, with the one write rule readers depend on: an object is
either absent or complete.

Local files are written to a temporary name in the same directory, fsynced and renamed.
Object stores get the whole body in one call (`pipe_file`: a single PUT, or a multipart
upload completed at the end), never a streaming `open(..., 'wb')` that an exception could
leave half-written.
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem


def _storage_options(protocol: str) -> dict:
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("HARVEST_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


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

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self.path(name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path(name), start=start, end=end)

    def read_json(self, name: str):
        return json.loads(self.read_bytes(name))

    def list(self, folder: str, suffix: str = "") -> list[str]:
        """Names (not paths) in `folder`, sorted; an absent folder is empty."""
        p = self.path(folder)
        try:
            entries = self.fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [n for n in names if n.endswith(suffix) and not n.startswith(".")]

    def write_atomic(self, name: str, data: bytes) -> None:
        path = self.path(name)
        if self.is_local:
            atomic_write_local(path, data)
        else:
            self.fs.pipe_file(path, data)

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass


def atomic_write_local(path: str, data: bytes | memoryview) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        os.fchmod(fd, 0o644)  # readers (trainers) are often another user; mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
