"""A spooled sample's payload row kept by reference: one copy of its job a job, not a row a sample.

Why. While a sample is spooled, Redis keeps its payload row, so a lost node's samples can be
enqueued again (harvest.ops.reclaim). Sent as rows, a job's tokens crossed Redis a second time in
full (into the worker's settle call, its Lua arguments, the hash and the AOF): a large share of
Redis's CPU and of the bytes clients send it (bench/fleet.py measures both). The job's
tokens are already in Redis, in the RQ job hash the worker is running, zlib-compressed. So the
worker's settle call (harvest/state/lua/settle.lua) copies that hash server-side (COPY: no
bytes over the network, a few in the AOF) to `Keys.job_copy` and keeps, for each spooled sample,
the ref `@<job id>#<index in the payload>` instead of its row, in the sample's state value
(harvest/state/lua/lib/state_value.lua). A producer's job holds no tokens, only where its rows
are in storage (harvest.formats.jobrows): its copy is a few hundred bytes, and a ref is read
through it from there.

Who owns the copy, and for how long. The ledger's scripts: the copy holds a counter
(`REFS_FIELD`) of the refs to it in the state values (and in the spooled-payload hash, where an
older harvest kept them). A move to `s` adds the refs it
writes; every move out of `s` (done, failed, reclaimed) and every repair that drops a ref takes
them away, and the last one deletes the copy. RQ deletes its own job hash when the job ends; the
copy does not depend on it after the settle call. A Redis that forgets its last second forgets a
settle call with its copy and refs together (one script, one AOF entry).

What fences a missing job. A Redis that lost the job's enqueue (a rollback) has no job hash to
copy; the settle call then refuses before it writes anything (`NO_JOB`) and the worker sends the
rows in full instead (harvest.state.ledger.Ledger.settle_job).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence

import redis

from harvest.ids import check_id
from harvest.state.jobs import SERIALIZER
from harvest.state.keys import Keys
from harvest.state.payload import inline

REFS_FIELD = "harvest_refs"
NO_JOB = "HARVEST_NO_JOB"  # the error a settle call answers when the job to copy is gone


def ref(job_id: str, index: int) -> str:
    """The row kept for the `index`th sample of job `job_id`'s payload."""
    return f"@{check_id(job_id, 'job id')}#{int(index)}"


def parse_ref(row: str) -> tuple[str, int] | None:
    """(job id, index) of a ref, None for a row kept in full."""
    if not row.startswith("@"):
        return None
    job_id, sep, index = row[1:].partition("#")
    if not sep or not index.isdigit():
        raise ValueError(f"malformed payload ref {row!r}")
    return check_id(job_id, "job id"), int(index)


def one_job(refs: Sequence[str]) -> tuple[str, list[str]] | None:
    """(job id, the indexes) where every one of `refs` is a ref into one job, as a worker's settle
    sends them (lib/hot_moves.lua `spool_job`); None otherwise: rows kept in full, refs into
    several jobs, or a malformed one go as they are."""
    try:
        parsed = [parse_ref(r) for r in refs]
    except ValueError:  # InvalidId too
        return None
    jobs = {p[0] if p else None for p in parsed}
    if len(jobs) != 1 or None in jobs:
        return None
    return jobs.pop(), [str(p[1]) for p in parsed if p]


def resolve(conn: redis.Redis, keys: Keys, rows: Mapping[str, str | None]) -> dict[str, str | None]:
    """`rows` (sample id -> kept row) with every ref replaced by the row it names, read from the
    job's copy; None where the row is missing, or the ref names a copy that is gone or a row of
    another sample (a copy no ledger script wrote)."""
    out: dict[str, str | None] = {}
    wanted: dict[str, list[tuple[str, int]]] = {}
    for sid, row in rows.items():
        try:
            r = parse_ref(row) if row is not None else None
        except ValueError:
            out[sid] = None
            continue
        if r is None:
            out[sid] = row
        else:
            wanted.setdefault(r[0], []).append((sid, r[1]))
    jobs = list(wanted)
    pipe = conn.pipeline(transaction=False)
    for j in jobs:
        pipe.hget(keys.job_copy(j), "data")
    for j, data in zip(jobs, pipe.execute(), strict=False):
        samples = _payload_rows(data)
        for sid, i in wanted[j]:
            row = samples[i] if samples is not None and i < len(samples) else None
            out[sid] = json.dumps(row) if isinstance(row, dict) and row.get("id") == sid else None
    return out


def _payload_rows(data: bytes | None) -> list | None:
    """The payload rows in an RQ job hash's `data` (harvest.state.jobs: zlib of the JSON of
    (function, instance, args, kwargs), the payload the first arg; a producer's job names its rows
    in storage, harvest.formats.jobrows), None if unreadable. StorageError: the store failed."""
    if data is None:
        return None
    try:
        data = zlib.decompress(data)
    except zlib.error:  # as RQ's restore: data it did not compress
        pass
    try:
        _, _, args, _ = SERIALIZER.loads(data)
        rows = inline(args[0])["samples"]  # a producer's job names its rows in storage; a store that fails raises
    except (ValueError, TypeError, KeyError, IndexError):  # PayloadError too: rows gone or changed
        return None
    return rows if isinstance(rows, list) else None
