"""A job's start rides in RQ's transaction that starts its execution
(harvest.workers.rqworker.HarvestWorker.prepare_execution): the heartbeat names the job's attempt and the
ledger's states of its samples are read there, and the job takes both up without a round trip of
its own, unless this process found a new Redis since and the ledger was reconciled on it: then it
reads the states again under a new attempt. RQ's outcome leaves the heartbeat idle however the job
ended; a job with no sample, or one RQ refuses, takes no start."""

import numpy as np
import pytest

from harvest.config import RunConfig
from harvest.ops.recovery import Recovery
from harvest.sample import Sample
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import SERIALIZER, fetch_job, run_queue
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.workers.context import WorkerContext, install
from harvest.workers.job import BatchJob
from harvest.workers.rqworker import HarvestWorker
from harvest.workers.safejob import HarvestJob
from tests.support.ops import enqueue


@pytest.fixture
def started(conn, tmp_path):
    cfg = publish_run(
        conn, RunConfig(run="js", model="/m", capture_points=[2], hidden_size=4, out_url=str(tmp_path / "out"))
    )
    samples = [Sample.build(np.arange(i + 2)) for i in range(3)]
    job_id = enqueue(conn, cfg, samples)
    led = Ledger(conn, cfg.run)
    beat = WorkerBeat(conn, cfg.run, "n-1-aaaaaa", "n", "http://127.0.0.1:1")
    beat.start()
    dirs = [tmp_path / d for d in ("dump", "spool", "claim")]
    for d in dirs:
        d.mkdir()
    ctx = WorkerContext(
        conn=conn,
        cfg=cfg,
        engine=None,
        dump_dir=str(dirs[0]),
        spool_dir=str(dirs[1]),
        claim_dir=str(dirs[2]),
        beat=beat,
        recovery=Recovery(conn, cfg),
    )
    install(ctx)
    ctx.check_recovery()  # a running worker's: the ledger known reconciled on this server
    led.mark_done([samples[0].id])  # committed by an earlier run of the job
    worker = HarvestWorker(
        [run_queue(conn, cfg.run, job_class=HarvestJob)],
        connection=conn,
        serializer=SERIALIZER,
        name=beat.name,
        job_class=HarvestJob,
        beat=beat,
    )
    job = fetch_job(conn, job_id)
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job)
    yield ctx, job, execution, samples, led
    install(None)  # type: ignore[arg-type]
    beat.stop()


def test_the_job_takes_up_the_start_made_with_its_execution(conn, started):
    ctx, job, execution, samples, _ = started
    attempt, states, gen = ctx.started[job.id]
    assert states == {samples[0].id: "d", samples[1].id: "q", samples[2].id: "q"} and gen == ctx.recovery_generation()
    named = {k.decode(): v.decode() for k, v in conn.hgetall(ctx.beat.key).items()}
    assert {k: named[k] for k in ("state", "job", "execution", "job_samples", "attempt")} == {
        "state": "busy",
        "job": job.id,
        "execution": execution.id,
        "job_samples": "3",
        "attempt": str(attempt),
    }
    assert float(named["job_started"]) > 0  # stamped by Redis's TIME
    assert fetch_job(conn, job.id).get_status() == "started"

    batch = BatchJob(ctx, job.args[0], job)
    assert ctx.started == {}  # taken up by the job, whatever it does next
    assert batch.load() is None and batch.reconcile() is None
    calls = conn.info("commandstats")["cmdstat_hmget"]["calls"]
    assert [s.id for s in batch.choose()] == [s.id for s in samples[1:]] and batch.attempt_id == attempt
    assert conn.info("commandstats")["cmdstat_hmget"]["calls"] == calls  # no read of its own


def test_a_ledger_reconciled_since_the_start_is_read_again_under_a_new_attempt(conn, started):
    ctx, job, _, samples, led = started
    attempt = ctx.started[job.id][0]
    led.settle_job([samples[1].id], "another-spool", {}, {})  # what the start read is stale now
    # What this process knew reconciled was another server (a failover it had not noticed), and
    # its rate limit is past: the job's check finds the server new, the ledger reconciled on it.
    ctx.recovery._seen, ctx.recovery._last = "a-server-before", float("-inf")
    batch = BatchJob(ctx, job.args[0], job)
    assert batch.load() is None and batch.reconcile() is None
    assert [s.id for s in batch.choose()] == [samples[2].id] and batch.attempt_id != attempt
    assert conn.hget(ctx.beat.key, "attempt").decode() == str(batch.attempt_id)


def test_rqs_outcome_leaves_the_heartbeat_idle_however_the_job_ended(conn, started):
    ctx, job, execution, _, _ = started  # named busy by its start; its function then raised (no end of job)
    with conn.pipeline() as pipe:
        ctx.beat.clear_execution(execution.id, pipe)  # in RQ's failure transaction
        pipe.execute()
    named = {k.decode(): v.decode() for k, v in conn.hgetall(ctx.beat.key).items()}
    assert {k: named[k] for k in ("state", "job", "execution", "job_samples", "attempt")} == {
        "state": "idle",
        "job": "",
        "execution": "",
        "job_samples": "0",
        "attempt": "",
    }


@pytest.mark.parametrize("case", ["no sample", "another function", "another heartbeat"])
def test_no_start_where_the_job_makes_its_own_or_rq_fails_it(conn, started, case):
    ctx, job, _, _, _ = started
    worker = HarvestWorker(
        [run_queue(conn, ctx.cfg.run, job_class=HarvestJob)],
        connection=conn,
        serializer=SERIALIZER,
        name=ctx.beat.name,
        job_class=HarvestJob,
        beat=ctx.beat,
    )
    beat = ctx.beat
    if case == "no sample":
        job.args = ({**{k: v for k, v in job.args[0].items() if k != "samples"}, "ids": []},)
    elif case == "another function":
        job.func_name = "os.system"
    else:
        beat = WorkerBeat(conn, ctx.cfg.run, "n-2-bbbbbb", "n", "http://127.0.0.1:1")
    assert worker._start_of(job, beat) == (None, [])
    if case != "another heartbeat":  # what a job left (its function never ran) goes with the next start
        assert ctx.started == {}
