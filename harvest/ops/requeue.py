"""`harvest requeue`: put failed samples (and RQ's failed jobs) back on the queue, exactly once.

Failed samples have left their job, so a worker keeps each one's payload row (tokens and mask,
the producer's encoding) next to its failure (`harvest:<run>:failed-payload`); requeue builds
new jobs from those rows, without the dataset. Exactly once: for each chunk, the ledger move
`f -> q`, the new RQ jobs and the removal of the kept rows go in one MULTI/EXEC guarded by a
WATCH on the run's failure hash. A concurrent requeue (or a worker recording a new failure)
changes that hash, so the later transaction is retried against the new state and finds nothing
left to move: a second requeue adds nothing.

RQ's own failed jobs (a worker killed by a second signal, a job the janitor gave up on) are
requeued through RQ when they still hold samples in state `q`; ones whose samples are all
accounted for elsewhere in the ledger are dropped from RQ's registry. Jobs are built by
harvest.state.jobs, as the producer's are.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError

from harvest.config import RunConfig
from harvest.ids import InvalidId, check_id, job_id_for
from harvest.sample import split_jobs
from harvest.state.jobs import enqueue_samples, fetch_job, run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import FAILED, QUEUED, Ledger
from harvest.state.payload import PAYLOAD_VERSION, PayloadError, batch_ids, decode_batch

CHUNK = 1000  # samples per transaction


@dataclass
class RequeueResult:
    samples: list[str] = field(default_factory=list)  # failed samples moved f -> q (or that would be)
    reasons: dict[str, int] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)  # new jobs enqueued for them
    no_payload: list[str] = field(default_factory=list)  # failed, but their tokens were not kept
    rq_jobs_requeued: list[str] = field(default_factory=list)  # RQ failed jobs put back
    rq_jobs_dropped: list[str] = field(default_factory=list)  # RQ failed jobs whose samples the ledger holds
    dry_run: bool = False


def select_failed(
    ledger: Ledger, reasons: Iterable[str] = (), sample_ids: Iterable[str] = (), all_: bool = False
) -> dict[str, dict]:
    """The failed samples the selectors name: all of them, those with one of `reasons`, and/or `sample_ids`."""
    reasons, wanted = set(reasons), {check_id(s, "sample id") for s in sample_ids}
    out = {}
    for sid, info in ledger.failures().items():
        if all_ or sid in wanted or info.get("reason") in reasons:
            out[sid] = info
    return out


def _requeue_chunk(conn: redis.Redis, cfg: RunConfig, ids: list[str], res: RequeueResult) -> None:
    keys, ledger = Keys(cfg.run), Ledger(conn, cfg.run)
    queue = run_queue(conn, cfg.run)
    with conn.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(keys.failed)
                states = [v.decode() if v else None for v in pipe.hmget(keys.state, ids)]
                rows = [v.decode() if v else None for v in pipe.hmget(keys.failed_payload, ids)]
                samples, missing = [], []
                for sid, st, row in zip(ids, states, rows, strict=False):
                    if st != FAILED:
                        continue  # requeued by someone else meanwhile, or done
                    if row is None:
                        missing.append(sid)
                        continue
                    try:
                        _, (s,) = decode_batch({"v": PAYLOAD_VERSION, "run": cfg.run, "samples": [json.loads(row)]})
                    except (PayloadError, ValueError):
                        missing.append(sid)
                        continue
                    samples.append(s)
                batches = split_jobs(samples, cfg.max_batch_samples, cfg.max_batch_tokens)
                job_ids = [f"{job_id_for(cfg.run, [s.id for s in b])}-r{time.time_ns()}" for b in batches]
                pipe.multi()
                for b, job_id in zip(batches, job_ids, strict=False):
                    bids = [s.id for s in b]
                    ledger.requeue(bids, pipe=pipe)
                    enqueue_samples(queue, cfg.run, b, job_id, pipe)
                if samples:
                    pipe.hdel(keys.failed_payload, *[s.id for s in samples])
                pipe.execute()
                break
            except redis.WatchError:
                continue  # the failures changed (another requeue, a new failure): look again
    res.samples += [s.id for s in samples]
    res.jobs += job_ids
    res.no_payload += missing


def _job_sample_ids(payload: object) -> list[str]:
    """A harvest job's sample ids, from Redis alone: a producer's job names its rows in storage
    (harvest.formats.jobrows) with its ids beside them, and requeue puts the job back as it is, so
    it reads no rows. A store that is down then stops nothing (the worker reads the rows when the
    job runs, and hands the job back while the store fails)."""
    if not isinstance(payload, dict) or payload.get("v") != PAYLOAD_VERSION:
        raise PayloadError(f"not a harvest v{PAYLOAD_VERSION} job payload")
    ids = batch_ids(payload)
    if not ids:
        raise PayloadError("payload has no samples")
    try:
        return [check_id(i, "sample id") for i in ids]
    except InvalidId as e:
        raise PayloadError(str(e)) from None


def _rq_failed_jobs(conn: redis.Redis, run: str, res: RequeueResult) -> None:
    """Requeue (or, with dry_run, list) RQ's failed jobs of the run."""
    queue = run_queue(conn, run)
    reg = queue.failed_job_registry
    ledger = Ledger(conn, run)
    for job_id in reg.get_job_ids(cleanup=False):
        try:
            job = fetch_job(conn, job_id)
            ids = _job_sample_ids(job.args[0])
        except (NoSuchJobError, PayloadError, IndexError, TypeError):
            continue  # not a harvest job we can reason about: leave it to the operator
        holds_queued = QUEUED in ledger.states(ids)
        if res.dry_run:
            (res.rq_jobs_requeued if holds_queued else res.rq_jobs_dropped).append(job_id)
            continue
        with conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(reg.key)
                if pipe.zscore(reg.key, job_id) is None:
                    continue  # another requeue took it
                pipe.multi()
                pipe.zrem(reg.key, job_id)
                if holds_queued:
                    queue.enqueue_job(job, pipeline=pipe)
                else:
                    job.delete(pipeline=pipe, remove_from_queue=False)
                pipe.execute()
            except redis.WatchError:
                continue
        (res.rq_jobs_requeued if holds_queued else res.rq_jobs_dropped).append(job_id)


def requeue(
    conn: redis.Redis,
    cfg: RunConfig,
    reasons: Iterable[str] = (),
    sample_ids: Iterable[str] = (),
    all_: bool = False,
    dry_run: bool = False,
) -> RequeueResult:
    """Put the selected failed samples back (and, with `all_`, RQ's failed jobs of the run)."""
    ledger = Ledger(conn, cfg.run)
    res = RequeueResult(dry_run=dry_run)
    if all_:
        # First: a job RQ failed holds samples still `q`; after the ledger requeue below they would
        # be `q` too, and the job would look like one to put back.
        _rq_failed_jobs(conn, cfg.run, res)
    chosen = select_failed(ledger, reasons, sample_ids, all_)
    if dry_run:
        kept = ledger.failed_payloads(list(chosen))
        res.samples = [sid for sid, row in zip(chosen, kept, strict=False) if row is not None]
        res.no_payload = [sid for sid, row in zip(chosen, kept, strict=False) if row is None]
    else:
        ids = list(chosen)
        for i in range(0, len(ids), CHUNK):
            _requeue_chunk(conn, cfg, ids[i : i + CHUNK], res)
    res.reasons = dict(Counter(chosen[sid].get("reason", "?") for sid in res.samples))
    return res
