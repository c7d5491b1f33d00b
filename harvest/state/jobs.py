"""The RQ job contract: the only module that builds a run's queue and enqueues harvest jobs.

A harvest job is one RQ job per batch of samples: the function `JOB_FUNCTION` (named by string,
so enqueuers never import the workers) called with one JSON payload (harvest.state.payload).
JSON, never pickle, crosses Redis, and a worker runs no other function (harvest.workers.safejob).

The producer's first enqueue, `harvest requeue` and the janitor's re-enqueues all go through
here, so a requeued job can never carry other options than a produced one.
"""

from __future__ import annotations

import zlib

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from harvest.sample import Sample
from harvest.state.keys import Keys
from harvest.state.payload import encode_batch, encode_ref

JOB_FUNCTION = "harvest.workers.job.process_batch"
SERIALIZER = JSONSerializer
JOB_FAILURE_TTL = 7 * 24 * 3600  # RQ's failed registry keeps a failed job this long (for requeue)
RESULT_TTL = 0  # results are in the ledger; RQ keeps none


MAX_RETRY_INTERVAL_S = 300  # the longest backoff between a job's retries (harvest.workers.job.backoff_intervals)


TURN_TIMEOUT_S = 600  # a --regenerate job's allowance per turn: its conversations' turns are written at once


def job_timeout(num_tokens: int, turns: int = 0) -> int:
    """Generous: a job is an engine call plus file moves; RQ kills it past this. A --regenerate job
    first writes its conversations' `turns` (the most any of them has), one after another."""
    return 600 + num_tokens // 50 + TURN_TIMEOUT_S * turns


DATA_ZLIB_LEVEL = 1


class PayloadJob(Job):
    """RQ's job, with its data (the JSON payload) zlib-compressed at level 1 instead of RQ's
    default 6: several times faster for a few percent more bytes (bench/enqueue.py). Readers need
    nothing of it: RQ's `restore` decompresses any level."""

    # RQ's: test_rq_contract test_a_job_enqueued_as_harvest_does_is_a_hash_whose_data_the_job_copy_reads
    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict:
        data = self.data
        self._data = b""  # RQ compresses `data` itself, at its level: give it nothing to compress
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        obj["data"] = zlib.compress(data, DATA_ZLIB_LEVEL)
        return obj


def run_queue(conn: redis.Redis, run: str, job_class: type[Job] = PayloadJob) -> Queue:
    """The run's RQ queue. Workers pass their job class (harvest.workers.safejob, a PayloadJob);
    everyone else reads or enqueues with `PayloadJob`."""
    return Queue(Keys(run).queue_name, connection=conn, serializer=SERIALIZER, job_class=job_class)


def enqueue_samples(
    queue: Queue, run: str, samples: list[Sample], job_id: str, pipe: redis.client.Pipeline, rows: dict | None = None
) -> None:
    """Add one job for `samples` to `pipe` (the caller's MULTI/EXEC, with its ledger moves).
    `rows`: where the samples' rows are in storage (the producer's jobs, harvest.formats.jobrows),
    named instead of carried. The description is given: RQ's default is the repr of the call, the
    whole payload again."""
    queue.enqueue_call(
        JOB_FUNCTION,
        args=(encode_batch(run, samples) if rows is None else encode_ref(run, rows, [s.id for s in samples]),),
        description=f"{JOB_FUNCTION}: {len(samples)} samples of run {run}",
        job_id=job_id,
        timeout=job_timeout(sum(s.num_tokens for s in samples), max(s.conv.turns if s.conv else 0 for s in samples)),
        result_ttl=RESULT_TTL,
        failure_ttl=JOB_FAILURE_TTL,
        pipeline=pipe,
    )


def fetch_job(conn: redis.Redis, job_id: str) -> Job:
    """A job by id (raises rq.exceptions.NoSuchJobError)."""
    return Job.fetch(job_id, connection=conn, serializer=SERIALIZER)
