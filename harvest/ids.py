"""Identifiers, content-derived or random, and the one place that decides which ids may touch a path.

Ids that cross a process boundary are derived from content where a rerun or a retried job must
name the same thing (sample, job), and drawn at random where each attempt must own its own (a
rid's attempt, a collector's shard); every one is checked against a strict alphabet before it
is joined onto a directory: whoever can write to Redis must not reach `../`.
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


def shard_id_for(sample_ids: Iterable[str]) -> str:
    """The digest of a shard's ordered samples: the default name of a layout (`plan_shard`), for tools
    and tests that write shards with no ledger. A collector never commits under it: it names each
    shard it records with `new_shard_id`."""
    return _digest_of(sample_ids)


def new_shard_id() -> str:
    """A fresh name for one packing attempt of a collector: 128 random bits, 32 hex digits (the shape
    of every shard id). Unique to the packing record that first names it, so only that record's owner
    (or whoever tends the record once its spool is revoked) ever writes, aborts or deletes the shard
    object, its uploads and the claims naming it; two collectors re-packing one set (a node frozen
    past its spool grace and another that took its samples over) or two ledgers meeting one output
    never share a name. Random rather than derived from the samples: a derived name is shared by
    every attempt at the same set, and each attempt must own its own."""
    return secrets.token_hex(16)


def new_attempt() -> int:
    """A job execution's attempt number: random (63 bits), drawn by the worker as it starts the
    job's execution (harvest.workers.rqworker), or as it takes the job (harvest.workers.job). Every rid of the attempt ends with it (`rid_for`), so files of an earlier
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
