"""A job's success is recorded in RQ's transaction with the worker's next dequeue
(workers.success.LateSuccess), one round trip a job fewer, or first where something else comes
first (RQ's suspension check, the worker's end): until then RQ's records show the job started and
the heartbeat, beats included, names it, as while it ran, so no pass of the janitor sees them part."""

import numpy as np
import pytest
from rq.utils import now

from harvest.config import RunConfig
from harvest.sample import Sample
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import SERIALIZER, fetch_job, run_queue
from harvest.state.runstore import publish_run
from tests.support.ops import enqueue
from workers.rqworker import HarvestWorker
from workers.safejob import HarvestJob


@pytest.fixture
def ran(conn, tmp_path):
    """A worker whose first job ran and succeeded (RQ's `handle_job_success`), a second queued."""
    cfg = publish_run(conn, RunConfig(run="jo", model="/m", capture_points=[2], hidden_size=4,
                                      out_url=str(tmp_path / "out")))
    first, second = (enqueue(conn, cfg, [Sample.build(np.arange(i + 2))]) for i in range(2))
    beat = WorkerBeat(conn, cfg.run, "n-1-aaaaaa", "n", "http://127.0.0.1:1")
    beat.start()
    queue = run_queue(conn, cfg.run, job_class=HarvestJob)
    worker = HarvestWorker([queue], connection=conn, serializer=SERIALIZER, name=beat.name, job_class=HarvestJob,
                           beat=beat)
    worker.register_birth()
    job, _ = worker.dequeue_job_and_maintain_ttl(None)
    assert job.id == first
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    job.started_at = job.ended_at = now()
    worker.handle_job_success(job, queue, queue.started_job_registry, execution)
    yield worker, queue, beat, job, second
    beat.stop()


def _records(conn, queue, beat, job) -> tuple:
    """What RQ and the heartbeat say of `job`: its hash, the started registry, the heartbeat's job."""
    started = [m.decode().split(":")[0] for m in conn.zrange(queue.started_job_registry.key, 0, -1)]
    return bool(conn.exists(job.key)), started, conn.hget(beat.key, "job").decode(), conn.hget(beat.key, "state").decode()


def test_a_success_goes_with_the_next_dequeue_in_one_transaction(conn, ran):
    worker, queue, beat, job, second = ran
    beat.beat()  # a beat meanwhile says what it said while the job ran
    assert _records(conn, queue, beat, job)[:3] == (True, [job.id], job.id)
    execs = conn.info("commandstats")["cmdstat_exec"]["calls"]
    got, _ = worker.dequeue_job_and_maintain_ttl(None)
    assert got.id == second and got.func_name == fetch_job(conn, second).func_name
    assert _records(conn, queue, beat, job) == (False, [], "", "idle")
    assert conn.hget(beat.key, "jobs_done") == b"1"
    assert conn.info("commandstats")["cmdstat_exec"]["calls"] == execs + 1  # one transaction
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == [second.encode()]  # RQ's dequeue, as before


def test_a_burst_worker_that_finds_the_queue_empty_stops_without_another_dequeue(conn, ran):
    worker, queue, beat, job, second = ran
    conn.lrem(queue.key, 1, second)
    pops = conn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert worker.dequeue_job_and_maintain_ttl(None) is None
    assert _records(conn, queue, beat, job) == (False, [], "", "idle")
    assert conn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) == pops


def test_the_workers_end_records_a_success_left(conn, ran):
    worker, queue, beat, job, _ = ran
    worker.register_death()
    assert _records(conn, queue, beat, job) == (False, [], "", "idle")
    assert conn.hget(worker.key, "successful_job_count") == b"1"  # RQ's counter, written at the end


def test_a_job_whose_hash_is_gone_is_skipped_as_rqs_own_dequeue_skips_it(conn, ran):
    worker, queue, beat, job, second = ran
    conn.delete(f"rq:job:{second}")  # a late worker's success deleted it, its id queued again
    assert worker.dequeue_job_and_maintain_ttl(None) is None  # skipped, then the queue is empty
    assert _records(conn, queue, beat, job) == (False, [], "", "idle")


def test_rqs_suspension_check_which_may_sleep_sends_a_success_left_first(conn, ran):
    worker, queue, beat, job, _ = ran
    worker.check_for_suspension(burst=True)
    assert _records(conn, queue, beat, job) == (False, [], "", "idle")
    assert conn.hget(beat.key, "jobs_done") == b"1"
