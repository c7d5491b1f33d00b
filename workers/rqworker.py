"""The RQ worker class harvest runs: RQ's SimpleWorker, with no liveness decided by this node's clock.

Why. RQ 3.0 stamps a started execution with the starting worker's clock (score `now + job.timeout
+ 60` in the queue's StartedJobRegistry) and lets any worker's maintenance compare that score
with *its own* clock. A node whose clock ran 2 h ahead therefore moved another node's running
job to the FailedJobRegistry; when that job's worker later died nobody took it back (it was no
longer "started") and its samples stayed queued with no job. Harvest's janitor
(harvest.ops.janitor, harvest.ops.liveness) decides liveness from heartbeat TTLs and Redis's
`TIME` only, so this class leaves every decision of that kind to it.

Who owns what:
- this worker: the executions it starts and ends (RQ's own bookkeeping, unchanged), and naming
  them in its harvest heartbeat in the same transaction (`prepare_execution`,
  `cleanup_execution`), so a started execution of a live worker is never unnamed;
- harvest's janitor, on every worker, under a run lock: executions of dead workers (heartbeat
  gone, by Redis's TTL) and suspect ones (a live worker naming another job for a grace, by
  Redis's TIME); jobs stuck in RQ's intermediate list; due retries; registry expiry;
  stranded samples (harvest.ops.stranded);
- nobody: RQ's scheduler process (harvest runs none).

RQ's comparisons of a stored time with the local clock, and what happens to each here:

| RQ 3.0 | what the local clock decided | here |
|---|---|---|
| `StartedJobRegistry.cleanup` (maintenance, `clean_registries`) | another node's running execution is abandoned: retried or failed | off; the janitor reaps by heartbeat TTL and takes suspects back after a grace by Redis TIME |
| `FailedJobRegistry`, `FinishedJobRegistry.cleanup` (same) | failed jobs (requeue's and the stranded sweep's payload rows) dropped early | off; pruned by the janitor by Redis TIME |
| `IntermediateQueue.cleanup` (same; first seen stamped with the local clock, kept 24 h) | a job another worker just dequeued is failed | off; the janitor puts back a job dequeued for a grace without an execution, by Redis TIME |
| `clean_worker_registry` (same) | nothing: worker keys that expired (Redis TTL) | kept |
| `Group.clean_registries`, `ReadyJobRegistry`, rate limits (same) | groups, dependencies, rate limits: harvest uses none | off |
| `RQScheduler` (`with_scheduler`) | scheduled jobs due by the local clock | never started; the janitor promotes by Redis TIME |
| `Job._handle_retry_result` (a job returning `Retry`) | the retry's due time, `now() + interval`: 2 h late from a node 2 h ahead | re-stamped by Redis TIME right after (`handle_job_retry`); the janitor also treats an absurdly distant due time as due |

Safe because: every disabled cleanup either removed records that the janitor now removes by
Redis's clock, or decided liveness, which only harvest's heartbeats (TTL) decide. What remains
on the local clock compares this process with itself (the maintenance cadence, the double
signal within 1 s, the job's own timeout by SIGALRM) or is only recorded (`started_at`,
`ended_at`, RQ's `last_heartbeat` fields), never compared by another node.
"""

from __future__ import annotations

import math

import redis
from rq import Retry, SimpleWorker, worker_registration
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.utils import now
from rq.worker import WorkerStatus

from harvest.state.heartbeat import WorkerBeat, live_beat
from harvest.state.spools import redis_time


class HarvestWorker(SimpleWorker):
    def __init__(self, *args, beat: WorkerBeat | None = None, **kwargs) -> None:
        """`beat`: this worker's harvest heartbeat; by default the one this process started under
        the worker's name (harvest.state.heartbeat.live_beat)."""
        super().__init__(*args, **kwargs)
        self._beat = beat

    @property
    def beat(self) -> WorkerBeat | None:
        return self._beat if self._beat is not None else live_beat(self.name)

    # -- maintenance: only what no clock decides -----------------------------------------------
    def run_maintenance_tasks(self) -> None:
        """No scheduler to restart and no group registries: only `clean_registries`, below."""
        self.clean_registries()

    def clean_registries(self) -> None:
        """Only forget worker keys that expired (by Redis's TTL); see the module docstring for
        the registry, intermediate-list and group cleanups this leaves to harvest's janitor."""
        for queue in self.queues:
            worker_registration.clean_worker_registry(queue)
        self.last_cleaned_at = now()  # this process's own cadence, compared with nothing else

    def clean_group_registries(self) -> None:
        """Harvest enqueues no groups; RQ's cleanup would expire members by this node's clock."""

    def _start_scheduler(self, *args, **kwargs) -> None:
        """Harvest runs no RQ scheduler: due retries are the janitor's, by Redis's clock."""
        self.log.warning("Worker %s: RQ's scheduler is not started: harvest's janitor releases due retries",
                         self.name)

    # -- executions named in the heartbeat, in RQ's own transactions ----------------------------
    def prepare_execution(self, job: Job) -> Execution:
        """RQ's `prepare_execution` (the execution, the started registry entry, the worker's busy
        state, one MULTI/EXEC), with the harvest heartbeat naming the execution in the same
        transaction: no pass of the janitor can see it started and unnamed."""
        with self.connection.pipeline() as pipeline:
            execution = Execution.create(job, self.get_heartbeat_ttl(job), pipeline=pipeline, worker_name=self.name)
            self.executions[execution.id] = execution
            self.set_state(WorkerStatus.BUSY, pipeline=pipeline)
            beat = self.beat
            if beat is not None:
                beat.name_execution(job.id, execution.id, pipeline)
            pipeline.execute()
        return execution

    def cleanup_execution(self, job: Job, pipeline, execution: Execution | None = None) -> None:
        """RQ removes the execution in `pipeline` (its success, failure or retry transaction); the
        heartbeat stops naming it in the same one."""
        super().cleanup_execution(job, pipeline, execution)
        beat = self.beat
        if beat is not None and execution is not None:
            beat.clear_execution(execution.id, pipeline)

    def handle_job_retry(self, job: Job, queue: Queue, retry: Retry, started_job_registry: StartedJobRegistry,
                         execution: Execution) -> None:
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
