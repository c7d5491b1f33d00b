"""Content-derived identifiers and the one place that decides which ids may touch a path.

Every id that crosses a process boundary (sample, rid, job, shard) is derived from content,
so a rerun or a retried job names the same thing, and is checked against a strict alphabet
before it is joined onto a directory: whoever can write to Redis must not reach `../`.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable

import numpy as np

from harvest.errors import InputError

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
RID_PREFIX = "hv-"
_RID_PATTERN = re.compile(r"hv-([0-9a-f]{32})-([0-9]+)")


class InvalidId(InputError, ValueError):
    """An id that does not match `[A-Za-z0-9_-]+` (so it must never become a file name)."""


def check_id(value: str, kind: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value) or len(value) > 200:
        raise InvalidId(f"invalid {kind} {value!r}: must match [A-Za-z0-9_-]+ (at most 200 characters)")
    return value


def safe_id(text: str, fallback: str, limit: int = 64) -> str:
    """`text` made into an id: every character outside `[A-Za-z0-9_-]` becomes `_`, at most
    `limit` characters; `fallback` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:limit] or fallback


def node_name() -> str:
    """This node's name as workers' heartbeats, spools' packing records and `harvest status` show it."""
    import socket

    return safe_id(socket.gethostname(), "node")


def sample_id(input_ids: np.ndarray, loss_mask: np.ndarray, extra: bytes = b"") -> str:
    """blake2b-128 of the int32 LE token ids followed by the loss-mask bytes (and, for a conversation
    to regenerate, its structure: harvest.state.conversation.Conversation.digest)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(input_ids, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    if extra:
        h.update(b"\x00conversation\x00")
        h.update(extra)
    return h.hexdigest()


def _digest_of(ids: Iterable[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for i in ids:
        h.update(check_id(i, "sample id").encode())
        h.update(b"\n")
    return h.hexdigest()


def job_id_for(run: str, sample_ids: Iterable[str]) -> str:
    """Same batch, same job id: a re-enqueue of identical content is recognisable in RQ."""
    return f"hv-{check_id(run, 'run name')}-{_digest_of(sample_ids)}"


def shard_id_for(sample_ids: Iterable[str], ledger: str = "", generation: int = 0) -> str:
    """A shard is named by the ordered samples it holds and the ledger that commits it, so re-packing
    the same set rewrites the same object, while two ledgers on one output (two runners of one
    dataset) never write, abort or remove each other's shard objects under one name.
    `generation`: the same set packed again after a repair excluded some of it from the shard of
    generation 0 (a corrupt copy re-extracted): a new name, as the old one's index stays."""
    ids = list(sample_ids)
    tail = [f"ledger-{check_id(ledger, 'ledger id')}"] if ledger else []
    if generation:
        tail.append(f"generation-{int(generation)}")
    return _digest_of([*ids, *tail])


def new_attempt() -> int:
    """A job execution's attempt number: random (63 bits), drawn by the worker as it starts the
    job's execution (workers.rqworker), or as it takes the job (workers.job). Every rid of the attempt ends with it (`rid_for`), so files of an earlier
    attempt, timed out or of a worker that died, are never mistaken for this one's. Random, not
    counted a sample in Redis: a count cost the fleet's Redis a read and a write a sample at every
    job's start (bench/job_cost.py, "worker: take"), and a Redis that forgot its last second could
    hand the same number out twice; two draws meet with odds of 2^-63. The heartbeat names the
    attempt its worker is running (harvest.state.heartbeat), which is how the janitor knows a dump
    file nobody will claim (harvest.ops.janitor)."""
    return secrets.randbits(63)


def rid_for(sid: str, attempt: int) -> str:
    """Unique per attempt (`new_attempt`), so files of an earlier attempt are never mistaken for this one's."""
    check_id(sid, "sample id")
    return f"{RID_PREFIX}{sid}-{int(attempt)}"


def parse_rid(rid: str) -> tuple[str, int]:
    m = _RID_PATTERN.fullmatch(rid)
    if not m:
        raise InvalidId(f"invalid rid {rid!r}: expected hv-<32 hex>-<attempt>")
    return m.group(1), int(m.group(2))
