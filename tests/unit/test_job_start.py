"""A job's start: RQ's transaction that starts its execution names it in the heartbeat
(workers.rqworker.HarvestWorker.prepare_execution); the job's take names its attempt with the
ledger's states of its samples, in one round trip; RQ's outcome leaves the heartbeat idle however
the job ended."""

import numpy as np
import pytest

from harvest.config import RunConfig
from harvest.ops.recovery import Recovery
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import SERIALIZER, fetch_job, run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import Sample
from harvest.state.runstore import publish_run
from tests.support.ops import enqueue
from workers.context import WorkerContext, install
from workers.job import BatchJob
from workers.rqworker import HarvestWorker
from workers.safejob import HarvestJob


@pytest.fixture
def started(conn, tmp_path):
    cfg = publish_run(conn, RunConfig(run="js", model="/m", capture_points=[2], hidden_size=4,
                                      out_url=str(tmp_path / "out")))
    samples = [Sample.build(np.arange(i + 2)) for i in range(3)]
    job_id = enqueue(conn, cfg, samples)
    led = Ledger(conn, cfg.run)
    beat = WorkerBeat(conn, cfg.run, "n-1-aaaaaa", "n", "http://127.0.0.1:1")
    beat.start()
    dirs = [tmp_path / d for d in ("dump", "spool", "claim")]
    for d in dirs:
        d.mkdir()
    ctx = WorkerContext(conn=conn, cfg=cfg, engine=None, dump_dir=str(dirs[0]), spool_dir=str(dirs[1]),
                        claim_dir=str(dirs[2]), beat=beat, recovery=Recovery(conn, cfg))
    install(ctx)
    ctx.check_recovery()  # a running worker's: the ledger known reconciled on this server
    led.mark_done([samples[0].id])  # committed by an earlier run of the job
    worker = HarvestWorker([run_queue(conn, cfg.run, job_class=HarvestJob)], connection=conn, serializer=SERIALIZER,
                           name=beat.name, job_class=HarvestJob, beat=beat)
    job = fetch_job(conn, job_id)
    execution = worker.prepare_execution(job)
    yield ctx, job, execution, samples, led
    install(None)  # type: ignore[arg-type]
    beat.stop()


def test_the_execution_is_named_when_rq_starts_it_and_the_take_names_the_attempt(conn, started):
    ctx, job, execution, samples, _ = started
    named = {k.decode(): v.decode() for k, v in conn.hgetall(ctx.beat.key).items()}
    assert {k: named[k] for k in ("state", "job", "execution")} == {
        "state": "busy", "job": job.id, "execution": execution.id}
    batch = BatchJob(ctx, job.args[0], job)
    assert batch.load() is None and batch.reconcile() is None
    assert [s.id for s in batch.choose()] == [s.id for s in samples[1:]]
    named = {k.decode(): v.decode() for k, v in conn.hgetall(ctx.beat.key).items()}
    assert {k: named[k] for k in ("job", "execution", "job_samples", "attempt")} == {
        "job": job.id, "execution": execution.id, "job_samples": "3", "attempt": str(batch.attempt_id)}
    assert float(named["job_started"]) > 0  # stamped by Redis's TIME


def test_rqs_outcome_leaves_the_heartbeat_idle_however_the_job_ended(conn, started):
    ctx, _, execution, _, _ = started  # named busy by its start; its function then raised (no end of job)
    with conn.pipeline() as pipe:
        ctx.beat.clear_execution(execution.id, pipe)  # in RQ's failure transaction
        pipe.execute()
    named = {k.decode(): v.decode() for k, v in conn.hgetall(ctx.beat.key).items()}
    assert {k: named[k] for k in ("state", "job", "execution", "job_samples", "attempt")} == {
        "state": "idle", "job": "", "execution": "", "job_samples": "0", "attempt": ""}
