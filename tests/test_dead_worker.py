"""Dead and stopped workers, with real processes: a SIGKILLed worker's job is taken back by the
janitor of another worker and done by it within 60 s, nothing doubled; SIGTERM finishes the
current job and exits.

To catch a worker in the middle of a job deterministically, the tests use the spool
backpressure: a worker whose node spool is over `--max-spool-mb` waits inside its job (job
started, samples queued) until the spool drains; a placeholder spool file holds it there."""

from __future__ import annotations

import os
import time

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.demo import demo_rows, write_jsonl
from harvest.heartbeat import read_workers
from harvest.janitor import run_queue
from harvest.keys import Keys
from harvest.ledger import Ledger
from harvest.payload import decode_batch
from harvest.reader import RunReader
from tests.ops_support import Procs, cli, new_run, wait_until

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
    worker_args = ["worker", "--run", run, "--redis", redis_server.url, "--engine-url", url, "--dump-dir", dumps,
                   "--spool-dir", spool]
    return cfg, dumps, spool, blocker, worker_args


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

    wait_until(job_done, RECOVERY_BOUND_S,
               f"the samples of job {job_id}, whose worker was SIGKILLed, spooled by another worker")
    recovered = time.monotonic() - killed_at
    print(f"\nSIGKILLed worker's job done by another worker {recovered:.1f}s after the kill")
    wait_until(lambda: not os.path.exists(claim_dir), 60, f"the dead worker's claim dir {claim_dir} removed")

    procs.start("collector", "collect", "--run", run, "--redis", redis_server.url, "--spool-dir", spool, "--max-wait", "1")
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
    assert wait_until(lambda: sorted(os.listdir(spool)) == [], 30, "spool drained")


def test_sigterm_finishes_the_current_job_and_exits(tmp_path, conn, redis_server, tiny_model, procs):
    run = "termw"
    cfg, dumps, spool, blocker, worker_args = _setup(tmp_path, conn, redis_server, tiny_model, procs, run)
    led = Ledger(conn, run)
    total = led.counts()["total"]
    a = procs.start("worker-a", *worker_args, "--max-spool-mb", "1")
    w = _busy_worker(conn, run)
    mine = _job_samples(conn, w["job"])
    a.terminate()  # SIGTERM, as docker stop sends
    time.sleep(1.0)
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
