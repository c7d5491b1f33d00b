"""Dead and stopped workers, with real processes: a SIGKILLed worker's job is taken back by the
janitor of another worker and done by it within 60 s, nothing doubled; SIGTERM finishes the
current job and exits.

To catch a worker in the middle of a job deterministically, the tests use the spool
backpressure: a worker whose node spool is over `--max-spool-mb` waits inside its job (job
started, samples queued) until the spool drains; a placeholder spool file holds it there."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.read.reader import RunReader
from harvest.state.heartbeat import read_workers
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys, rq_worker_key
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from tests.support.ops import Procs, cli, new_run, wait_until

RECOVERY_BOUND_S = 60  # the functional bound: SIGKILL -> the job done by another worker


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _setup(tmp_path, conn, redis_server, tiny_model, procs, run):
    cfg = new_run(conn, run, tiny_model, f"file://{tmp_path}/out", batch=3)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(9, seed=3))
    res = cli("produce", data, "--run", run, "--redis", redis_server.url)
    assert res.returncode == 0, res.stdout + res.stderr
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    os.makedirs(spool)
    blocker = os.path.join(spool, "f" * 32 + ".safetensors")  # spool over the limit: workers wait in their job
    with open(blocker, "wb") as f:
        f.write(b"\0" * (2 << 20))
    url = procs.engine("engine", tiny_model, dumps)
    worker_args = [
        "worker",
        "--run",
        run,
        "--redis",
        redis_server.url,
        "--engine-url",
        url,
        "--dump-dir",
        dumps,
        "--spool-dir",
        spool,
    ]
    return cfg, dumps, spool, blocker, worker_args


def _warm_stop_recorded(conn, name: str) -> None:
    """Until RQ has handled a worker's SIGTERM in the middle of its job (it records the request's date)."""
    wait_until(
        lambda: conn.hget(rq_worker_key(name), "shutdown_requested_date"),
        60,
        f"worker {name} handling SIGTERM (RQ's shutdown_requested_date)",
    )


def _busy_worker(conn, run) -> dict:
    def busy():
        alive, _ = read_workers(conn, run)
        return next((w for w in alive if w["state"] == "busy"), None)

    return wait_until(busy, 60, "a worker busy with a job")


def _job_samples(conn, job_id) -> list[str]:
    from rq.job import Job

    _, samples = decode_batch(Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args[0])
    return [s.id for s in samples]


def test_sigkilled_workers_job_is_done_by_another_worker_within_60s(tmp_path, conn, redis_server, tiny_model, procs):
    run = "deadw"
    cfg, dumps, spool, blocker, worker_args = _setup(tmp_path, conn, redis_server, tiny_model, procs, run)
    led = Ledger(conn, run)
    total = led.counts()["total"]
    assert total >= 6

    a = procs.start("worker-a", *worker_args, "--max-spool-mb", "1")
    w = _busy_worker(conn, run)
    job_id, claim_dir = w["job"], os.path.join(dumps, f".claimed-{w['name']}")
    mine = _job_samples(conn, job_id)
    assert os.path.isdir(claim_dir)
    assert run_queue(conn, run).started_job_registry.get_job_ids(cleanup=False) == [job_id]

    a.kill()  # SIGKILL: no cleanup of any kind
    a.wait()
    killed_at = time.monotonic()
    os.unlink(blocker)
    procs.start("worker-b", *worker_args)

    def job_done():
        return all(st in ("s", "d") for st in led.states(mine))

    wait_until(
        job_done,
        RECOVERY_BOUND_S,
        f"the samples of job {job_id}, whose worker was SIGKILLed, spooled by another worker",
    )
    recovered = time.monotonic() - killed_at
    print(f"\nSIGKILLed worker's job done by another worker {recovered:.1f}s after the kill")
    wait_until(lambda: not os.path.exists(claim_dir), 60, f"the dead worker's claim dir {claim_dir} removed")

    procs.start(
        "collector", "collect", "--run", run, "--redis", redis_server.url, "--spool-dir", spool, "--max-wait", "1"
    )
    wait_until(lambda: led.counts()["done"] == total, 120, "every sample done")
    assert led.counts() == {"queued": 0, "spooled": 0, "done": total, "failed": 0, "total": total}
    reader = RunReader(f"file://{tmp_path}/out/{run}")
    assert sorted(reader.sample_ids) == sorted(k.decode() for k in conn.hkeys(Keys(run).state))
    assert len(reader.sample_ids) == len(set(reader.sample_ids)) == total  # nothing doubled
    assert led.stats()["jobs_reaped"] == 1
    q = run_queue(conn, run)
    assert (q.count, q.failed_job_registry.count) == (0, 0)
    alive, dead = read_workers(conn, run)
    assert w["name"] not in [x["name"] for x in alive] and dead == []  # the dead worker is forgotten
    assert wait_until(lambda: sorted(os.listdir(spool)) == [".spool-id"], 30, "spool drained")


def test_sigterm_finishes_the_current_job_and_exits(tmp_path, conn, redis_server, tiny_model, procs):
    run = "termw"
    cfg, dumps, spool, blocker, worker_args = _setup(tmp_path, conn, redis_server, tiny_model, procs, run)
    led = Ledger(conn, run)
    total = led.counts()["total"]
    a = procs.start("worker-a", *worker_args, "--max-spool-mb", "1")
    w = _busy_worker(conn, run)
    mine = _job_samples(conn, w["job"])
    a.terminate()  # SIGTERM, as docker stop sends
    _warm_stop_recorded(conn, w["name"])  # handled in the middle of the job
    time.sleep(1.0)  # a while after it
    assert a.poll() is None  # still finishing its job
    os.unlink(blocker)
    assert procs.wait("worker-a", 60) == 0
    assert led.states(mine) == ["s"] * len(mine)  # the job it held was finished
    c = led.counts()
    assert (c["spooled"], c["queued"]) == (len(mine), total - len(mine))  # and it took no other
    q = Queue(Keys(run).queue_name, connection=conn, serializer=JSONSerializer)
    assert q.started_job_registry.get_job_ids(cleanup=False) == []
    assert read_workers(conn, run) == ([], [])  # a clean exit leaves no heartbeat behind
    assert not os.path.exists(os.path.join(dumps, f".claimed-{w['name']}"))


def _start_as_dead_worker(conn, q, name: str):
    """Let a worker that will never beat take the next job, as a SIGKILLed one leaves it: started,
    with an RQ execution naming it, and no harvest heartbeat."""
    from rq import SimpleWorker

    w = SimpleWorker([q], connection=conn, serializer=JSONSerializer, name=name)
    job, _ = w.dequeue_job_and_maintain_ttl(timeout=1)
    w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return job


def test_janitor_gives_up_after_repeated_deaths_and_requeue_recovers(tmp_path, conn, tiny_model):
    from harvest.ops.janitor import MAX_REAPS, janitor_pass
    from harvest.ops.requeue import requeue
    from harvest.sample import Sample
    from tests.support.ops import enqueue

    cfg = new_run(conn, "reap", tiny_model, f"file://{tmp_path}/out")
    samples = [Sample.build([5, 6, 7]), Sample.build([8, 9])]
    job_id = enqueue(conn, cfg, samples)
    q = run_queue(conn, "reap")
    led = Ledger(conn, "reap")
    for death in range(1, MAX_REAPS + 2):
        assert _start_as_dead_worker(conn, q, f"dead-{death}").id == job_id
        rep = janitor_pass(conn, "reap")
        if death <= MAX_REAPS:
            assert (rep.reaped, rep.gave_up, q.job_ids) == ([job_id], [], [job_id])
            assert led.counts()["queued"] == 2
        else:  # the job that kills its worker every time: its samples fail, with their tokens kept
            assert (rep.reaped, rep.gave_up, q.job_ids) == ([], [job_id], [])
    assert q.started_job_registry.get_job_ids(cleanup=False) == []
    assert q.failed_job_registry.get_job_ids(cleanup=False) == [job_id]
    assert {f["reason"] for f in led.failures().values()} == {"worker-died"}
    assert led.counts() == {"queued": 0, "spooled": 0, "done": 0, "failed": 2, "total": 2}
    assert janitor_pass(conn, "reap").reaped == []  # nothing left to take back

    res = requeue(conn, cfg, all_=True)
    assert (res.rq_jobs_requeued, res.rq_jobs_dropped) == ([], [job_id])  # the ledger holds its samples
    assert sorted(res.samples) == sorted(s.id for s in samples) and len(res.jobs) == 1
    assert q.job_ids == res.jobs and led.counts()["queued"] == 2


def test_janitor_cleans_only_dead_workers_claim_dirs_and_stale_dumps(tmp_path, conn):
    from harvest.ops.janitor import HEARTBEAT_TTL_S, STALE_DUMP_S, clean_dump_dir
    from harvest.state.heartbeat import WorkerBeat

    dump = tmp_path / "dumps"
    dump.mkdir()
    live = WorkerBeat(conn, "r", "live-1", "h", "http://e")
    live.start()
    old = time.time() - HEARTBEAT_TTL_S - 5
    for name in ("live-1", "dead-1", "dead-young"):
        (dump / f".claimed-{name}").mkdir()
        (dump / f".claimed-{name}" / "hv-x.0-4.safetensors").write_bytes(b"x")
    os.utime(dump / ".claimed-live-1", (old, old))
    os.utime(dump / ".claimed-dead-1", (old, old))
    stale, fresh = dump / ("hv-" + "a" * 32 + "-1.0-4.safetensors"), dump / ("hv-" + "b" * 32 + "-1.0-4.safetensors")
    for p in (stale, fresh, dump / "not-ours.bin"):
        p.write_bytes(b"x")
    very_old = time.time() - STALE_DUMP_S - 5
    os.utime(stale, (very_old, very_old))
    os.utime(dump / "not-ours.bin", (very_old, very_old))
    try:
        dirs, files = clean_dump_dir(conn, str(dump))
    finally:
        live.stop()
    assert (dirs, files) == ([".claimed-dead-1"], 1)
    assert sorted(os.listdir(dump)) == sorted([".claimed-dead-young", ".claimed-live-1", fresh.name, "not-ours.bin"])


def test_second_sigterm_hands_the_job_back_at_once(tmp_path, conn, redis_server, tiny_model, procs):
    run = "term2"
    cfg, dumps, spool, blocker, worker_args = _setup(tmp_path, conn, redis_server, tiny_model, procs, run)
    led = Ledger(conn, run)
    total = led.counts()["total"]
    a = procs.start("worker-a", *worker_args, "--max-spool-mb", "1")
    w = _busy_worker(conn, run)
    q = run_queue(conn, run)
    waiting = q.count
    a.terminate()
    _warm_stop_recorded(conn, w["name"])  # the first signal handled (not merely sent) ...
    time.sleep(1.5)  # ... for RQ ignores a repeated signal within 1 s of it
    a.terminate()  # cold shutdown: the job goes back instead of being filed as failed
    assert procs.wait("worker-a", 60) == 0
    assert w["job"] in q.job_ids and q.count == waiting + 1
    assert q.started_job_registry.get_job_ids(cleanup=False) == [] and q.failed_job_registry.count == 0
    assert led.counts() == {"queued": total, "spooled": 0, "done": 0, "failed": 0, "total": total}
    assert led.stats()["job_retries"] == 1


def test_sigterm_while_waiting_for_the_engine_leaves_nothing_behind(tmp_path, conn, redis_server, tiny_model, procs):
    run = "waitstop"
    new_run(conn, run, tiny_model, f"file://{tmp_path}/out")
    dumps = str(tmp_path / "dumps")
    p = procs.start(
        "worker",
        "worker",
        "--run",
        run,
        "--redis",
        redis_server.url,
        "--engine-url",
        "http://127.0.0.1:9",
        "--dump-dir",
        dumps,
        "--spool-dir",
        str(tmp_path / "spool"),
        "--engine-wait",
        "120",
    )
    w = wait_until(
        lambda: next((x for x in read_workers(conn, run)[0] if x["state"] == "waiting for engine"), None),
        60,
        "the worker waiting for its engine",
    )
    assert os.path.isdir(os.path.join(dumps, f".claimed-{w['name']}"))
    p.send_signal(signal.SIGTERM)
    assert procs.wait("worker", 20) == 0
    assert os.listdir(dumps) == [] and read_workers(conn, run) == ([], [])
