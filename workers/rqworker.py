"""The RQ worker class harvest runs: RQ's SimpleWorker, with no liveness decided by this node's
clock, and each execution it starts or ends named in its harvest heartbeat in the same transaction.

Who owns what:
- this worker: the executions it starts and ends, with RQ's own bookkeeping; its heartbeat names
  an execution in the MULTI/EXEC that creates it (`prepare_execution`) and stops naming it in the
  one that records the job's outcome (`cleanup_execution`), so no janitor pass sees them part;
- harvest's janitor (harvest.ops.janitor, harvest.ops.liveness), under a run lock, by heartbeat
  TTLs and Redis's `TIME` only: executions of dead or suspect workers, jobs left in RQ's
  intermediate list, due retries, registry expiry, stranded samples (harvest.ops.stranded);
- nobody: RQ's scheduler (harvest never starts it).

RQ 3.0's comparisons of a stored time with this node's clock, and what happens to each here:
- `clean_registries`: the started, failed and finished registries' and the intermediate list's
  cleanups are off (the janitor reaps and prunes by heartbeat TTL and Redis TIME); only
  `clean_worker_registry` (worker keys expired by Redis's TTL) runs;
- a job returning `Retry` is due at `now() + interval`: re-stamped by Redis TIME (`handle_job_retry`).

Why: any worker's maintenance compares RQ's stamps with its own clock, so a node whose clock runs
ahead fails other nodes' running jobs. What remains on the local clock compares this process with
itself (maintenance cadence, the job's SIGALRM timeout) or is only recorded, never compared.
"""

from __future__ import annotations

import math
import time
from types import FrameType
from typing import Any

import redis
from rq import Retry, worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.results import Result
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

from harvest.ids import new_attempt
from harvest.state.heartbeat import WorkerBeat, live_beat
from harvest.state.jobs import JOB_FUNCTION
from harvest.state.ledger import state_letter
from harvest.state.payload import batch_ids
from harvest.state.spools import redis_time
from harvest.workers.context import JobStart, WorkerContext, installed

PUBSUB_POLL_S = 1.0  # how long RQ's command thread waits between looks at its stop flag


