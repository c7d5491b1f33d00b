"""Harvest's Lua scripts (the files under harvest/state/lua/) and one typed wrapper per script.

A script file opens with a comment that names each of its `KEYS` and `ARGV` (`-- KEYS[1] = ...`,
and for a variable tail `-- ARGV[4+] = ...`), as RQ's scripts do; `Lua` reads that header and
refuses a call whose counts do not match it. Pieces several scripts share are functions in
harvest/state/lua/lib/, taking their inputs as arguments; a script names each one it uses with a
`--! include lib/<name>.lua` line, replaced by the file's text (each file once, its own includes
first). The wrappers below are the only code that builds a script's KEYS and ARGV, and every key
and key prefix they pass comes from harvest.state.keys.

Each wrapper returns a `ScriptCall` (harvest.state.roundtrip): `run(conn)` sends it alone,
`queue(pipe)` puts it in a caller's MULTI/EXEC as EVAL with its text, `send_together` sends it
with others in one round trip.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from redis.commands.core import Script

from harvest.state.keys import RATE_BUCKET_S, RATE_TTL_S, Keys, rq_job_prefix
from harvest.state.roundtrip import ScriptCall

LUA_DIR = Path(__file__).with_name("lua")
_INCLUDE = re.compile(r"^--! include (\S+)[ \t]*$", re.M)
_COMMENT_LINE = re.compile(r"^[ \t]*--(?!\[\[).*\n|^[ \t]*\n", re.M)  # not sent: a transaction's EVAL carries the text
_HEADER = re.compile(r"^-- (KEYS|ARGV)\[(\d+)(\+?)\] = ", re.M)


def source(name: str, _done: set[str] | None = None) -> str:
    """The text of `name` (a path under LUA_DIR) as Redis gets it: its includes resolved (each
    included file's text, its own includes first, in place of its `--! include` line, each file
    once), and its lines that are comments or blank left out."""
    done = set() if _done is None else _done
    done.add(name)
    text = (LUA_DIR / name).read_text()

    def include(m: re.Match[str]) -> str:
        lib = m.group(1)
        if lib in done:
            return ""
        return source(lib, done)

    return _COMMENT_LINE.sub("", _INCLUDE.sub(include, text))


@dataclass(frozen=True)
class Arity:
    """How many KEYS or ARGV a script takes, from its header: `least`, and more where `more`."""

    least: int
    more: bool

    def fits(self, n: int) -> bool:
        return n >= self.least if self.more else n == self.least


def header(text: str) -> tuple[Arity, Arity]:
    """The (KEYS, ARGV) counts a script file's opening comment (`text`, includes unresolved)
    names. Each is numbered from 1 without a gap; an entry `[i+]` (the last) says that i-1 or
    more are taken."""
    found: dict[str, list[tuple[int, bool]]] = {"KEYS": [], "ARGV": []}
    for m in _HEADER.finditer(text):
        found[m.group(1)].append((int(m.group(2)), m.group(3) == "+"))
    out = []
    for what, entries in found.items():
        if [i for i, _ in entries] != list(range(1, len(entries) + 1)) or any(more for _, more in entries[:-1]):
            raise ValueError(f"{what} of the header are not numbered 1, 2, ... with only the last one open: {entries}")
        more = bool(entries) and entries[-1][1]
        out.append(Arity(len(entries) - 1 if more else len(entries), more))
    return out[0], out[1]


class Lua:
    """One script file, read at import: its text and its header's counts."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.text = source(f"{name}.lua")
        self.keys, self.args = header((LUA_DIR / f"{name}.lua").read_text())
        self.script = Script(None, self.text.encode())  # type: ignore[arg-type]  # bytes: no client's encoder needed

    def call(self, keys: list[str], args: list[Any]) -> ScriptCall:
        if not (self.keys.fits(len(keys)) and self.args.fits(len(args))):
            raise ValueError(
                f"{self.name}.lua takes {self.keys} KEYS and {self.args} ARGV, not {len(keys)} and {len(args)}"
            )
        return ScriptCall(self.script, keys, args)


