"""A harvest job's success in RQ's bookkeeping: one transaction, sent with the worker's next dequeue.

Why. RQ records a job's success in a transaction of its own (the worker idle, the execution gone,
the job deleted), then dequeues the next job: two round trips the fleet's one Redis pays for each
job (bench/fleet.py). Here the success is queued when the job's function returns and sent in one
MULTI/EXEC with the next dequeue (harvest/state/lua/pop_job.lua, an EVAL of its short text), so a job costs
the worker's RQ two round trips, its execution's start and this one.

Who owns what, and for how long: the worker process owns the success it has not sent, from its
job's end to its next dequeue, milliseconds in a worker that goes on at once. It is sent earlier
when anything else comes first: RQ's check of `rq suspend`'s flag (which may sleep), the worker's
end (`register_death`), another success; a worker of more than one queue sends it at once. Until
it is sent, RQ's records show the job started and this process's heartbeat names the execution
and its attempt, as while the job ran (harvest.state.heartbeat `clear_execution(..., now=False)`),
so no janitor pass can see them part. A worker killed meanwhile leaves them so: the janitor puts
the job back when the worker's heartbeat expires, as for a worker killed during its job, and the
job's next run skips its samples, which its settle moved past queued (workers.job), and deletes
it. A send that raised (an outage the client gave up on, a stop signal) keeps the success, and the
worker's end sends it again without a dequeue; one whose EXEC ran before the raise is then written
twice: the deletes change nothing, `jobs_done` and RQ's counters count that job twice. A Redis
that loses its last second loses the transaction whole (the success and the dequeue with it): the
job's execution comes back and the next job is queued again, which the janitor reaps or puts back
as any execution or dequeue of a rolled-back Redis; no sample is decided here.

RQ's counters of a worker's jobs (`successful_job_count`, `total_working_time`: shown by `rq info`,
deciding nothing) are added up and written with a success at most every RQ_COUNTS_S, and at the
worker's end: two commands a job fewer, one a float's HINCRBYFLOAT. A worker killed takes its
unwritten seconds of them along; its RQ key goes 60 s after its death anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.results import Result
from rq.worker import SimpleWorker, WorkerStatus

from harvest.state import scripts
from harvest.state.jobs import popped_job

RQ_COUNTS_S = 10.0  # how often RQ's job counters of a worker are written


class LateSuccess(SimpleWorker):
    """The success of a harvest job (no result kept, no repeats, rate limit or group) written in
    one transaction, without RQ's reads, and sent with the next dequeue. For harvest's worker
    class (workers.rqworker.HarvestWorker), whose `beat` is its heartbeat."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unwritten: tuple[int, float] = (0, 0.0)  # successful jobs, working seconds, not yet written
        self._counts_at = time.monotonic()
        # the last success's writes, not yet sent: (queue them on a pipeline, its execution's id)
        self._outcome: tuple[Callable[[redis.client.Pipeline], None], str] | None = None

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry,
                           execution: Execution) -> None:
        """What RQ's own would write for such a job, without its reads: the worker idle, its
        counters (every RQ_COUNTS_S), the execution gone (and the heartbeat no longer naming it),
        the job and its records deleted. RQ also deleted any other execution of the job (a suspect
        worker's, whose job was taken back and ran again here): that one stays until its worker
        ends it, or the janitor drops it, its job being gone (harvest.ops.liveness `_take_back`)."""
        if (job.get_result_ttl(self.default_result_ttl) != 0 or job.repeats_left or job.has_rate_limit
                or job.group_id):
            super().handle_job_success(job, queue, started_job_registry, execution)
            return
        self._send_outcome()  # one left before (none: it went with this job's dequeue)
        counts = self._take_counts((job.ended_at - job.started_at).total_seconds())
        beat = self.beat

        def outcome(pipe: redis.client.Pipeline) -> None:
            self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            if counts is not None:
                self._queue_counts(pipe, counts)
            SimpleWorker.cleanup_execution(self, job, pipe, execution)
            if beat is not None:
                beat.clear_execution(execution.id, pipe, now=False)
            pipe.delete(job.key, job.dependents_key, job.dependencies_key, Result.get_key(job.id),
                        job.execution_registry.key)

        self._outcome = (outcome, execution.id)
        self._state = WorkerStatus.IDLE  # as `outcome` writes it: RQ's own write after the job is then skipped
        if len(self.queues) != 1:  # no dequeue of one queue to send it with
            self._send_outcome()
        job._status = JobStatus.FINISHED
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id, job.ended_at - job.started_at,
                      self.name)

    def _take_counts(self, seconds: float) -> tuple[int, float] | None:
        """The counters to write with this success, if RQ_COUNTS_S passed since the last write."""
        n, t = self._unwritten
        self._unwritten = (n + 1, t + seconds)
        if time.monotonic() - self._counts_at < RQ_COUNTS_S:
            return None
        counts, self._unwritten, self._counts_at = self._unwritten, (0, 0.0), time.monotonic()
        return counts

    def _queue_counts(self, pipe: redis.client.Pipeline, counts: tuple[int, float]) -> None:
        pipe.hincrby(self.key, "successful_job_count", counts[0])
        pipe.hincrbyfloat(self.key, "total_working_time", counts[1])

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):
        """The last job's success and the next job's dequeue in one MULTI/EXEC; RQ's own dequeue (a
        blocking wait where the queue is empty) after it, or where there is no success to send."""
        if self._outcome is not None and len(self.queues) == 1:
            queue = self.queues[0]
            got = self._send_outcome(queue)
            if isinstance(got, Job):  # as RQ's own dequeue leaves it (one queue: nothing to reorder)
                got.redis_server_version = self.get_redis_server_version()
                self.log.info("Worker %s: %s: %s", self.name, queue.name, got.id)
                return got, queue
            if got is None and timeout is None:  # the queue was empty: a burst worker is done
                return None
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def _send_outcome(self, queue: Queue | None = None) -> Job | None | bool:
        """Send the success left by the last job, if any, with `queue`'s dequeue. Returns the job
        dequeued; None when the queue was empty; False when nothing was dequeued otherwise (none
        asked, no success to send, the job's hash gone: RQ skips such a job, and its own dequeue
        goes on). The success is forgotten only once sent."""
        if self._outcome is None:
            return False
        outcome, execution_id = self._outcome
        with self.connection.pipeline() as pipe:
            outcome(pipe)
            if queue is not None:
                scripts.pop_job(queue.key, queue.intermediate_queue_key).queue(pipe)
            got = pipe.execute()[-1]
        self._outcome = None
        if self.beat is not None:
            self.beat.execution_cleared(execution_id)
        if queue is None:
            return False
        if not got:
            return None
        return popped_job(queue, self.connection, self.job_class, self.serializer, got) or False

    def check_for_suspension(self, burst: bool) -> None:
        """RQ's, which sleeps while `rq suspend`'s flag is set: a success left goes first."""
        self._send_outcome()
        super().check_for_suspension(burst)

    def register_death(self) -> None:
        """RQ's, after the last job's success and the counters not yet written."""
        try:
            try:
                self._send_outcome()
            except redis.RedisError as e:  # a Redis given up: RQ's own writes below fail the same way
                self.log.warning("Worker %s: its last job's success was not recorded (%s)", self.name, e)
            if self._unwritten[0]:
                try:
                    with self.connection.pipeline() as pipe:
                        self._queue_counts(pipe, self._unwritten)
                        pipe.execute()
                except redis.RedisError as e:
                    self.log.warning("Worker %s: its job counters were not written (%s)", self.name, e)
        finally:
            super().register_death()
