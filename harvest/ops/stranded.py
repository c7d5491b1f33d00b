"""Stranded samples: queued in the ledger, in no job that will run them, and put back on the queue.

A sample in state `q` is covered while a job holding it is on the run's queue, in RQ's
intermediate list (dequeued), in the started registry (harvest.ops.liveness takes back the
executions of dead or mismatched workers, in the same janitor pass, just before this), or
scheduled for a retry. Harvest writes every ledger move with its RQ enqueue in one MULTI/EXEC,
but RQ's own bookkeeping can still leave a job nowhere while its samples stay queued: RQ files
it as failed (an exception outside the job function; retries spent on a Redis error; another
node's registry cleanup by a skewed clock, in a plain RQ worker), drops a
registry entry, or lets a failed job expire. Whatever RQ's registries say, a sample stranded for
`STRANDED_GRACE_S` by Redis's clock (first seen: `Keys.stranded`) is enqueued again as a new job,
built as harvest.ops.reclaim builds them, from its payload row wherever one is kept: the job data
in RQ's failed, canceled, finished or deferred registries, the run's failed-payload and
spooled payload rows (a ref read through its job's copy, harvest.state.jobcopy), or any other
job hash of the run's queue. A sample whose tokens are kept nowhere fails as `job-lost`, with
one warning.

Cost. Finding stranded samples reads every sample's state: O(samples). So that runs only when a
cheap check says some sample must be stranded. The check runs at most every `CHECK_INTERVAL_S`
for the whole fleet (its time, by Redis's clock, is the reserved member `~check` of
`Keys.stranded`; between checks a janitor pass costs this module one ZSCORE). It reads, in one
MULTI/EXEC, the ledger's `q` count and the ids of every covering job (O(jobs)), and adds up how
many samples each holds (the count in the job's description, written by harvest.state.jobs,
cached per process: one HGET per job this process has not seen). A job covers only samples it
holds, so `q` above that sum proves a stranded sample. Then a sweep runs, no more than once per
`SWEEP_INTERVAL_S` (`~sweep`), and only as often as the grace needs: once to stamp what it finds,
again when the oldest stamp is due, or when more samples are missing than are stamped. The check
can miss stranded samples while covering jobs hold samples no longer queued (a job duplicated
by a reclaim, a retry partly done); those jobs run soon, so a stall is found at the latest when
the queue drains. A sweep runs on a worker's heartbeat thread: it beats meanwhile
(harvest.state.heartbeat.keep_alive), and stamps `~sweep` before it starts, so a janitor whose
lock lapsed during a long sweep does not start a second one.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from rq.job import Job

from harvest.config import RunConfig
from harvest.errors import StorageError
from harvest.ids import job_id_for
from harvest.sample import Sample, split_jobs
from harvest.state.failures import JOB_LOST
from harvest.state.heartbeat import keep_alive
from harvest.state.jobcopy import resolve
from harvest.state.jobs import SERIALIZER, enqueue_samples, run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import QUEUED, Ledger
from harvest.state.payload import PAYLOAD_VERSION, PayloadError, batch_ids, decode_batch, inline

log = logging.getLogger("harvest.janitor")

STRANDED_GRACE_S = 60.0  # > SUSPECT_GRACE_S: a job being taken back is not stranded meanwhile
CHECK_INTERVAL_S = 10.0
SWEEP_INTERVAL_S = 30.0
CHECK, SWEEP = "~check", "~sweep"  # reserved members of Keys.stranded (sample ids are hex)
CHUNK = 1000  # samples per transaction
FETCH = 200  # jobs per pipelined read
_SIZE = re.compile(r": (\d+) samples of run ")
_sizes: dict[str, int] = {}  # job id -> samples it holds (immutable per job)
_SIZES_MAX = 100_000


@dataclass
class StrandedReport:
    checked: bool = False  # the cheap check ran in this pass
    excess: int = 0  # ledger q minus the samples the covering jobs hold (> 0: some sample is stranded)
    swept: bool = False
    stranded: list[str] = field(default_factory=list)  # found stranded by the sweep (stamped or due)
    requeued: list[str] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # no payload row anywhere: failed as job-lost


def _covering(conn: redis.Redis, run: str, with_stamps: bool) -> tuple[int, list[str], dict[str, float]]:
    """(ledger q count, ids of the covering jobs, Keys.stranded with scores), read in one MULTI/EXEC."""
    keys, queue = Keys(run), run_queue(conn, run)
    with conn.pipeline(transaction=True) as pipe:
        pipe.hget(keys.counts, QUEUED)
        pipe.lrange(queue.key, 0, -1)
        pipe.lrange(queue.intermediate_queue_key, 0, -1)
        pipe.zrange(queue.started_job_registry.key, 0, -1)
        pipe.zrange(queue.scheduled_job_registry.key, 0, -1)
        if with_stamps:
            pipe.zrange(keys.stranded, 0, -1, withscores=True)
        res = pipe.execute()
    ids = [v.decode() for v in res[1] + res[2] + res[4]] + [v.decode().split(":", 1)[0] for v in res[3]]
    stamps = {m.decode(): s for m, s in res[5]} if with_stamps else {}
    return int(res[0] or 0), list(dict.fromkeys(ids)), stamps


def job_sizes(conn: redis.Redis, job_ids: list[str]) -> int:
    """Samples the jobs hold, from their descriptions (0 for a job gone or not harvest's)."""
    missing = [j for j in job_ids if j not in _sizes]
    if missing:
        if len(_sizes) + len(missing) > _SIZES_MAX:
            _sizes.clear()
        pipe = conn.pipeline(transaction=False)
        for j in missing:
            pipe.hget(Job.key_for(j), "description")
        for j, d in zip(missing, pipe.execute(), strict=False):
            m = _SIZE.search(d.decode(errors="replace")) if d else None
            if m:
                _sizes[j] = int(m.group(1))
    return sum(_sizes.get(j, 0) for j in job_ids)


def _jobs(conn: redis.Redis, job_ids: Iterable[str]) -> Iterable[Job]:
    ids = list(job_ids)
    for i in range(0, len(ids), FETCH):
        keep_alive()
        yield from (j for j in Job.fetch_many(ids[i : i + FETCH], connection=conn, serializer=SERIALIZER) if j)


def _jobs_ids(conn: redis.Redis, job_ids: Iterable[str]) -> set[str]:
    """The samples the jobs hold, from Redis alone (a producer's job names its ids beside its rows
    in storage: a store that is down covers nothing less). Unreadable jobs: none."""
    out: set[str] = set()
    for job in _jobs(conn, job_ids):
        try:
            out.update(batch_ids(job.args[0]))
        except Exception as e:  # noqa: BLE001 - a job we cannot read covers nothing
            log.debug("job %s unreadable here: %s", job.id, e)
    return out


def _jobs_rows(conn: redis.Redis, job_ids: Iterable[str]) -> Iterable[tuple[str, str]]:
    """(sample id, payload row JSON) of every row of the jobs' payloads (a producer's job: read from
    storage). A job whose payload is unreadable or whose rows are gone offers no row; a store that
    fails raises (StorageError), so the sweep stops with its stamps and fails nothing as lost."""
    for job in _jobs(conn, job_ids):
        keep_alive()  # a storage read a job, on the worker's heartbeat thread
        try:
            rows = inline(job.args[0])["samples"]
            pairs = [(r["id"], json.dumps(r)) for r in rows]
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - a job we cannot read offers no row
            log.debug("job %s unreadable here: %s", job.id, e)
            continue
        yield from pairs


def _find_rows(conn: redis.Redis, run: str, want: set[str]) -> dict[str, str]:
    """Payload rows of `want`, from wherever Redis still keeps one (see the module docstring)."""
    keys, queue = Keys(run), run_queue(conn, run)
    rows: dict[str, str] = {}
    regs = (
        queue.failed_job_registry,
        queue.canceled_job_registry,
        queue.finished_job_registry,
        queue.deferred_job_registry,
    )
    kept = [j.decode() for r in regs for j in conn.zrange(r.key, 0, -1)]
    rows.update((sid, row) for sid, row in _jobs_rows(conn, dict.fromkeys(kept)) if sid in want)
    for h in (keys.failed_payload, keys.spooled_payload):
        rest = sorted(want - rows.keys())
        if rest:
            kept = {sid: v.decode() for sid, v in zip(rest, conn.hmget(h, rest), strict=False) if v is not None}
            rows.update((sid, r) for sid, r in resolve(conn, keys, kept).items() if r is not None)
    if want - rows.keys():  # any other job hash of this queue: O(keys), and only for what is still missing
        prefix = Job.redis_job_namespace_prefix
        others = []
        for k in conn.scan_iter(match=prefix + "*", count=1000):
            j = k.decode()[len(prefix) :]
            if ":" not in j and j not in kept:
                others.append(j)
        pipe = conn.pipeline(transaction=False)
        for j in others:
            pipe.hget(Job.key_for(j), "origin")
        mine = [j for j, o in zip(others, pipe.execute(), strict=False) if o is not None and o.decode() == queue.name]
        rows.update((sid, row) for sid, row in _jobs_rows(conn, mine) if sid in want and sid not in rows)
    return rows


def _requeue(conn: redis.Redis, cfg: RunConfig, due: list[str], grace: float, rep: StrandedReport) -> None:
    keys, ledger, queue = Keys(cfg.run), Ledger(conn, cfg.run), run_queue(conn, cfg.run)
    rows = _find_rows(conn, cfg.run, set(due))
    samples: list[Sample] = []
    lost = []
    for sid in due:
        try:
            _, (s,) = decode_batch({"v": PAYLOAD_VERSION, "run": cfg.run, "samples": [json.loads(rows[sid])]})
        except (KeyError, TypeError, ValueError, PayloadError):
            lost.append(sid)
            continue
        if s.id == sid:
            samples.append(s)
        else:
            lost.append(sid)
    for i in range(0, len(samples), CHUNK):
        chunk = samples[i : i + CHUNK]
        batches = split_jobs(chunk, cfg.max_batch_samples, cfg.max_batch_tokens)
        job_ids = [f"{job_id_for(cfg.run, [s.id for s in b])}-s{time.time_ns()}" for b in batches]
        with conn.pipeline(transaction=True) as pipe:
            pipe.multi()
            for b, job_id in zip(batches, job_ids, strict=False):
                enqueue_samples(queue, cfg.run, b, job_id, pipe)
            pipe.zrem(keys.stranded, *[s.id for s in chunk])
            pipe.execute()
        rep.requeued += [s.id for s in chunk]
        rep.jobs += job_ids
    if rep.requeued:
        ledger.add_stats(samples_stranded=len(rep.requeued))
        log.warning(
            "%d queued samples were in no job for %.0fs or more (RQ failed or dropped their jobs): back on "
            "the queue in %d new jobs",
            len(rep.requeued),
            grace,
            len(rep.jobs),
        )
    if lost:
        why = (
            f"queued, but in no job for {grace:.0f}s or more, and its tokens are kept nowhere in Redis (no job, "
            "no failed or spooled payload row): produce the dataset again"
        )
        rep.lost = ledger.mark_failed(dict.fromkeys(lost, (JOB_LOST, why)))
        conn.zrem(keys.stranded, *lost)
        log.warning(
            "%d queued samples are in no job and their tokens are kept nowhere in Redis: failed as %s "
            "(first: %s); produce the dataset again to redo them",
            len(lost),
            JOB_LOST,
            lost[0],
        )


def sweep(
    conn: redis.Redis, cfg: RunConfig, now: float, stamps: dict[str, float], grace: float = STRANDED_GRACE_S
) -> StrandedReport:
    """The O(samples) pass: stamp the stranded samples (Redis time `now`), forget stamps that
    resolved, and enqueue again those stranded for `grace` (see the module docstring)."""
    keys = Keys(cfg.run)
    rep = StrandedReport(swept=True)
    conn.zadd(keys.stranded, {SWEEP: now})  # first: a janitor whose lock lapsed meanwhile does not sweep too
    queued = []
    for i, (k, v) in enumerate(conn.hscan_iter(keys.state, count=10_000)):
        if v == QUEUED.encode():
            queued.append(k.decode())
        if i % 100_000 == 0:
            keep_alive()  # seconds for millions of samples, on the worker's heartbeat thread
    # Jobs read after the states: a job that held a sample queued at the scan still holds it now, or
    # the sample moved on (it is read again below).
    _, job_ids, _ = _covering(conn, cfg.run, with_stamps=False)
    covered = _jobs_ids(conn, job_ids)
    candidates = [s for s in queued if s not in covered]
    states = Ledger(conn, cfg.run).states(candidates)
    rep.stranded = [s for s, st in zip(candidates, states, strict=False) if st == QUEUED]
    mine = set(rep.stranded)
    new = {s: now for s in rep.stranded if s not in stamps}
    resolved = [s for s in stamps if s not in mine and s not in (CHECK, SWEEP)]
    with conn.pipeline(transaction=True) as pipe:
        if new:
            pipe.zadd(keys.stranded, new, nx=True)
        if resolved:
            pipe.zrem(keys.stranded, *resolved)
        pipe.execute()  # nothing to send when nothing changed
    due = [s for s in rep.stranded if now - stamps.get(s, now) >= grace]
    if due:
        _requeue(conn, cfg, due, grace, rep)
    return rep


def tend_stranded(
    conn: redis.Redis,
    cfg: RunConfig,
    now: float,
    grace: float = STRANDED_GRACE_S,
    check_interval: float = CHECK_INTERVAL_S,
    sweep_interval: float = SWEEP_INTERVAL_S,
) -> StrandedReport:
    """The janitor's part (run-wide, under its lock): the cheap check when due, a sweep when it
    proves a stall or a stamp is due. `now` is Redis's TIME."""
    keys = Keys(cfg.run)
    last = conn.zscore(keys.stranded, CHECK)
    if last is not None and now - last < check_interval:
        return StrandedReport()
    conn.zadd(keys.stranded, {CHECK: now})
    q, job_ids, stamps = _covering(conn, cfg.run, with_stamps=True)
    swept_at = stamps.pop(SWEEP, None)
    stamps.pop(CHECK, None)
    rep = StrandedReport(checked=True, excess=q - job_sizes(conn, job_ids) if q else 0)
    if swept_at is not None and now - swept_at < sweep_interval:
        return rep
    due = bool(stamps) and now - min(stamps.values()) >= grace
    if not due and rep.excess > len(stamps):
        # A job that ended between the snapshot and the read of its size counted 0 while its
        # samples were still counted queued: look again (it is out of the new snapshot, and the
        # sizes read once are cached), so a busy fleet does not sweep O(samples) for nothing.
        q, job_ids, _ = _covering(conn, cfg.run, with_stamps=False)
        rep.excess = min(rep.excess, q - job_sizes(conn, job_ids) if q else 0)
    if due or rep.excess > len(stamps):  # a stamp is due, or more samples are stranded than are stamped
        out = sweep(conn, cfg, now, stamps, grace)
        out.checked, out.excess = True, rep.excess
        return out
    return rep
