"""The janitor: takes back the jobs of dead workers, releases due retries, and cleans dump dirs.

RQ alone notices a dead SimpleWorker only when its StartedJobRegistry entry expires, which is
`job.timeout + 60` s after the job started (about 11 min for a default harvest job), and then
moves the job to the FailedJobRegistry, leaving its samples queued in the ledger forever. Here a
worker is dead when its harvest heartbeat (harvest.state.heartbeat, 15 s TTL) is gone; its started job
is put back on the queue at once, in one WATCHed transaction with the registry entry's removal,
so two janitors can never enqueue it twice. A job whose worker died `max_reaps` times (a sample
that kills the engine or the worker, say) is not retried forever: its still-queued samples fail
with reason `worker-died`.

Every worker runs a janitor pass every few seconds (one of them does the run-wide part, under a
short lock); `harvest janitor` runs the same passes for operators. The run-wide part also moves
due transient-error retries (jobs that returned `rq.Retry` with a backoff interval) from RQ's
ScheduledJobRegistry to the queue, which RQ would only do with its separate scheduler process,
and reclaims node spools whose lease lapsed (harvest.ops.reclaim).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.utils import current_timestamp

from harvest.config import ConfigError, RunConfig
from harvest.formats.dump import parse_chunk_name
from harvest.ids import ID_PATTERN, RID_PREFIX, parse_rid
from harvest.node.dumpdir import claim_dir_owner, is_temp
from harvest.ops.reclaim import ReclaimReport, reclaim_lost_spools
from harvest.state.failures import WORKER_DIED, record_failures
from harvest.state.heartbeat import HEARTBEAT_TTL_S, worker_alive
from harvest.state.jobs import fetch_job, run_queue
from harvest.state.keys import Keys, rq_execution_key, rq_worker_key, worker_key
from harvest.state.ledger import DONE, FAILED, QUEUED, Ledger
from harvest.state.payload import PayloadError, decode_batch
from harvest.state.runstore import load_run

log = logging.getLogger("harvest.janitor")

MAX_REAPS = 3
STALE_DUMP_S = 900.0
PROVEN_STALE_S = 2.0  # files the ledger proves unclaimable: only give a rename in flight time to land


@dataclass
class JanitorReport:
    reaped: list[str] = field(default_factory=list)  # job ids put back on the queue
    gave_up: list[str] = field(default_factory=list)  # job ids whose samples failed with worker-died
    promoted: list[str] = field(default_factory=list)  # scheduled retries moved to the queue
    forgotten_workers: list[str] = field(default_factory=list)
    claim_dirs_removed: list[str] = field(default_factory=list)
    stale_dumps_removed: int = 0
    reclaimed: list[ReclaimReport] = field(default_factory=list)  # lost spools whose samples went back to the queue

    def any(self) -> bool:
        return bool(self.reaped or self.gave_up or self.promoted or self.forgotten_workers
                    or self.claim_dirs_removed or self.stale_dumps_removed or any(r.samples for r in self.reclaimed))

    def line(self) -> str:
        """One line for logs and `harvest janitor`."""
        return (f"reaped {len(self.reaped)} jobs, gave up {len(self.gave_up)}, released {len(self.promoted)} retries, "
                f"forgot {len(self.forgotten_workers)} dead workers, removed {len(self.claim_dirs_removed)} claim dirs "
                f"and {self.stale_dumps_removed} stale dump files"
                + "".join(f"; reclaimed spool {r.spool} of node {r.node}: {len(r.samples)} samples"
                          for r in self.reclaimed if r.samples))


def _acquire(conn: redis.Redis, key: str, ttl_ms: int) -> str | None:
    token = uuid.uuid4().hex
    return token if conn.set(key, token, nx=True, px=ttl_ms) else None


_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def reap_dead_workers(conn: redis.Redis, run: str, max_reaps: int = MAX_REAPS) -> tuple[list[str], list[str]]:
    """Put back the started jobs whose worker has no heartbeat; returns (requeued, given up)."""
    keys = Keys(run)
    queue = run_queue(conn, run)
    reg = queue.started_job_registry
    requeued, gave_up = [], []
    for job_id, exec_id in reg.get_job_and_execution_ids(cleanup=False):
        entry = f"{job_id}:{exec_id}"
        worker = conn.hget(rq_execution_key(job_id, exec_id), "worker_name")
        if worker is None or worker_alive(conn, worker.decode()):
            continue  # alive, or an execution RQ itself will expire
        worker = worker.decode()
        try:
            job = fetch_job(conn, job_id)
        except NoSuchJobError:
            conn.zrem(reg.key, entry)
            continue
        with conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(reg.key)
                if pipe.zscore(reg.key, entry) is None:
                    continue  # someone else took it back
                times = int(pipe.hget(keys.reaped, job_id) or 0) + 1
                pipe.multi()
                # RQ's own bookkeeping of the execution: its key, the started registry entry, the
                # job's execution registry and the dead worker's execution index.
                Execution(exec_id, job_id, conn, worker_name=worker).delete(job=job, pipeline=pipe)
                pipe.hincrby(keys.reaped, job_id, 1)
                if times <= max_reaps:
                    queue.enqueue_job(job, pipeline=pipe)
                else:
                    job.set_status(JobStatus.FAILED, pipeline=pipe)
                    FailedJobRegistry(queue=queue).add(
                        job, ttl=job.failure_ttl, pipeline=pipe,
                        exc_string=f"worker {worker} died while running this job {times} times: given up")
                pipe.execute()
            except redis.WatchError:
                continue  # the registry moved under us: the next pass looks again
        if times <= max_reaps:
            log.warning("worker %s is dead: job %s back on the queue (%d of %d)", worker, job_id, times, max_reaps)
            Ledger(conn, run).add_stats(jobs_reaped=1)
            requeued.append(job_id)
        else:
            _fail_samples_of(conn, run, job, f"the worker running this sample's job died {times} times "
                             f"(last: {worker}); does the sample crash the engine or the worker?")
            gave_up.append(job_id)
    return requeued, gave_up


def _fail_samples_of(conn: redis.Redis, run: str, job: Job, message: str) -> None:
    try:
        _, samples = decode_batch(job.args[0])
    except (PayloadError, IndexError, TypeError) as e:
        log.error("job %s holds no valid payload (%s); its samples cannot be failed by id", job.id, e)
        return
    ledger = Ledger(conn, run)
    todo = [s for s, st in zip(samples, ledger.states([s.id for s in samples])) if st == QUEUED]
    record_failures(ledger, run, {s.id: s for s in todo}, {s.id: (WORKER_DIED, message) for s in todo})


def promote_due_retries(conn: redis.Redis, run: str) -> list[str]:
    """Move jobs whose retry backoff has passed from the ScheduledJobRegistry to the queue."""
    queue = run_queue(conn, run)
    reg = queue.scheduled_job_registry
    moved = []
    for job_id in reg.get_jobs_to_schedule(current_timestamp()):
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


def forget_dead_workers(conn: redis.Redis, run: str) -> list[str]:
    """Drop dead workers from the run's worker set and from RQ's worker registry (so rq-dashboard
    and `rq info` stop listing them before RQ's own key expires)."""
    from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

    keys = Keys(run)
    gone = []
    for raw in conn.smembers(keys.workers):
        name = raw.decode()
        if worker_alive(conn, name):
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


def clean_dump_dir(conn: redis.Redis, dump_dir: str, stale_dump_s: float = STALE_DUMP_S,
                   now: float | None = None, run: str | None = None,
                   proven_stale_s: float = PROVEN_STALE_S) -> tuple[list[str], int]:
    """Node-local: remove the claim dirs of workers with no heartbeat (any run: the dump dir may be
    shared) and unclaimed dump files older than `stale_dump_s` (a request that timed out, or a
    worker that died before claiming). With `run`, files that run's ledger proves nobody will
    claim (their sample is done or failed, or a newer attempt exists: the engine finished a
    request after its worker died or gave up) go after only `proven_stale_s`.
    Returns (claim dirs removed, dump files removed)."""
    now = time.time() if now is None else now
    dirs, files = [], 0
    try:
        entries = list(os.scandir(dump_dir))
    except FileNotFoundError:
        return dirs, files
    proven = _proven_stale(conn, run, [e.name for e in entries]) if run else set()
    for e in entries:
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        name = claim_dir_owner(e.name)
        if name is not None and e.is_dir(follow_symlinks=False):
            # A worker announces itself before it creates its claim dir; the age check covers a
            # Redis that lost its keys (restart without AOF) while the worker lives on.
            if ID_PATTERN.fullmatch(name) and age > HEARTBEAT_TTL_S and not conn.exists(worker_key(name)):
                shutil.rmtree(e.path, ignore_errors=True)
                dirs.append(e.name)
        elif e.is_file(follow_symlinks=False) and (e.name.startswith(RID_PREFIX) or is_temp(e.name)):
            if age > stale_dump_s or (e.name in proven and age > proven_stale_s):
                try:
                    os.unlink(e.path)
                    files += 1
                except FileNotFoundError:
                    pass
    return dirs, files


def _proven_stale(conn: redis.Redis, run: str, names: list[str]) -> set[str]:
    parsed = {}
    for n in names:
        p = parse_chunk_name(n)
        if p is not None:
            sid, attempt = parse_rid(p[0])
            parsed[n] = (sid, attempt)
    if not parsed:
        return set()
    sids = sorted({sid for sid, _ in parsed.values()})
    ledger = Ledger(conn, run)
    states = dict(zip(sids, ledger.states(sids)))
    attempts = dict(zip(sids, conn.hmget(ledger.keys.attempts, sids)))
    out = set()
    for n, (sid, attempt) in parsed.items():
        current = int(attempts[sid] or 0)
        if states[sid] in (DONE, FAILED) or (states[sid] is not None and current > attempt):
            out.add(n)
    return out


def _stored_run(conn: redis.Redis, run: str) -> RunConfig | None:
    try:
        return load_run(conn, run)
    except ConfigError:  # not published (yet): nothing of it can be spooled either
        return None


def janitor_pass(conn: redis.Redis, run: str, dump_dir: str | None = None, max_reaps: int = MAX_REAPS,
                 stale_dump_s: float = STALE_DUMP_S) -> JanitorReport:
    """One pass: the run-wide part if this caller wins the lock, then the node-local part."""
    rep = JanitorReport()
    keys = Keys(run)
    token = _acquire(conn, keys.janitor_lock, 30_000)
    if token:
        try:
            rep.reaped, rep.gave_up = reap_dead_workers(conn, run, max_reaps)
            rep.promoted = promote_due_retries(conn, run)
            rep.forgotten_workers = forget_dead_workers(conn, run)
            cfg = _stored_run(conn, run)
            if cfg is not None:
                rep.reclaimed = reclaim_lost_spools(conn, cfg)
        finally:
            conn.eval(_RELEASE, 1, keys.janitor_lock, token)
    if dump_dir:
        rep.claim_dirs_removed, rep.stale_dumps_removed = clean_dump_dir(conn, dump_dir, stale_dump_s, run=run)
    return rep
