"""A shard streamed into object storage as a multipart upload: whole at `complete`, or never.

The collector writes a shard's bytes once, straight from the spool files into parts held in
memory, and sends up to `in_flight` parts at a time while it reads the next, so disk reads and
network sends overlap without a temporary shard file on the node's disk. S3 shows no object
until `complete_multipart_upload`; an upload that is aborted, or whose writer is killed, leaves
only invisible parts, which the restart aborts by name (`Location.abort_uploads`: the packing
record names the shard). One part may hold the whole shard (S3 allows a last part, and so a
single part, under the 5 MiB minimum), so small shards take the same path as large ones.

Owner: the collector that recorded the shard, from `create` to `complete` or `abort`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from harvest.settings import CollectorSettings, StorageSettings
from harvest.storage import Location, retry

T = TypeVar("T")

MIN_PART_BYTES = 5 << 20  # S3's minimum for every part but the last
DEFAULT_PART_BYTES = CollectorSettings.part_bytes
IN_FLIGHT = 4  # parts sent at once; memory is (IN_FLIGHT + 1) * part_bytes


@dataclass
class Upload:
    """A multipart upload with every part sent, not yet completed (so not yet visible)."""

    loc: Location
    name: str
    upload_id: str
    parts: list[dict] = field(default_factory=list)  # [{"PartNumber", "ETag"}] in order
    attempts: int = StorageSettings.attempts
    retry_delay: float = StorageSettings.retry_delay_s

    def _call(self, method: str, **kw: object) -> dict:
        bucket, key, _ = self.loc.fs.split_path(self.loc.path(self.name))
        return self.loc.fs.call_s3(method, Bucket=bucket, Key=key, **kw)

    def complete(self, what: str) -> None:
        """Make the object visible, whole (retried: completing twice is harmless)."""
        retry(
            lambda: self._call(
                "complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
            ),
            what,
            attempts=self.attempts,
            base_delay=self.retry_delay,
        )

    def abort(self) -> None:
        """Best effort: a restart aborts by name whatever this leaves."""
        try:
            self._call("abort_multipart_upload", UploadId=self.upload_id)
        except Exception:  # noqa: BLE001 - the restart's abort_uploads is the guarantee
            pass


class MultipartWriter:
    """A file-like sink (`write`) that cuts what it is given into parts and sends them.

    `on_part(n)` is told after each part is stored, with that part's number (parts finish out of
    order: part 1, the one holding the header, may not be the first stored)."""

    def __init__(
        self,
        loc: Location,
        name: str,
        what: str,
        part_bytes: int | None = None,
        on_part: Callable[[int], None] | None = None,
        attempts: int = StorageSettings.attempts,
        retry_delay: float = StorageSettings.retry_delay_s,
    ) -> None:
        self.part_bytes = max(MIN_PART_BYTES, part_bytes or DEFAULT_PART_BYTES)
        self.what, self.on_part = what, on_part
        self.attempts, self.retry_delay = attempts, retry_delay
        self.upload = Upload(loc, name, "", attempts=attempts, retry_delay=retry_delay)
        created = self._retry(lambda: self.upload._call("create_multipart_upload"))
        self.upload.upload_id = created["UploadId"]
        self._buf = bytearray()
        self._sent: list[Future] = []
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="harvest-part")

    def _retry(self, fn: Callable[[], T]) -> T:
        return retry(fn, self.what, attempts=self.attempts, base_delay=self.retry_delay)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._buf += data
        while len(self._buf) >= self.part_bytes:
            self._send(bytes(self._buf[: self.part_bytes]))
            del self._buf[: self.part_bytes]
        return len(data)

    def _send(self, body: bytes) -> None:
        number = len(self._sent) + 1
        # at most IN_FLIGHT parts queued or sending: wait for the oldest before holding another
        if len(self._sent) >= IN_FLIGHT:
            self._sent[-IN_FLIGHT].result()

        def put() -> dict:
            r = self._retry(
                lambda: self.upload._call("upload_part", UploadId=self.upload.upload_id, PartNumber=number, Body=body)
            )
            return {"PartNumber": number, "ETag": r["ETag"]}

        fut = self._pool.submit(put)
        fut.add_done_callback(self._stored_one)
        self._sent.append(fut)

    def _stored_one(self, fut: Future) -> None:
        if fut.exception() is None and self.on_part is not None:
            self.on_part(fut.result()["PartNumber"])

    def finish(self) -> Upload:
        """Send the last part and wait for every part; the upload is then ready to complete."""
        try:
            if self._buf or not self._sent:
                self._send(bytes(self._buf))
                self._buf = bytearray()
            self.upload.parts = [f.result() for f in self._sent]
        except BaseException:
            self.abort()
            raise
        self._pool.shutdown()
        return self.upload

    def abort(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        self.upload.abort()