TRANSITION, ADD_QUEUED, FORGET, SETTLE = Lua("transition"), Lua("add_queued"), Lua("forget"), Lua("settle")
STATS, RECLAIM, FENCE, PUT_RECORD = Lua("stats"), Lua("reclaim"), Lua("fence"), Lua("put_record")
FORGET_RECORD_IF_GONE, DELETE_RECORD_IF_SAME = Lua("forget_record_if_gone"), Lua("delete_record_if_same")
RENEW_SPOOL, HEARTBEAT, JOB_ENDED = Lua("renew_spool"), Lua("heartbeat"), Lua("job_ended")
CHECK_LEDGER, RELEASE_LOCK, HOLD_REAPING, PUT_BACK = (
    Lua("check_ledger"),
    Lua("release_lock"),
    Lua("hold_reaping"),
    Lua("put_back"),
)
ALL = (
    TRANSITION,
    ADD_QUEUED,
    FORGET,
    SETTLE,
    STATS,
    RECLAIM,
    FENCE,
    PUT_RECORD,
    FORGET_RECORD_IF_GONE,
    DELETE_RECORD_IF_SAME,
    RENEW_SPOOL,
    HEARTBEAT,
    JOB_ENDED,
    CHECK_LEDGER,
    RELEASE_LOCK,
    HOLD_REAPING,
    PUT_BACK,
)


def move_keys(k: Keys) -> list[str]:
    """The 10 keys of a move (lib/move.lua `move_keys`), in their order."""
    return [
        k.state,
        k.counts,
        k.failed,
        k.spool_owner,
        k.spooled_payload,
        k.spool_counts,
        k.revoked_spools,
        k.failed_reasons,
        k.failed_examples,
        k.failed_payload,
    ]


def shaped(values: Sequence[str]) -> list[str]:
    """A move's infos or rows as `move` takes them: none if all are empty, one if all are the same
    (a job's owner), else one a sample: each argument costs the server."""
    if not values or all(v == values[0] for v in values):
        return [] if not values or values[0] == "" else [values[0]]
    return list(values)


def transition(
    k: Keys,
    to: str,
    allowed: str,
    ids: Sequence[str],
    infos: Sequence[str] = (),
    rows: Sequence[str] = (),
    keep: bool = False,
) -> ScriptCall:
    """`ids` to state `to` from any of `allowed`, with their infos and rows (lib/move.lua `move`)."""
    infos, rows = shaped(infos), shaped(rows)
    return TRANSITION.call(
        move_keys(k),
        [
            k.job_copy_prefix,
            rq_job_prefix(),
            to,
            allowed,
            "1" if keep else "0",
            len(ids),
            len(infos),
            len(rows),
            *ids,
            *infos,
            *rows,
        ],
    )


def add_queued(k: Keys, ids: Sequence[str]) -> ScriptCall:
    """absent -> q for `ids`; replies with the ids that did not move."""
    return ADD_QUEUED.call([k.state, k.counts], list(ids))


def forget(k: Keys, state: str, ids: Sequence[str]) -> ScriptCall:
    """`ids` in state `state` forgotten; replies with those forgotten."""
    return FORGET.call([k.state, k.counts], [state, *ids])


class Segment(NamedTuple):
    """One move of a settle call."""

    to: str
    allowed: str
    keep: bool
    count: str  # the stats field counting the moved samples ('' none)
    total: str  # the stats field summing their numbers, given in the one info ('' none)
    job: str  # a worker job's spool: the rows are indexes into this job ('' none)
    ids: list[str]
    infos: list[str]
    rows: list[str]


def settle(
    k: Keys, segments: Sequence[Segment], stats: Mapping[str, int], clear: tuple[str, str] | None = None
) -> ScriptCall:
    """Several moves and the run's stats in one call; `clear`: (a record, the set indexing it),
    both removed in the same call."""
    args: list[Any] = [k.job_copy_prefix, rq_job_prefix(), RATE_TTL_S, k.rate_prefix, RATE_BUCKET_S, len(segments)]
    for to, allowed, keep, count, total, job, ids, infos, rows in segments:
        infos, rows = shaped(infos), rows if job else shaped(rows)
        args += [
            to,
            allowed,
            "1" if keep else "0",
            count,
            total,
            job,
            len(ids),
            len(infos),
            len(rows),
            *ids,
            *infos,
            *rows,
        ]
    args += [len(stats), *(x for kv in stats.items() for x in (kv[0], int(kv[1])))]
    return SETTLE.call([*move_keys(k), k.stats, *(clear or ())], args)


@dataclass
class Histogram:
    """A histogram's observations to add: bucket -> count, their count and sum."""

    buckets: Mapping[str, int]
    count: int
    sum: float


