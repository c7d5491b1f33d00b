"""A shard's bytes into storage, not yet visible: the `pack` step of the collector's commit.

To a local output the shard is built as a temporary file in its final folder (committing is then
a rename): on the spool's filesystem the kernel copies, or clones, the spool files' ranges
(harvest.formats.shard_write.copy_shard); on another one (a mounted output) the bytes are streamed
(write_shard). To object storage they are streamed into a multipart upload (harvest.multipart)
with no temporary shard on the node's disk. Both hand back the shard's checksums.

A run with a codec has each sample's hidden states coded first (`coded`), here on the collector,
off the workers' path: into a scratch file in the spool, which both packers then copy from as
they copy from the spool files, and which is removed once the shard is stored.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from harvest.atomic import unlink_quiet
from harvest.formats.shard import SHARDS, ShardPlan, ShardSums, encode_shard, shard_file
from harvest.formats.shard_write import copy_shard, write_shard
from harvest.multipart import MultipartWriter, Upload
from harvest.storage import TEMP_PREFIX, Location, StorageError

Crash = Callable[[str], None]  # harvest.collector.faults.CrashHook: the named kill points tests use


@dataclass(frozen=True)
class Packed:
    """A shard's bytes stored but not yet visible: `tmp`, the fsynced temporary file of a local
    output, or `upload`, the multipart upload with every part sent."""

    sums: ShardSums
    plan: ShardPlan  # the plan stored: a run with a codec's has its hidden states coded
    tmp: str | None = None
    upload: Upload | None = None


def scratch_file(spool_dir: str, node: str, shard_id: str) -> str:
    """Where a shard's hidden states are coded: in the spool, on the disk they are read from."""
    return os.path.join(spool_dir, f"{TEMP_PREFIX}coded-{node}-{shard_id}")


def clear_scratch(spool_dir: str, node: str) -> None:
    """The scratch files a killed collector of `node` left in its spool."""
    for p in glob.glob(os.path.join(glob.escape(spool_dir), f"{TEMP_PREFIX}coded-{node}-*")):
        unlink_quiet(p)


def pack_shard(
    out: Location,
    plan: ShardPlan,
    tmp: str | None,
    scratch: str,
    spool_dir: str,
    part_bytes: int | None,
    retries: int,
    retry_delay: float,
    crash: Crash,
) -> Packed:
    """The shard stored, not yet visible: as the temporary file `tmp` of a local output
    (`pack_local`), else as a multipart upload (`pack_upload`); with a codec, its hidden states
    coded into `scratch` first (`coded`)."""
    with coded(plan, scratch) as ready:
        if tmp is None:
            return pack_upload(out, ready, part_bytes, retries, retry_delay, crash)
        return pack_local(ready, tmp, spool_dir, crash)


@contextlib.contextmanager
def coded(plan: ShardPlan, scratch: str) -> Iterator[ShardPlan]:
    """`plan` ready to pack: as it is without a codec, else its hidden states coded into the file
    `scratch` (harvest.formats.shard.encode_shard), removed on the way out. An OSError writing
    the scratch file (the spool's disk full) is a StorageError: the restart codes it again."""
    if not plan.needs_encoding:
        yield plan
        return
    try:
        try:
            ready = encode_shard(plan, scratch)
        except OSError as e:
            raise StorageError(
                f"coding the hidden states of shard {plan.shard_id} into {scratch} failed: {type(e).__name__}: {e}"
            ) from e
        yield ready
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)


def _progress(plan: ShardPlan, local: bool, crash: Crash) -> Callable[[int], None]:
    def progress(written: int) -> None:
        if local and written == len(plan.header):
            crash("header-sent")
        crash("packing")

    return progress


def staging_dir(out: Location) -> str | None:
    """Where a local output's shards are built (None for object storage); an OSError making it
    (read-only, full, not a folder) is as persistent as a storage error, and told as one."""
    try:
        return out.local_staging_dir(SHARDS)
    except OSError as e:
        raise StorageError(f"preparing {out.path(SHARDS)} failed: {type(e).__name__}: {e}") from e


def pack_local(plan: ShardPlan, tmp: str, spool_dir: str, crash: Crash) -> Packed:
    """The shard as the fsynced temporary file `tmp` (in the output's shards folder)."""
    try:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)  # copy_shard reads it back
        try:
            progress = _progress(plan, True, crash)
            if os.fstat(fd).st_dev == os.stat(spool_dir).st_dev:
                sums = copy_shard(plan, fd, progress)  # by the kernel, cloned where the filesystem can
            else:  # another filesystem (a mounted output): one read of each byte, streamed
                with open(fd, "wb", closefd=False) as f:
                    sums = write_shard(plan, f, progress)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:  # never created, or the output read-only or gone: the error to tell is `e`
            pass
        if isinstance(e, OSError):  # disk full, read-only, not a folder: as persistent as storage errors
            raise StorageError(f"packing {tmp} failed: {type(e).__name__}: {e}") from e
        raise
    crash("packed")
    return Packed(sums, plan, tmp=tmp)


def pack_upload(
    out: Location, plan: ShardPlan, part_bytes: int | None, retries: int, retry_delay: float, crash: Crash
) -> Packed:
    """The shard as a multipart upload of `out` with every part stored, not yet completed."""
    name = shard_file(plan.shard_id)

    def stored(number: int) -> None:  # on an upload thread, after part `number` is stored
        if number == 1:
            crash("header-sent")  # the first part holds the safetensors header
        crash("uploading")

    w = MultipartWriter(
        out, name, f"upload of {out.path(name)}", part_bytes, on_part=stored, attempts=retries, retry_delay=retry_delay
    )
    try:
        sums = write_shard(plan, w, progress=_progress(plan, False, crash))
        upload = w.finish()
    except BaseException as e:
        w.abort()
        if isinstance(e, OSError):  # reading the spool (the store's own errors are StorageErrors)
            raise StorageError(f"packing {out.path(name)} failed: {type(e).__name__}: {e}") from e
        raise
    crash("packed")
    return Packed(sums, plan, upload=upload)