class HarvestWorker(SimpleWorker):
    def __init__(self, *args: Any, beat: WorkerBeat | None = None, **kwargs: Any) -> None:
        """`beat`: this worker's harvest heartbeat; by default the one this process started under
        the worker's name (harvest.state.heartbeat.live_beat)."""
        super().__init__(*args, **kwargs)
        self._beat = beat
        self._rq_beat_at = -math.inf  # monotonic time of RQ's last worker heartbeat sent on its own
        self._cold_stop = False  # a cold stop (SystemExit) was raised: later signals change nothing

    # RQ's signal handler: test_rq_contract test_harvest_overrides_exactly_these_rq_methods_with_rqs_parameters
    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        """RQ's cold stop, honoured once. `harvest run` repeats a hurried stop's SIGTERM until the
        worker exits (RQ ignores one within 1 s of handling the first, and the runner cannot tell
        when that ran); a repeat must not interrupt the job's hand-back (harvest.workers.job)."""
        if self._cold_stop:
            return
        try:
            super().request_force_stop(signum, frame)  # returns when within 1 s of the first signal
        except SystemExit:
            self._cold_stop = True
            raise

    # RQ's, for its poll (no setting): test_rq_contract test_the_rq_attributes_harvest_reads_and_sets_exist
    def subscribe(self) -> None:
        """RQ's, with its command thread polling every PUBSUB_POLL_S instead of RQ's 60 s. Why:
        redis-py's `PubSubWorkerThread.stop` waits for the thread, so a worker's exit (and its
        heartbeat's end) would wait that long. The poll sends nothing to Redis."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    # RQ's; the same records: test_rq_contract test_harvests_execution_start_and_heartbeat_write_what_rqs_do
    def heartbeat(self, timeout: int | None = None, pipeline: redis.client.Pipeline | None = None) -> None:
        """RQ's worker heartbeat: in RQ's own transaction as RQ sends it; on its own at most every
        `worker_ttl / 6` s, its three commands in one round trip. Why: RQ sends it three times a
        job, a round trip a command; only `rq info` reads it, and the worker key's TTL
        (worker_ttl + 60 s) is far from running out between two."""
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            return
        t = time.monotonic()
        if t - self._rq_beat_at < self.worker_ttl / 6:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            pipe.execute()
        self._rq_beat_at = t

    @property
    def beat(self) -> WorkerBeat | None:
        return self._beat if self._beat is not None else live_beat(self.name)

    # -- maintenance: only what no clock decides -----------------------------------------------
    # RQ's; the worker registry it keeps: test_rq_contract test_a_worker_registers_where_the_janitor_forgets_it
    def clean_registries(self) -> None:
        """Only forget worker keys that expired (by Redis's TTL); see the module docstring for
        the registry, intermediate-list and group cleanups this leaves to harvest's janitor."""
        for queue in self.queues:
            worker_registration.clean_worker_registry(queue)
        self.last_cleaned_at = now()  # this process's own cadence, compared with nothing else

    # -- executions named in the heartbeat, in RQ's own transactions ----------------------------
    # RQ's; the same records: test_rq_contract test_harvests_execution_start_and_heartbeat_write_what_rqs_do
    def prepare_execution(self, job: Job) -> Execution:
        """RQ's (the execution, its started-registry entry, the worker busy, in one MULTI/EXEC), with
        the harvest heartbeat naming the execution in the same transaction, so no janitor pass sees
        it started and unnamed. A harvest job's start goes in it too (`_start_of`): its new attempt
        named by the heartbeat, before the engine gets any request of it, and its samples' states
        read, which the job takes up (WorkerContext.started). A Redis that loses its last second
        loses this transaction whole: the worker's next beat names the attempt again from its
        memory, and the janitor puts back the job left dequeued with no execution."""
        beat = self.beat
        ctx, ids = self._start_of(job, beat)
        start = JobStart(new_attempt(), {}, ctx.recovery_generation()) if ctx is not None else None
        with self.connection.pipeline() as pipeline:
            execution = Execution.create(job, self.get_heartbeat_ttl(job), pipeline=pipeline, worker_name=self.name)
            self.executions[execution.id] = execution
            self.set_state(WorkerStatus.BUSY, pipeline=pipeline)
            if beat is not None:
                beat.name_execution(job.id, execution.id, pipeline, start=(len(ids), start.attempt) if start else None)
            if start is not None:
                pipeline.hmget(ctx.ledger.keys.state, ids)
            try:
                replies = pipeline.execute()
            except BaseException:
                if start is not None and beat is not None:
                    beat.drop_start()
                raise
        if ctx is not None and start is not None:
            ctx.started[job.id] = start._replace(states=dict(zip(ids, map(state_letter, replies[-1]), strict=False)))
        return execution

    def _start_of(self, job: Job, beat: WorkerBeat | None) -> tuple[WorkerContext | None, list[str]]:
        """The worker context and the sample ids of a harvest job whose start (its attempt named in
        the heartbeat, its samples' states read: harvest.workers.job `BatchJob.choose`) rides in the
        transaction that starts its execution: one round trip a job less. (None, []) where the job
        does it itself: no context, another heartbeat than the context's, no sample, or a job whose
        data cannot be read or that will be refused (harvest.workers.safejob): RQ's own path fails it.
        A SimpleWorker runs one job at a time: a start left by a job whose function never
        ran (refused, a stop between) is dropped here."""
        ctx = installed()
        if ctx is None or beat is None or ctx.beat is not beat:
            return None, []
        ctx.started.clear()
        try:
            if job.func_name != JOB_FUNCTION or job.instance is not None:
                return None, []
            ids = batch_ids(job.args[0])
        except Exception:  # noqa: BLE001  # undeserializable data, a payload naming no ids: RQ fails the job
            return None, []
        return (ctx, ids) if ids else (None, [])

    # RQ's: test_rq_contract test_an_execution_is_a_job_colon_execution_entry_and_a_hash_naming_its_worker
    def cleanup_execution(self, job: Job, pipeline: redis.client.Pipeline, execution: Execution | None = None) -> None:
        """RQ removes the execution in `pipeline` (its success, failure or retry transaction); the
        heartbeat stops naming it in the same one."""
        super().cleanup_execution(job, pipeline, execution)
        beat = self.beat
        if beat is not None and execution is not None:
            beat.clear_execution(execution.id, pipeline)

    # RQ's; the same records: test_rq_contract test_harvests_success_leaves_what_rqs_own_leaves
    def handle_job_success(
        self, job: Job, queue: Queue, started_job_registry: StartedJobRegistry, execution: Execution
    ) -> None:
        """RQ's writes for a harvest job's success, in one MULTI/EXEC without RQ's reads: RQ's
        counters, the execution gone (and no longer named: `cleanup_execution`), the job and its
        records deleted. Why: RQ's own watches the dependents and reads the job's executions first,
        round trips a job that harvest's jobs (no result kept, no dependents, repeats, rate limit or
        group) do not need; a job that has any of them goes RQ's own way."""
        if job.get_result_ttl(self.default_result_ttl) != 0 or job.repeats_left or job.has_rate_limit or job.group_id:
            super().handle_job_success(job, queue, started_job_registry, execution)
            return
        with self.connection.pipeline() as pipe:
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
            self.cleanup_execution(job, pipe, execution)
            pipe.delete(
                job.key, job.dependents_key, job.dependencies_key, Result.get_key(job.id), job.execution_registry.key
            )
            pipe.execute()
        job._status = JobStatus.FINISHED
        self.log.info(
            "Successfully completed job %s in %ss on worker %s", job.id, job.ended_at - job.started_at, self.name
        )

    # RQ's; the retry's interval: test_rq_contract test_a_failed_job_is_counted_and_a_retry_waits_its_interval
    def handle_job_retry(
        self, job: Job, queue: Queue, retry: Retry, started_job_registry: StartedJobRegistry, execution: Execution
    ) -> None:
        """RQ schedules the retry at this node's `now() + interval`; stamp it again with Redis's
        TIME, so a node whose clock runs ahead does not hold the job (and its samples) back for
        hours, nor one that runs behind release it at once. Between the two writes the janitor
        may already have released it (the ZADD below then changes nothing)."""
        interval = Retry.get_interval(job.number_of_retries or 0, retry.intervals)
        super().handle_job_retry(job, queue, retry, started_job_registry, execution)
        if interval and job.get_status(refresh=False) == JobStatus.SCHEDULED:
            try:
                due = math.ceil(redis_time(self.connection)) + interval
                self.connection.zadd(queue.scheduled_job_registry.key, {job.id: due}, xx=True)
            except redis.RedisError as e:  # the retry stands as RQ wrote it; the janitor bounds how far ahead
                self.log.warning("Worker %s: job %s: retry not re-stamped by Redis time (%s)", self.name, job.id, e)
