"""The spool: finished samples waiting on a node for the collector.

One file a sample, `<spool>/<sample_id>.safetensors`, written atomically, holding the tokens,
the loss mask and the hidden states `[T, K, H]` already in the run's storage dtype (with their
`hidden_scale` `[T, K]` when that is fp8), so the collector only concatenates: it checks each
file's header against the run and then copies tensor bytes without decoding them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harvest.ids import check_id
from harvest.node.paths import private_dir
from harvest.storage import atomic_write_local

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
            _clear_dead_temps(spool_dir)
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


def _clear_dead_temps(spool_dir: str) -> None:
    """Temporary id files of processes killed while making the id (their pid is gone)."""
    for name in os.listdir(spool_dir):
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


def pack_dir(spool_dir: str) -> str:
    """Where a collector builds shards for an object-storage output (a local output builds them
    in its own folder, so the commit is a rename)."""
    return os.path.join(spool_dir, ".pack")


def set_aside_path(path: str) -> str:
    """Where a spool file that does not match the run is kept for a person to look at; the
    spool's listing skips it."""
    return os.path.join(os.path.dirname(path), f".bad-{os.path.basename(path)}")


def _parts(s: SpooledSample, run: str) -> list[bytes | memoryview]:
    import torch

    from harvest.formats.stformat import encode_parts

    tensors = {
        "input_ids": s.input_ids.to(torch.int32).contiguous(),
        "loss_mask": s.loss_mask.to(torch.uint8).contiguous(),
        "hidden_states": s.hidden_states.contiguous(),
    }
    if s.hidden_scale is not None:
        tensors[SCALE] = s.hidden_scale.to(torch.float32).contiguous()
    return encode_parts(tensors, {"sample_id": s.id, "run": run})


def write_sample(spool_dir: str, s: SpooledSample, run: str) -> int:
    """Write the sample's spool file atomically, streaming its tensors (no joined copy)."""
    parts = _parts(s, run)
    atomic_write_local(spool_path(spool_dir, s.id), parts)
    return sum(len(p) for p in parts)


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
