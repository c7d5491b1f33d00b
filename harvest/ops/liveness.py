"""Which of RQ's started and dequeued jobs still run, judged by heartbeat TTLs and Redis's TIME only.

RQ records a running job as an execution: an entry `<job>:<execution>` in the queue's
StartedJobRegistry, scored with the starting worker's clock, and a hash naming the worker. RQ's
own maintenance compares those scores with the local clock of whichever worker runs it, so a
skewed node fails another node's running job; harvest's workers run none of it
(harvest.workers.rqworker.HarvestWorker). Here an execution is judged only by facts no node's clock
writes:

- its worker's harvest heartbeat exists (harvest.state.heartbeat: a key whose TTL runs on
  Redis's clock). No heartbeat: the worker is dead, and its job goes back on the queue in one
  WATCHed transaction with the removal of the execution, so two janitors never enqueue it twice
  (count in `harvest:<run>:reaped`; past `max_reaps` its queued samples fail `worker-died`).
- the live worker's heartbeat names this execution (`job`, `execution`). HarvestWorker names it
  in the very transaction in which RQ creates it, and unnames it in the one that removes it, so
  a mismatch is not a race: it is a Redis that rolled back under a running fleet (the started
  registry names executions the workers finished after the rollback point, while they sit idle).
  A mismatch is *suspect*:
  stamped with Redis's TIME in `Keys.suspect_executions` when first seen, taken back once it has
  lasted SUSPECT_GRACE_S (the stamp is removed as soon as it resolves). A suspect is not a death:
  it is not counted against `max_reaps`.
- a job id in RQ's intermediate list (BLMOVEd there by a dequeue) reaches the started registry
  within milliseconds. One that has no execution for SUSPECT_GRACE_S (its worker was killed in
  between) is moved back to the queue; its stamp is the field `<job>:dequeued` of the same hash.

An execution whose job has another execution that its worker's heartbeat names (the stale one of
a rollback) is removed without enqueueing the job again. Only this module takes executions back.

A missing heartbeat proves a death only on a Redis that has kept the latest beats. A restarted
one (its AOF cut at the last second, or empty), a rolled-back or a failed-over one holds live
workers without heartbeats until each beats again, and a pass in between would reap their jobs
while they run them. So `Keys.reap_after` holds a Redis time before which no execution is taken
for dead (nor a worker forgotten, nor its claim dir removed, harvest.ops.janitor): the process
that reconciles the ledger for a new server (harvest.ops.recovery, under its lock) owns it and
sets it to that server's TIME + one heartbeat TTL (`hold_reaping`) before its reconcile, and
again after it, since every process of the run waited for it without beating. It is not set on
a run's first server, so a fresh run reaps at once. A worker that has not beaten by then is dead
and its job is taken back; if it returns late anyway, what fences any reaped worker fences it:
its samples' new attempts have new rids, the ledger moves a sample only from its allowed states
and makes only its first spool the owner, and the commit fence and the claims in storage commit
each once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry
from rq.utils import parse_composite_key

from harvest.errors import StorageError
from harvest.ids import InvalidId
from harvest.state import scripts
from harvest.state.failures import WORKER_DIED, record_failures
from harvest.state.heartbeat import HEARTBEAT_TTL_S
from harvest.state.jobs import fetch_job, run_queue
from harvest.state.keys import Keys, rq_execution_key, worker_key
from harvest.state.ledger import QUEUED, Ledger
from harvest.state.payload import PayloadError, decode_batch

log = logging.getLogger("harvest.janitor")

MAX_REAPS = 3
SUSPECT_GRACE_S = 30.0  # > a beat interval (a rolled-back heartbeat is rewritten at the next beat) with room
DEQUEUED = "dequeued"  # the execution part of a suspect field: dequeued, no execution yet

HEALTHY, DEAD, SUSPECT, ORPHAN = "healthy", "dead", "suspect", "orphan"


def hold_reaping(conn: redis.Redis, run: str, seconds: float = HEARTBEAT_TTL_S) -> float:
    """Take no worker for dead by a missing heartbeat for `seconds` from now by Redis's TIME
    (see the module docstring: harvest.ops.recovery calls it for a new server). Returns the Redis
    time until which reaping is held. The key expires with the hold."""
    return float(scripts.hold_reaping(Keys(run), seconds).run(conn))


def reaping_held(stamp: bytes | str | None, now: float) -> bool:
    """Whether `Keys.reap_after`'s value `stamp` still holds reaping at Redis time `now`."""
    try:
        return stamp is not None and now < float(stamp)
    except ValueError:  # not written by hold_reaping: no hold
        return False


def reaping_held_now(conn: redis.Redis, run: str) -> bool:
    """`reaping_held` by Redis's TIME now (one round trip): for a pass that read neither."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.get(Keys(run).reap_after)
        (sec, usec), stamp = pipe.execute()
    return reaping_held(stamp, sec + usec / 1e6)


@dataclass
class Started:
    """One entry of the started registry and what its worker's heartbeat says of it."""

    job_id: str
    execution_id: str
    worker: str | None  # from the execution hash, else the job hash; None: neither is left
    verdict: str = ""

    @property
    def entry(self) -> str:
        return f"{self.job_id}:{self.execution_id}"