def add_stats(k: Keys, stats: Mapping[str, int], histograms: Mapping[str, Histogram] | None = None) -> ScriptCall:
    """Add `stats` to the run's totals and the current rate bucket, and `histograms` (name ->
    observations) to the run's histograms."""
    keys, args = [k.stats], [RATE_TTL_S, k.rate_prefix, RATE_BUCKET_S, len(stats)]
    for field, v in stats.items():
        args += [field, int(v)]
    for name, h in (histograms or {}).items():
        keys.append(k.histogram(name))
        args.append(len(h.buckets))
        for kv in h.buckets.items():
            args += kv
        args += [h.count, repr(h.sum)]
    return STATS.call(keys, args)


def reclaim(k: Keys, spool: str, ids: Sequence[str]) -> ScriptCall:
    """s -> q for those of `ids` that `spool` still owns; replies with the ids moved."""
    return RECLAIM.call(
        [k.state, k.counts, k.spool_owner, k.spooled_payload, k.spool_counts], [k.job_copy_prefix, spool, *ids]
    )


def fence(k: Keys, spool: str, ids: Sequence[str], record_key: str, record: str, before: str) -> ScriptCall:
    """The commit fence: `record` written at `record_key` only while `spool` owns `ids` and the
    record there is still `before`; replies 1 where written."""
    return FENCE.call([k.state, k.spool_owner, k.revoked_spools, record_key], [spool, record, before, *ids])


def put_record(k: Keys, record_key: str, record: str, spool: str, ids: Sequence[str], ledger_id: str) -> ScriptCall:
    """A packing record written and indexed, whether `spool` owns `ids`, and the ledger's id in
    force; replies {owned, id}."""
    return PUT_RECORD.call(
        [k.state, k.spool_owner, k.revoked_spools, record_key, k.packing_index, k.ledger_id],
        [record, spool, ledger_id, *ids],
    )


def forget_record_if_gone(k: Keys, record_key: str) -> ScriptCall:
    return FORGET_RECORD_IF_GONE.call([record_key, k.packing_index], [])


def delete_record_if_same(k: Keys, record_key: str, raw: bytes | str) -> ScriptCall:
    return DELETE_RECORD_IF_SAME.call([record_key, k.packing_index], [raw])


def renew_spool(k: Keys, spool: str, node: str) -> ScriptCall:
    """`spool`'s lease renewed by `node`; replies 0 where the spool is revoked."""
    return RENEW_SPOOL.call([k.spool_leases, k.spool_nodes, k.revoked_spools], [spool, node])


def heartbeat(
    key: str, ttl: int, stamp: str, fields: Mapping[str, str], join: tuple[str, str] | None = None
) -> ScriptCall:
    """A heartbeat hash's `fields`, the fields named in `stamp` (space-separated) stamped with
    Redis's TIME, its TTL; `join`: (a set, the member to add to it)."""
    keys = [key] if join is None else [key, join[0]]
    member = "" if join is None else join[1]
    return HEARTBEAT.call(keys, [ttl, stamp, member, *(x for kv in fields.items() for x in kv)])


def job_ended(key: str, ttl: int, fields: Mapping[str, str]) -> ScriptCall:
    """A worker's job ended: its heartbeat's `fields`, one job more done, its TTL."""
    return JOB_ENDED.call([key], [ttl, *(x for kv in fields.items() for x in kv)])


def check_ledger(k: Keys, repair: bool, why: str, copies: Sequence[str]) -> ScriptCall:
    """The ledger's invariants checked (and with `repair`, rebuilt); `why`: the failure JSON for a
    failed sample without one; `copies`: the job ids of the job copies found."""
    return CHECK_LEDGER.call(
        [k.state, k.counts, k.failed, k.spool_owner, k.spooled_payload, k.spool_counts],
        ["1" if repair else "0", why, k.job_copy_prefix, *copies],
    )


def release_lock(key: str, token: str, hold_ms: int = 0) -> ScriptCall:
    """The lock at `key`, if `token` holds it, released now (`hold_ms` 0) or held `hold_ms` more."""
    return RELEASE_LOCK.call([key], [token, int(hold_ms)])


def hold_reaping(k: Keys, seconds: float) -> ScriptCall:
    """Reaping held for `seconds` from Redis's TIME (never shortened); replies the time it ends."""
    return HOLD_REAPING.call([k.reap_after], [float(seconds)])


def put_back(intermediate_key: str, queue_key: str, job_key: str, job_id: str) -> ScriptCall:
    """A dequeued job back on its queue unless queued already or gone; replies 1 where it was."""
    return PUT_BACK.call([intermediate_key, queue_key, job_key], [job_id])
