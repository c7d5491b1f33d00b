"""The per-sample ledger in Redis: a fast cache of what storage says is done.

States are one letter: `q` queued (a job holds it), `s` spooled (hidden states on a node's
spool, not yet in a committed shard), `d` done (in a committed shard), `f` failed (with a
reason). A spooled sample's value also names the spool that owns it and the ref to its row
(`s:<spool>@<job>#<index>`, harvest/state/lua/lib/state_value.lua), so its state, owner and row
are one field (`state_letter` reads the letter, `spooled_parts` the rest). Every move goes through
one Lua script (harvest/state/lua/lib/move.lua, through harvest.state.scripts) that checks the
allowed source states and keeps the per-state counters exact, and the per-reason failure counters
too, so status, metrics and completion checks never scan the hash.

Cost (bench/fleet.py). The control plane's budget is per sample: a worker's job settles all its
samples in one call (`settle_job`: the spooled ones, the failed ones with their rows), a
collector's shard in one (`mark_done`; both harvest/state/lua/settle.lua; their stats go at the
heartbeat, harvest.state.tally), and a job's samples' states are read with one plain HMGET, sent
in RQ's transaction that starts the job (harvest.workers.rqworker; `take` where it is not)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence

import redis

from harvest.state import jobcopy, scripts
from harvest.state.keys import RATE_BUCKET_S, Keys
from harvest.state.roundtrip import Command, ScriptCall, send_together
from harvest.state.scripts import Segment

QUEUED, SPOOLED, DONE, FAILED = "q", "s", "d", "f"
ABSENT = "_"
STATE_NAMES = {QUEUED: "queued", SPOOLED: "spooled", DONE: "done", FAILED: "failed"}

SCRIPT_ARGS = 4000  # ids a script takes at once (Lua's unpack is bounded near 8000 values)


def state_letter(raw: bytes | str | None) -> str | None:
    """A state hash value's state: its first letter (the value's format: lua/lib/state_value.lua)."""
    if raw is None:
        return None
    return (raw.decode() if isinstance(raw, bytes) else raw)[:1]


def spooled_parts(raw: bytes | str | None) -> tuple[str, str | None] | None:
    """(owner, ref or None) of a spooled sample's state value `s:<spool>[@<job>#<i>]`
    (lua/lib/state_value.lua); Python's one parser of it; None for any other value, a bare `s` included (an older harvest's:
    its owner and ref are in the side hashes)."""
    if raw is None:
        return None
    v = raw.decode() if isinstance(raw, bytes) else raw
    if not v.startswith(f"{SPOOLED}:"):
        return None
    owner, at, ref = v[2:].partition("@")
    return owner, (at + ref if at else None)


class Ledger:
    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn = conn
        self.keys = Keys(run)

    def _move(
        self,
        ids: list[str],
        to: str,
        allowed: str,
        infos: list[str] | None = None,
        pipe: redis.client.Pipeline | None = None,
        rows: list[str] | None = None,
        keep: bool = False,
    ) -> list[str]:
        """`ids` to `to` from any of `allowed`: the moved ids (none in `pipe`: known at its EXEC)."""
        if not ids:
            return []
        call = scripts.transition(self.keys, to, allowed, ids, infos or [], rows or [], keep)
        if pipe is not None:
            call.queue(pipe)
            return []
        return [r.decode() if isinstance(r, bytes) else r for r in call.run(self.conn)]

    def states(self, ids: list[str]) -> list[str | None]:
        return [state_letter(v) for v in self.conn.hmget(self.keys.state, ids)] if ids else []

    def take(self, ids: list[str], also: Sequence[ScriptCall] = ()) -> list[str | None]:
        """A job's samples' states as the worker starts it, with `also` (the heartbeat's job line,
        which names the job's attempt: harvest.workers.job) in the same round trip (harvest.state.roundtrip).
        A plain HMGET: the attempt (each rid's tail) is the worker's own random number, not a counter
        kept a sample (harvest.ids.new_attempt), so the take decides nothing and writes nothing."""
        if not ids:
            if also:
                send_together(self.conn, list(also))
            return []
        states: list[str | None] = []
        for i in range(0, len(ids), SCRIPT_ARGS):
            read = Command(("HMGET", self.keys.state, *ids[i : i + SCRIPT_ARGS]))
            states += [state_letter(v) for v in send_together(self.conn, [read, *(also if i == 0 else ())])[0]]
        return states

    def states_and_owners(self, ids: list[str]) -> tuple[list[str | None], list[str | None]]:
        """The states and spool owners of `ids` (the collector's view of its spool files). Plain
        HMGETs: the record's ownership test and the commit fence decide (lua/fence.lua, lua/put_record.lua), and Lua's
        handling of each argument and reply cost the server twice the read (bench/job_cost.py). A
        bare `s` (an older harvest's) has its owner read after: one that left s meanwhile reads as
        ownerless, and the ownership test refuses it."""
        with self.conn.pipeline(transaction=False) as pipe:
            for i in range(0, len(ids), SCRIPT_ARGS):
                pipe.hmget(self.keys.state, ids[i : i + SCRIPT_ARGS])
            raw = [v for part in pipe.execute() for v in part]
        states, parts = [state_letter(v) for v in raw], [spooled_parts(v) for v in raw]
        owners = [p[0] or None if p else None for p in parts]
        if bare := [i for i, (st, p) in enumerate(zip(states, parts, strict=False)) if st == SPOOLED and p is None]:
            for i, o in zip(bare, self.conn.hmget(self.keys.spool_owner, [ids[i] for i in bare]), strict=False):
                owners[i] = o.decode() if o else None
        return states, owners

    def settle_job(
        self,
        spooled: list[str],
        owner: str,
        rows: Mapping[str, str],
        failures: Mapping[str, tuple[str, str]],
        refs: Mapping[str, str] | None = None,
        also: Sequence[ScriptCall] = (),
    ) -> tuple[list[str], list[str]]:
        """A worker's job, written in one call: `spooled` q or absent -> s, owned by `owner` with
        their payload rows kept (as `mark_spooled`); `failures` (id -> (reason, message)) q or
        absent -> f with their rows kept as failed payloads (as `record_failures`, for samples this
        job holds: a rollback may have forgotten its enqueue), counted in the run's stats as
        `samples_failed`. Returns (ids marked spooled, ids marked failed). The job's throughput
        stats and latencies go at the worker's heartbeat instead (harvest.state.tally).

        `refs` (id -> `jobcopy.ref`, for the job being run): a spooled sample keeps its ref, and the
        job's hash is copied once, instead of its row (harvest.state.jobcopy); refs into one job go
        as their indexes (lua/lib/hot_moves.lua `spool_job`). Where Redis no longer has the job (a rollback
        forgot its enqueue), the call is made again with the rows.

        `also`: calls sent in the same round trip (harvest.state.roundtrip); they ran when this
        returns or raises a Redis error reply (not a connection error)."""
        fail_ids = list(failures)
        infos = [json.dumps({"reason": r, "message": m}) for r, m in failures.values()]

        def segments(kept: Mapping[str, str]) -> list[Segment]:
            job, spool_rows = jobcopy.one_job(r := [kept.get(i) or rows.get(i, "") for i in spooled]) or ("", r)
            return [
                Segment("s", QUEUED + ABSENT, False, "", "", job, list(spooled), [owner] * len(spooled), spool_rows),
                Segment(
                    "f",
                    QUEUED + ABSENT,
                    True,
                    "samples_failed",
                    "",
                    "",
                    fail_ids,
                    infos,
                    [rows.get(i, "") for i in fail_ids],
                ),
            ]

        try:
            out = self._settle(segments(refs or {}), {}, also=also)
        except redis.ResponseError as e:
            if not refs or not str(e).startswith(jobcopy.NO_JOB):
                raise
            out = self._settle(segments({}), {})
        return out[0], out[1]

    def _settle(
        self,
        segments: list[Segment],
        stats: dict[str, int],
        clear: tuple[str, str] | None = None,
        also: Sequence[ScriptCall] = (),
    ) -> list[list[str]]:
        res = send_together(self.conn, [scripts.settle(self.keys, segments, stats, clear), *also])[0]
        return [
            list(seg.ids) if isinstance(got, int) else [r.decode() if isinstance(r, bytes) else r for r in got]
            for seg, got in zip(segments, res, strict=False)
        ]  # a count: every id moved

    def add_queued(self, ids: list[str], pipe: redis.client.Pipeline | None = None) -> list[str]:
        """New samples only: an id with any state is left as it is (idempotent enqueue). Its own
        script (lua/add_queued.lua), not `_move`. Returns the ids moved, in order (none in `pipe`)."""
        if not ids:
            return []
        call = scripts.add_queued(self.keys, ids)
        if pipe is not None:
            call.queue(pipe)
            return []
        left = {r.decode() if isinstance(r, bytes) else r for r in call.run(self.conn)}
        return list(dict.fromkeys(i for i in ids if i not in left))

    def requeue(self, ids: list[str], pipe: redis.client.Pipeline | None = None) -> list[str]:
        return self._move(ids, QUEUED, FAILED, pipe=pipe)

    def mark_spooled(self, ids: list[str], owner: str = "", rows: list[str] | None = None) -> list[str]:
        """q -> s, recording which spool dir (harvest.node.spooldir.spool_identity) holds the copy and
        keeping each sample's payload row (`rows`), so a lost spool's samples can be enqueued again
        (harvest.ops.reclaim). Only the first worker to spool a sample owns it, and only its
        collector packs it: a job retried after its worker died between its spool file and this
        call may spool the sample on another node. A revoked spool owns nothing. An absent sample is
        spooled too: a Redis that lost its last second can forget the enqueue of a job a worker had
        dequeued, and the worker holds its row and spool file. A sample forgotten after it was done
        is `d` again first (the worker reconciles), and the claims in storage keep a second copy out."""
        return self._move(ids, SPOOLED, QUEUED + ABSENT, [owner] * len(ids), rows=rows)

    def reclaim(self, spool: str, ids: list[str], pipe: redis.client.Pipeline | None = None) -> list[str]:
        """s -> q for those of `ids` that `spool` still owns (the janitor, after revoking it)."""
        if not ids:
            return []
        call = scripts.reclaim(self.keys, spool, ids)
        if pipe is not None:
            call.queue(pipe)
            return []
        res = call.run(self.conn)
        return [r.decode() if isinstance(r, bytes) else r for r in res]

    def fence_commit(self, spool: str, ids: list[str], record_key: str, record: str, before: str) -> bool:
        """Write a shard's packing `record` (holding its index document) only if `spool` is not
        revoked, owns every one of `ids` in state s, and the record at `record_key` is still
        `before` (what the collector wrote before packing): after this, the shard's commit is
        decided and anyone holding the record may finish it."""
        return bool(scripts.fence(self.keys, spool, ids, record_key, record, before).run(self.conn))

    def identity(self) -> str:
        """This ledger's random id (`Keys.ledger_id`), taken on first use. A collector's packing
        record gives it back to a Redis that lost it (a rollback, a wipe: harvest.state.packing
        `put_owned`), so its claims in storage stay this ledger's. SET NX GET (Redis >= 7.0)."""
        new = os.urandom(8).hex()
        try:
            old = self.conn.set(self.keys.ledger_id, new, nx=True, get=True)
        except redis.ResponseError:  # Redis < 7.0: NX and GET together are refused
            self.conn.set(self.keys.ledger_id, new, nx=True)
            old = self.conn.get(self.keys.ledger_id)
        return old.decode() if old is not None else new

    def requeue_done(self, ids: list[str], pipe: redis.client.Pipeline | None = None) -> list[str]:
        """d -> q for samples no index in storage names, with the new jobs enqueued in `pipe`
        (harvest.ops.reconcile rebuilds them from the shard that still holds their tokens)."""
        return self._move(ids, QUEUED, DONE, pipe=pipe)

    def forget_done(self, ids: list[str], state: str = DONE) -> list[str]:
        """d -> absent for samples no index names and whose tokens are nowhere in storage (the producer
        enqueues them again: it skips only samples the ledger knows); `state` q: queued samples dropped."""
        if not ids:
            return []
        res = scripts.forget(self.keys, state, ids).run(self.conn)
        return [r.decode() if isinstance(r, bytes) else r for r in res]

    def spooled_payloads(self, ids: list[str]) -> list[str | None]:
        """The payload rows kept for spooled `ids` (a ref in the state value, or a row in the
        spooled_payload hash), refs resolved (harvest.state.jobcopy); None where no row is kept or
        its ref leads nowhere."""
        if not ids:
            return []
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hmget(self.keys.state, ids)
            pipe.hmget(self.keys.spooled_payload, ids)
            values, rows = pipe.execute()
        kept = {
            i: (spooled_parts(v) or ("", None))[1] or (r.decode() if r is not None else None)
            for i, v, r in zip(ids, values, rows, strict=False)
        }
        rows = jobcopy.resolve(self.conn, self.keys, kept)
        return [rows[i] for i in ids]

    def owned_by(self, spool: str, tick: Callable[[], None] = lambda: None) -> list[str]:
        """The samples `spool` owns: O(samples), a pass over the state hash (and the spool_owner hash,
        for owners an older harvest kept there), for the rare paths that need them all (a reclaim).
        `tick` is called every 100k samples (a heartbeat kept up, harvest.state.heartbeat)."""
        owned = []
        for i, (k, v) in enumerate(self.conn.hscan_iter(self.keys.state, count=10_000)):
            parts = spooled_parts(v)
            if parts is not None and parts[0] == spool:
                owned.append(k.decode())
            if i % 100_000 == 0:
                tick()
        bare = [k.decode() for k, v in self.conn.hscan_iter(self.keys.spool_owner, count=1000) if v.decode() == spool]
        if bare:
            owned += [
                sid
                for sid, st in zip(bare, self.conn.hmget(self.keys.state, bare), strict=False)
                if st == SPOOLED.encode()
            ]
        return owned

    def spool_owners(self, ids: list[str]) -> list[str | None]:
        """The spool that owns each of `ids` (None where not spooled, or spooled without an owner)."""
        return self.states_and_owners(ids)[1]

    def mark_failed(
        self, failures: Mapping[str, tuple[str, str]], forgotten: bool = False, rows: Mapping[str, str] | None = None
    ) -> list[str]:
        """q or s -> f. `forgotten`: also absent -> f, for a worker that holds the samples' rows
        (kept first, harvest.state.failures) while a rollback made the ledger forget them, as in
        `mark_spooled`; without it they would be nowhere, and `requeue` could not find them.
        `rows`: payload rows kept as failed payloads in the same call (`keep_failed_payloads`)."""
        ids = list(failures)
        infos = [json.dumps({"reason": r, "message": m}) for r, m in failures.values()]
        return self._move(
            ids,
            FAILED,
            QUEUED + SPOOLED + (ABSENT if forgotten else ""),
            infos,
            rows=[(rows or {}).get(i, "") for i in ids] if rows else None,
            keep=bool(rows),
        )

    def mark_done(
        self,
        ids: list[str],
        pipe: redis.client.Pipeline | None = None,
        tokens: list[int] | None = None,
        stats: Mapping[str, int] | None = None,
        clear: tuple[str, str] | None = None,
        counted: bool = True,
    ) -> list[str]:
        """Only the collector (after its index file is written) and reconcile call this. Samples
        that changed state count in the `samples_done` stat, with `tokens` (per id, sent as one
        argument) in `tokens_done`, and `stats` are added, in the same call; not with `counted=False`
        (the collector's tally counts them) or in `pipe` (a caller's transaction: the move alone).
        `clear`: (a key, a set) deleted and removed from in the same call (the packing record of
        the shard this commit ends, harvest.state.packing.PackingRecords.ended)."""
        if pipe is not None:
            return self._move(ids, DONE, ABSENT + QUEUED + SPOOLED + FAILED, pipe=pipe)
        if not ids and not stats:
            return []
        if not counted and (tokens is not None or stats):
            raise ValueError("mark_done(counted=False) takes no tokens or stats")
        counts = [int(t) for t in tokens or []]  # one info for all: lua/settle.lua's sum
        infos = [f"{sum(counts)}/{','.join(map(str, counts))}"] if tokens is not None else []
        seg = Segment(
            DONE,
            ABSENT + QUEUED + SPOOLED + FAILED,
            False,
            "samples_done" if counted else "",
            "tokens_done" if tokens is not None else "",
            "",
            list(ids),
            infos,
            [""] * len(ids),
        )
        return self._settle([seg], dict(stats or {}), clear=clear)[0]

    def counts(self) -> dict[str, int]:
        raw = self.conn.hgetall(self.keys.counts)
        c = {name: 0 for name in STATE_NAMES.values()}
        for k, v in raw.items():
            name = STATE_NAMES.get(k.decode())
            if name:
                c[name] = int(v)
        c["total"] = sum(c[n] for n in STATE_NAMES.values())
        return c

    def failures(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.conn.hgetall(self.keys.failed).items()}

    def failure_counts(self) -> tuple[dict[str, int], dict[str, str]]:
        """(reason -> samples failed with it, reason -> `<sample>: <message>` of its latest), from
        the counters the scripts keep: O(reasons), read in one transaction with the `f` count.
        Where the counters do not add up to it (a ledger written by an older harvest, or repaired
        by hand), one pass over the failures instead: right, at O(failures)."""
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys.failed_reasons)
            pipe.hgetall(self.keys.failed_examples)
            pipe.hget(self.keys.counts, FAILED)
            raw, ex, f = pipe.execute()
        counts = {k.decode(): int(v) for k, v in raw.items() if int(v) > 0}
        if sum(counts.values()) == int(f or 0):
            return counts, {k.decode(): v.decode() for k, v in ex.items()}
        counts, examples = {}, {}
        for sid, info_raw in self.conn.hscan_iter(self.keys.failed, count=1000):
            info = json.loads(info_raw)
            r = info.get("reason", "?")
            counts[r] = counts.get(r, 0) + 1
            examples.setdefault(r, f"{sid.decode()}: {info.get('message', '')}")
        return counts, examples

    def add_stats(self, **incr: int) -> None:
        """Add to the run's totals and to the current RATE_BUCKET_S bucket (throughput over the
        last minute). The bucket is Redis's (its TIME, read by the script, as `_settle`'s): a node
        whose clock is off would write its throughput where `rates` never reads, or into the
        minute status reads later, and every rate and ETA would be wrong."""
        if incr:
            scripts.add_stats(self.keys, incr).run(self.conn)

    def rates(self, window_s: int = 60, now: float | None = None) -> tuple[dict[str, int], float]:
        """Sums of the stats added in the buckets overlapping the last `window_s` seconds, and the
        seconds those buckets cover up to now (so sums / seconds is a rate that counts every event
        once). `now`: Redis's TIME, which stamps the buckets (read here if not given)."""
        if now is None:
            sec, usec = self.conn.time()
            now = sec + usec / 1e6
        cur = int(now) // RATE_BUCKET_S
        n = max(1, window_s // RATE_BUCKET_S)
        first = cur - n + 1
        pipe = self.conn.pipeline(transaction=False)
        for b in range(first, cur + 1):
            pipe.hgetall(self.keys.rate(b))
        sums: dict[str, int] = {}
        for h in pipe.execute():
            for k, v in h.items():
                sums[k.decode()] = sums.get(k.decode(), 0) + int(v)
        return sums, now - first * RATE_BUCKET_S

    def keep_failed_payloads(self, rows: Mapping[str, str]) -> None:
        """Keep the payload rows (JSON) of samples about to be marked failed, so `harvest requeue` can
        enqueue them again without the dataset. Written before the state moves to `f`."""
        if rows:
            self.conn.hset(self.keys.failed_payload, mapping=dict(rows))

    def failed_payloads(self, ids: list[str]) -> list[str | None]:
        if not ids:
            return []
        return [v.decode() if v is not None else None for v in self.conn.hmget(self.keys.failed_payload, ids)]

    def stats(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.conn.hgetall(self.keys.stats).items()}