@dataclass
class LivenessReport:
    reaped: list[str] = field(default_factory=list)  # jobs of dead workers back on the queue
    gave_up: list[str] = field(default_factory=list)  # jobs whose samples failed with worker-died
    suspects: list[str] = field(default_factory=list)  # `job:execution` of live workers running other work: taken back
    dequeued: list[str] = field(default_factory=list)  # jobs moved back to the queue from RQ's intermediate list
    dropped: list[str] = field(
        default_factory=list
    )  # entries removed, nothing enqueued (no job left, or it runs elsewhere)
    held: list[str] = field(
        default_factory=list
    )  # `job:execution` of workers without a heartbeat, left to a new Redis's hold
    reap_held: bool = False  # Keys.reap_after held reaping in this pass


def _text(v: bytes | None) -> str | None:
    return v.decode() if v is not None else None


def read_started(conn: redis.Redis, entries: list[bytes]) -> list[Started]:
    """The started registry's `entries` with their verdicts: two round trips, O(entries), and a
    third only for executions whose hash expired (the worker is then read from the job hash)."""
    pairs = [parse_composite_key(e.decode()) for e in entries]
    if not pairs:
        return []
    pipe = conn.pipeline(transaction=False)
    for job_id, exec_id in pairs:
        pipe.hget(rq_execution_key(job_id, exec_id), "worker_name")
    out = [Started(j, e, _text(w)) for (j, e), w in zip(pairs, pipe.execute(), strict=False)]
    expired = [s for s in out if s.worker is None]
    if expired:
        pipe = conn.pipeline(transaction=False)
        for s in expired:
            pipe.hget(Job.key_for(s.job_id), "worker_name")
        for s, w in zip(expired, pipe.execute(), strict=False):
            s.worker = _text(w)
    names = []
    for s in out:
        try:
            if s.worker:
                worker_key(s.worker)
                names.append(s.worker)
        except InvalidId:
            s.worker = ""  # no harvest worker can have that name: no heartbeat, so dead
    names = sorted(set(names))
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.exists(worker_key(n))
        pipe.hmget(worker_key(n), "job", "execution")
    res = pipe.execute()
    beats = {n: (bool(res[2 * i]), *(_text(v) or "" for v in res[2 * i + 1])) for i, n in enumerate(names)}
    for s in out:
        if s.worker is None:
            s.verdict = ORPHAN
            continue
        alive, job, execution = beats.get(s.worker, (False, "", ""))
        if not alive:
            s.verdict = DEAD
        elif job == s.job_id and execution in ("", s.execution_id):
            s.verdict = HEALTHY
        else:
            s.verdict = SUSPECT
    return out


def _take_back(
    conn: redis.Redis, run: str, queue: Queue, s: Started, requeue: bool, count: bool, max_reaps: int
) -> tuple[str, int]:
    """Remove the execution and (with `requeue`) put its job back, or give it up past `max_reaps`
    deaths (with `count`): one WATCHed MULTI/EXEC. Returns (requeued | gave_up | dropped | raced,
    the deaths counted so far)."""
    keys = Keys(run)
    reg = queue.started_job_registry
    try:
        job: Job | None = fetch_job(conn, s.job_id)
    except NoSuchJobError:
        job = None
    with conn.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(reg.key)
            if pipe.zscore(reg.key, s.entry) is None:
                return "raced", 0  # someone else took it back, or it ended
            times = int(pipe.hget(keys.reaped, s.job_id) or 0) + 1 if count else 0
            pipe.multi()
            if job is None:
                pipe.zrem(reg.key, s.entry)
                pipe.delete(rq_execution_key(s.job_id, s.execution_id))
            else:  # RQ's bookkeeping: the execution hash, the started entry, the job's and the worker's indexes
                Execution(s.execution_id, s.job_id, conn, worker_name=s.worker or "").delete(job=job, pipeline=pipe)
            pipe.lrem(queue.intermediate_queue_key, 0, s.job_id)
            if count:
                pipe.hincrby(keys.reaped, s.job_id, 1)
            if job is None or not requeue:
                outcome = "dropped"
            elif count and times > max_reaps:
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                FailedJobRegistry(queue=queue).add(
                    job,
                    ttl=job.failure_ttl,
                    pipeline=pipe,
                    exc_string=f"worker {s.worker} died while running this job {times} times: given up",
                )
                outcome = "gave_up"
            else:
                queue.enqueue_job(job, pipeline=pipe)
                outcome = "requeued"
            pipe.execute()
        except redis.WatchError:
            return "raced", 0  # the registry moved under us: the next pass looks again
    if outcome == "gave_up" and job is not None:
        _fail_samples_of(
            conn,
            run,
            job,
            f"the worker running this sample's job died {times} times "
            f"(last: {s.worker}); does the sample crash the engine or the worker?",
        )
    return outcome, times


