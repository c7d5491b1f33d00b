"""The janitor: takes back the jobs of dead workers, releases due retries, and cleans dump dirs.

RQ alone notices a dead SimpleWorker only when its StartedJobRegistry entry expires, which is
`job.timeout + 60` s after the job started (about 11 min for a default harvest job), and then
moves the job to the FailedJobRegistry, leaving its samples queued in the ledger forever. Here a
worker is dead when its harvest heartbeat (harvest.state.heartbeat, 15 s TTL) is gone; its started job
is put back on the queue at once, in one WATCHed transaction with the registry entry's removal,
so two janitors can never enqueue it twice. A job whose worker died `max_reaps` times (a sample
that kills the engine or the worker, say) is not retried forever: its still-queued samples fail
with reason `worker-died`. harvest.ops.liveness holds those rules, and takes back the executions
of live workers that run something else (a Redis rolled back under the fleet) and jobs dequeued
by a worker that died before starting them.

Every worker runs a janitor pass every few seconds (one of them does the run-wide part, under a
short lock); `harvest janitor` runs the same passes for operators. The run-wide part also moves
due transient-error retries (jobs that returned `rq.Retry` with a backoff interval) from RQ's
ScheduledJobRegistry to the queue, which RQ would only do with its separate scheduler process,
reclaims node spools whose lease lapsed (harvest.ops.reclaim), and re-enqueues samples queued in
no job (harvest.ops.stranded).

Clocks: every decision of the run-wide part is taken by Redis's clock (one `TIME` per pass) or
by key TTLs, never by this node's clock, so a node whose clock is off cannot fail or strand
another node's job (harvest.workers.rqworker turns off RQ's own node-clock cleanups). The node-local
part compares file times with this node's clock: both are the node's own. A Redis new to the run
(restarted, rolled back, failed over) holds its live workers without heartbeats until they beat
again: until `Keys.reap_after` (harvest.ops.liveness) no pass takes a worker for dead by that.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.formats.dump import parse_chunk_name
from harvest.ids import ID_PATTERN, RID_PREFIX, parse_rid
from harvest.node.dumpdir import claim_dir_owner, is_temp
from harvest.ops.liveness import MAX_REAPS, reaping_held_now, tend_liveness
from harvest.ops.reclaim import ReclaimReport, reclaim_lost_spools
from harvest.ops.stranded import StrandedReport, tend_stranded
from harvest.state import scripts
from harvest.state.heartbeat import HEARTBEAT_TTL_S
from harvest.state.jobs import MAX_RETRY_INTERVAL_S, fetch_job, run_queue
from harvest.state.keys import Keys, rq_worker_key, worker_key
from harvest.state.ledger import DONE, FAILED, Ledger
from harvest.state.runstore import load_run
from harvest.state.spools import redis_time

log = logging.getLogger("harvest.janitor")

STALE_DUMP_S = 900.0
PROVEN_STALE_S = 2.0  # files the ledger proves unclaimable: only give a rename in flight time to land
# Two reads of the heartbeats this far apart: a heartbeat rolled back has been written again by its
# worker's beat since, or has expired (its worker is dead by the fleet's own rule), however late the beat.
CONFIRM_UNNAMED_S = HEARTBEAT_TTL_S + 1.0
RETRY_SLACK_S = 10  # clocks a few seconds apart are not "absurdly" ahead


@dataclass
class JanitorReport:
    reaped: list[str] = field(default_factory=list)  # job ids put back on the queue
    gave_up: list[str] = field(default_factory=list)  # job ids whose samples failed with worker-died
    suspects: list[str] = field(default_factory=list)  # executions of live workers running other work: taken back
    dequeued: list[str] = field(default_factory=list)  # jobs dequeued by a worker that died before starting them
    promoted: list[str] = field(default_factory=list)  # scheduled retries moved to the queue
    forgotten_workers: list[str] = field(default_factory=list)
    claim_dirs_removed: list[str] = field(default_factory=list)
    stale_dumps_removed: int = 0
    reclaimed: list[ReclaimReport] = field(default_factory=list)  # lost spools whose samples went back to the queue
    stranded: StrandedReport = field(default_factory=StrandedReport)  # samples queued in no job

    def any(self) -> bool:
        return bool(
            self.reaped
            or self.gave_up
            or self.suspects
            or self.dequeued
            or self.promoted
            or self.forgotten_workers
            or self.claim_dirs_removed
            or self.stale_dumps_removed
            or any(r.samples for r in self.reclaimed)
            or self.stranded.requeued
            or self.stranded.lost
        )

    def line(self) -> str:
        """One line for logs and `harvest janitor`."""
        st = self.stranded
        return (
            f"reaped {len(self.reaped)} jobs, gave up {len(self.gave_up)}, released {len(self.promoted)} retries, "
            f"forgot {len(self.forgotten_workers)} dead workers, removed {len(self.claim_dirs_removed)} claim dirs "
            f"and {self.stale_dumps_removed} stale dump files"
            + (
                f"; took back {len(self.suspects)} executions of live workers running other work"
                if self.suspects
                else ""
            )
            + (f"; put back {len(self.dequeued)} jobs dequeued and never started" if self.dequeued else "")
            + "".join(
                f"; reclaimed spool {r.spool} of node {r.node}: {len(r.samples)} samples"
                for r in self.reclaimed
                if r.samples
            )
            + (
                f"; {len(st.requeued)} samples queued in no job back on the queue in {len(st.jobs)} jobs"
                if st.requeued
                else ""
            )
            + (f"; {len(st.lost)} samples queued in no job, tokens kept nowhere: failed" if st.lost else "")
        )


def _acquire(conn: redis.Redis, key: str, ttl_ms: int) -> str | None:
    token = uuid.uuid4().hex
    return token if conn.set(key, token, nx=True, px=ttl_ms) else None


def promote_due_retries(conn: redis.Redis, run: str, now: float | None = None) -> list[str]:
    """Move jobs whose retry backoff has passed (by Redis's clock, `now`) from the
    ScheduledJobRegistry to the queue. A due time further ahead than any backoff harvest uses
    (MAX_RETRY_INTERVAL_S) was written by a node whose clock runs ahead: due too."""
    queue = run_queue(conn, run)
    reg = queue.scheduled_job_registry
    now = redis_time(conn) if now is None else now
    with conn.pipeline(transaction=False) as pipe:
        pipe.zrangebyscore(reg.key, "-inf", now, start=0, num=1000)
        pipe.zrangebyscore(reg.key, f"({now + MAX_RETRY_INTERVAL_S + RETRY_SLACK_S}", "+inf", start=0, num=1000)
        due, absurd = pipe.execute()
    moved = []
    for job_id in dict.fromkeys(j.decode() for j in due + absurd):
        with conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(reg.key)
                if pipe.zscore(reg.key, job_id) is None:
                    continue
                try:
                    job = fetch_job(conn, job_id)
                except NoSuchJobError:
                    pipe.multi()
                    pipe.zrem(reg.key, job_id)
                    pipe.execute()
                    continue
                pipe.multi()
                pipe.zrem(reg.key, job_id)
                queue.enqueue_job(job, pipeline=pipe)
                pipe.execute()
                moved.append(job_id)
            except redis.WatchError:
                continue
    return moved


def prune_registries(conn: redis.Redis, run: str, now: float) -> None:
    """Drop failed and finished registry entries whose time ran out (by Redis's clock, `now`): what
    RQ's maintenance did by the node's clock (harvest.workers.rqworker). Their job hashes expire by TTL."""
    queue = run_queue(conn, run)
    with conn.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(queue.failed_job_registry.key, 0, now)
        pipe.zremrangebyscore(queue.finished_job_registry.key, 0, now)
        pipe.execute()


def forget_dead_workers(conn: redis.Redis, run: str) -> list[str]:
    """Drop dead workers from the run's worker set and from RQ's worker registry (so rq-dashboard
    and `rq info` stop listing them before RQ's own key expires)."""
    from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

    keys = Keys(run)
    names = sorted(n.decode() for n in conn.smembers(keys.workers))
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.exists(worker_key(name))
        alive = pipe.execute()
    gone = []
    for name, live in zip(names, alive, strict=False):
        if live:
            continue
        rq_key = rq_worker_key(name)
        with conn.pipeline(transaction=True) as pipe:
            pipe.srem(keys.workers, name)
            pipe.delete(rq_key)
            pipe.srem(REDIS_WORKER_KEYS, rq_key)
            pipe.srem(WORKERS_BY_QUEUE_KEY % keys.queue_name, rq_key)
            pipe.execute()
        gone.append(name)
    return gone


class UnnamedDumps:
    """The dump files a caller's passes found named by no live worker, and since when: one per
    process and dump dir, kept across its passes. A file counts as unnamed only when two reads at
    least `CONFIRM_UNNAMED_S` apart found it so, with no pass between that read no attempt. A
    heartbeat that Redis rolled back names an earlier attempt until its worker's next beat writes
    the running one again (harvest.state.heartbeat), and a failover behind a proxy that keeps the
    connections may go unnoticed by this process for a while: one read could take a running
    attempt's files for stale, two a heartbeat TTL apart cannot."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since: dict[str, float] = {}

    def confirm(self, unnamed: set[str]) -> set[str]:
        """Of `unnamed` (this read's), those unnamed since at least `CONFIRM_UNNAMED_S`; a file
        named meanwhile starts again."""
        now = self.clock()
        self._since = {n: self._since.get(n, now) for n in unnamed}
        return {n for n, t in self._since.items() if now - t >= CONFIRM_UNNAMED_S}


def clean_dump_dir(
    conn: redis.Redis,
    dump_dir: str,
    stale_dump_s: float = STALE_DUMP_S,
    now: float | None = None,
    run: str | None = None,
    proven_stale_s: float = PROVEN_STALE_S,
    keep_claim_dirs: bool = False,
    unnamed: UnnamedDumps | None = None,
) -> tuple[list[str], int]:
    """Node-local: remove the claim dirs of workers with no heartbeat (any run: the dump dir may be
    shared) and unclaimed dump files older than `stale_dump_s` (a request that timed out, or a
    worker that died before claiming). With `run`, files nobody will claim go after only
    `proven_stale_s`: their sample is done or failed in that run's ledger, or, with `unnamed` (the
    caller's memory of earlier passes), it is in the ledger and no live worker of this node has
    named the file's attempt in two reads a heartbeat TTL apart (the engine finished a request
    after its worker died, gave up or went on to its next job: `_running_attempts`).
    `keep_claim_dirs`: a new Redis holds reaping (harvest.ops.liveness), so a missing heartbeat
    proves nothing yet, neither a dead worker nor an attempt ended. Returns (claim dirs removed,
    dump files removed)."""
    now = time.time() if now is None else now
    dirs, files = [], 0
    try:
        entries = list(os.scandir(dump_dir))
    except FileNotFoundError:
        if unnamed is not None:
            unnamed.confirm(set())
        return dirs, files
    proven = _proven_stale(conn, run, [e.name for e in entries], dump_dir, keep_claim_dirs, unnamed) if run else set()
    for e in entries:
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        name = claim_dir_owner(e.name)
        if name is not None and e.is_dir(follow_symlinks=False):
            # A worker announces itself before it creates its claim dir; the age check covers a
            # Redis that lost its keys (restart without AOF) while the worker lives on, and
            # `keep_claim_dirs` such a Redis until its workers have beaten again.
            if (
                not keep_claim_dirs
                and ID_PATTERN.fullmatch(name)
                and age > HEARTBEAT_TTL_S
                and not conn.exists(worker_key(name))
            ):
                shutil.rmtree(e.path, ignore_errors=True)
                dirs.append(e.name)
        elif (
            e.is_file(follow_symlinks=False)
            and (e.name.startswith(RID_PREFIX) or is_temp(e.name))
            and (age > stale_dump_s or (e.name in proven and age > proven_stale_s))
        ):
            try:
                os.unlink(e.path)
                files += 1
            except FileNotFoundError:
                pass
    return dirs, files


def _proven_stale(
    conn: redis.Redis, run: str, names: list[str], dump_dir: str, held: bool, unnamed: UnnamedDumps | None
) -> set[str]:
    parsed = {}
    for n in names:
        p = parse_chunk_name(n)
        if p is not None:
            parsed[n] = parse_rid(p[0])
    sids = sorted({sid for sid, _ in parsed.values()})
    states = dict(zip(sids, Ledger(conn, run).states(sids), strict=False)) if sids else {}
    out = {n for n, (sid, _) in parsed.items() if states[sid] in (DONE, FAILED)}
    running = None if held or unnamed is None or not parsed else _running_attempts(conn, dump_dir)
    if unnamed is not None:  # a pass that reads no attempt (reaping held, a heartbeat naming none) forgets
        out |= unnamed.confirm(
            set()
            if running is None
            else {n for n, (sid, attempt) in parsed.items() if states[sid] is not None and attempt not in running}
        )
    return out


def _running_attempts(conn: redis.Redis, dump_dir: str) -> set[int] | None:
    """The attempts the live workers of this dump dir's node name (harvest.state.heartbeat), or
    None when a heartbeat names none (no harvest worker writes one so). The node's workers are the
    owners of the claim dirs here, listed after the dump files: a worker makes its claim dir
    before it takes a job, and names the job's attempt before the engine gets a request of it, so
    the worker of any file listed is in this listing, and its heartbeat read after names the
    attempt while it runs. O(the node's workers), not O(dump files)."""
    try:
        owners = sorted({o for n in os.listdir(dump_dir) if (o := claim_dir_owner(n)) and ID_PATTERN.fullmatch(o)})
    except FileNotFoundError:
        return set()
    with conn.pipeline(transaction=False) as pipe:
        for o in owners:
            pipe.hmget(worker_key(o), ["name", "attempt"])
        beats = pipe.execute()
    running = set()
    for name, attempt in beats:
        if name is None:
            continue  # no heartbeat: a dead worker runs nothing
        if attempt is None or (attempt and not attempt.isdigit()):
            return None  # a value no worker writes: nothing is proven
        if attempt:
            running.add(int(attempt))
    return running


def _stored_run(conn: redis.Redis, run: str) -> RunConfig | None:
    try:
        return load_run(conn, run)
    except ConfigurationError:  # not published (yet): nothing of it can be spooled either
        return None


def janitor_pass(
    conn: redis.Redis,
    run: str,
    dump_dir: str | None = None,
    max_reaps: int = MAX_REAPS,
    stale_dump_s: float = STALE_DUMP_S,
    hold_s: float = 0.0,
    unnamed: UnnamedDumps | None = None,
) -> JanitorReport:
    """One pass: the run-wide part if this caller wins the lock, then the node-local part
    (`unnamed`: the caller's memory for `clean_dump_dir`, kept across its passes).

    `hold_s`: keep the lock that long after the pass (by Redis's clock), so the whole fleet does
    the run-wide part once per `hold_s` instead of once per worker's pass: its cost is
    O(workers), and N workers each passing every few seconds would make it O(workers^2) per
    interval. 0 (operators' `harvest janitor`, tests): release at once."""
    rep = JanitorReport()
    keys = Keys(run)
    token = _acquire(conn, keys.janitor_lock, 30_000)
    held = None  # whether a new Redis holds reaping (harvest.ops.liveness); None: not read yet
    if token:
        try:
            now = redis_time(conn)  # the one clock of every run-wide decision
            live = tend_liveness(conn, run, now, max_reaps)
            rep.reaped, rep.gave_up, rep.suspects, rep.dequeued = (
                live.reaped,
                live.gave_up,
                live.suspects,
                live.dequeued,
            )
            held = live.reap_held
            rep.promoted = promote_due_retries(conn, run, now)
            if not held:  # a live worker not yet beaten again on a new Redis stays in the run's set
                rep.forgotten_workers = forget_dead_workers(conn, run)
            cfg = _stored_run(conn, run)
            if cfg is not None:
                rep.reclaimed = reclaim_lost_spools(conn, cfg)
                rep.stranded = tend_stranded(conn, cfg, now)
                if rep.stranded.checked:  # the same fleet-wide cadence: once per CHECK_INTERVAL_S
                    prune_registries(conn, run, now)
        finally:
            scripts.release_lock(keys.janitor_lock, token, int(hold_s * 1000)).run(conn)
    if dump_dir:
        if held is None:
            held = reaping_held_now(conn, run)
        rep.claim_dirs_removed, rep.stale_dumps_removed = clean_dump_dir(
            conn, dump_dir, stale_dump_s, run=run, keep_claim_dirs=held, unnamed=unnamed
        )
    return rep