def _fail_samples_of(conn: redis.Redis, run: str, job: Job, message: str) -> None:
    try:
        _, samples = decode_batch(job.args[0])
    except (PayloadError, StorageError, IndexError, TypeError) as e:  # its samples: the stranded sweep's
        log.error("job %s holds no valid payload (%s); its samples cannot be failed by id", job.id, e)
        return
    ledger = Ledger(conn, run)
    todo = [s for s, st in zip(samples, ledger.states([s.id for s in samples]), strict=False) if st == QUEUED]
    record_failures(ledger, run, {s.id: s for s in todo}, {s.id: (WORKER_DIED, message) for s in todo})


def _note(
    conn: redis.Redis,
    run: str,
    rep: LivenessReport,
    s: Started,
    outcome: str,
    times: int,
    max_reaps: int,
    suspect_for: float,
) -> None:
    """An execution taken back (or not: "raced"), in the report and the log."""
    if outcome == "raced":
        return
    if outcome == "requeued" and s.verdict == DEAD:
        log.warning("worker %s is dead: job %s back on the queue (%d of %d)", s.worker, s.job_id, times, max_reaps)
        Ledger(conn, run).add_stats(jobs_reaped=1)
        rep.reaped.append(s.job_id)
    elif outcome == "requeued":
        log.warning(
            "execution %s: its worker %s is alive but has run something else for %.0fs: job back on the queue",
            s.entry,
            s.worker,
            suspect_for,
        )
        rep.suspects.append(s.entry)
    elif outcome == "gave_up":
        rep.gave_up.append(s.job_id)
    else:
        rep.dropped.append(s.entry)


def _tend_dequeued(
    conn: redis.Redis,
    queue: Queue,
    job_id: str,
    stamps: dict[str, float],
    pending: dict[str, float],
    now: float,
    grace: float,
    rep: LivenessReport,
) -> None:
    """A job dequeued with no execution: stamped the first time it is seen, put back on the queue
    after `grace` (its worker died between the dequeue and the start)."""
    f = f"{job_id}:{DEQUEUED}"
    first = stamps.get(f)
    if first is None or now - first < grace:
        pending[f] = now if first is None else first
        return
    if scripts.put_back(queue.intermediate_queue_key, queue.key, Job.key_for(job_id), job_id).run(conn):
        log.warning(
            "job %s was dequeued %.0fs ago and never started (its worker died in between): back on the queue",
            job_id,
            now - first,
        )
        rep.dequeued.append(job_id)


def tend_liveness(
    conn: redis.Redis, run: str, now: float, max_reaps: int = MAX_REAPS, grace: float = SUSPECT_GRACE_S
) -> LivenessReport:
    """One pass over the run's started and dequeued jobs (see the module docstring); `now` is
    Redis's TIME. In the common case (every execution named by its live worker) three round
    trips of 3 + executions + 2 x workers commands; one round trip when nothing runs."""
    keys, queue = Keys(run), run_queue(conn, run)
    rep = LivenessReport()
    with conn.pipeline(transaction=False) as pipe:
        pipe.zrange(queue.started_job_registry.key, 0, -1)
        pipe.lrange(queue.intermediate_queue_key, 0, -1)
        pipe.hgetall(keys.suspect_executions)
        pipe.get(keys.reap_after)
        entries, dequeued_raw, stamps_raw, reap_after = pipe.execute()
    rep.reap_held = reaping_held(reap_after, now)
    started = read_started(conn, entries)
    stamps = {k.decode(): float(v) for k, v in stamps_raw.items()}
    runs_elsewhere = {s.job_id for s in started if s.verdict == HEALTHY}
    pending: dict[str, float] = {}  # suspect fields still suspect after this pass -> their stamp
    for s in started:
        if s.verdict == HEALTHY:
            continue
        if s.verdict == DEAD and rep.reap_held:
            rep.held.append(s.entry)  # its worker may be alive on a new Redis, not yet beaten again
            continue
        if s.verdict == SUSPECT:
            first = stamps.get(s.entry)
            if first is None or now - first < grace:
                pending[s.entry] = now if first is None else first
                continue
        requeue = s.job_id not in runs_elsewhere
        count = s.verdict == DEAD and requeue
        outcome, times = _take_back(conn, run, queue, s, requeue=requeue, count=count, max_reaps=max_reaps)
        _note(conn, run, rep, s, outcome, times, max_reaps, now - stamps.get(s.entry, now))
    in_started = {s.job_id for s in started}
    for job_id in dict.fromkeys(v.decode() for v in dequeued_raw):
        if job_id not in in_started:
            _tend_dequeued(conn, queue, job_id, stamps, pending, now, grace, rep)
    with conn.pipeline(transaction=False) as pipe:
        for f, t in pending.items():
            if f not in stamps:
                pipe.hsetnx(keys.suspect_executions, f, repr(t))
        gone = [f for f in stamps if f not in pending]
        if gone:
            pipe.hdel(keys.suspect_executions, *gone)
        pipe.execute()
    if rep.held:
        log.info(
            "%d executions of workers without a heartbeat left until Redis time %s: Redis is new, its workers "
            "may not have beaten again yet",
            len(rep.held),
            reap_after.decode(),
        )
    return rep
