"""`harvest requeue` on real processes: exactly the failed samples come back (once, even with two
requeues at the same time), they finish, and permanent failures stay failed with their reason."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.ops.requeue import requeue
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from harvest.state.runstore import load_run
from tests.support.ops import REPO, Procs, cli, enqueue, new_run, wait_until


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _queued_payload_ids(conn, run) -> list[str]:
    q = Queue(Keys(run).queue_name, connection=conn, serializer=JSONSerializer)
    out = []
    for job_id in q.job_ids:
        out += [s.id for s in decode_batch(Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args[0])[1]]
    return out


def test_requeue_brings_back_exactly_the_failed_samples_once_and_they_finish(
    tmp_path, conn, redis_server, tiny_model, procs
):
    run, url = "rq1", redis_server.url
    new_run(conn, run, tiny_model, f"file://{tmp_path}/out", batch=4)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(14, seed=5))
    res = cli("produce", data, "--run", run, "--redis", url)
    assert res.returncode == 0, res.stdout + res.stderr
    led = Ledger(conn, run)
    good = sorted(k.decode() for k in conn.hkeys(Keys(run).state))
    # Two samples the engine rejects (token ids beyond the vocabulary): permanent failures.
    rejected = [Sample.build([10**6, 5, 6]), Sample.build([7, 10**6 + 1])]
    enqueue(conn, load_run(conn, run), rejected)
    n = len(good)
    assert led.counts() == {"queued": n + 2, "spooled": 0, "done": 0, "failed": 0, "total": n + 2}

    # An engine started with the wrong capture points: every good sample fails verification.
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    wrong = procs.engine("engine-wrong", tiny_model, dumps, layers="1,3")
    procs.start(
        "worker-1",
        "worker",
        "--run",
        run,
        "--redis",
        url,
        "--engine-url",
        wrong,
        "--dump-dir",
        dumps,
        "--spool-dir",
        spool,
        "--burst",
    )
    assert procs.wait("worker-1") == 0
    assert led.counts() == {"queued": 0, "spooled": 0, "done": 0, "failed": n + 2, "total": n + 2}
    fails = led.failures()
    assert sorted(s for s, f in fails.items() if f["reason"] == "capture-mismatch") == good
    assert sorted(s for s, f in fails.items() if f["reason"] == "engine-rejected") == sorted(s.id for s in rejected)
    assert "restart the engine with the run's capture points" in fails[good[0]]["message"]
    assert "outside the vocabulary" in fails[rejected[0].id]["message"]

    dry = cli("requeue", "--run", run, "--redis", url, "--reason", "capture-mismatch", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == f"would requeue {n} failed samples, {n} capture-mismatch"
    assert sorted(line.strip() for line in dry.stdout.splitlines()[1:]) == good
    assert led.counts()["failed"] == n + 2 and Queue(Keys(run).queue_name, connection=conn).count == 0

    # Two requeues at once: the samples come back exactly once between them.
    args = [
        sys.executable,
        "-m",
        "harvest.cli",
        "requeue",
        "--run",
        run,
        "--redis",
        url,
        "--reason",
        "capture-mismatch",
    ]
    both = [
        subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    moved = sorted(int(o.split()[1]) for o, _ in outs)
    assert sum(moved) == n, outs
    assert sorted(_queued_payload_ids(conn, run)) == good  # each failed sample in exactly one new job
    assert led.counts() == {"queued": n, "spooled": 0, "done": 0, "failed": 2, "total": n + 2}
    assert conn.hlen(Keys(run).failed_payload) == 2  # the rows of the requeued samples went with them
    assert cli("requeue", "--run", run, "--redis", url, "--reason", "capture-mismatch").stdout.startswith(
        "requeued 0 failed samples"
    )

    right = procs.engine("engine-right", tiny_model, dumps)
    procs.start(
        "worker-2",
        "worker",
        "--run",
        run,
        "--redis",
        url,
        "--engine-url",
        right,
        "--dump-dir",
        dumps,
        "--spool-dir",
        spool,
        "--burst",
    )
    assert procs.wait("worker-2") == 0
    procs.start("collector", "collect", "--run", run, "--redis", url, "--spool-dir", spool, "--max-wait", "1")
    wait_until(lambda: led.counts()["done"] == n, 120, "the requeued samples done")
    assert led.counts() == {"queued": 0, "spooled": 0, "done": n, "failed": 2, "total": n + 2}
    assert {f["reason"] for f in led.failures().values()} == {"engine-rejected"}
    reader = RunReader(f"file://{tmp_path}/out/{run}")
    assert sorted(reader.sample_ids) == good


def test_requeue_of_rq_failed_jobs_is_exactly_once(tmp_path, conn, tiny_model):
    """A job RQ itself failed (here: filed there as a janitor gives up) with samples still queued is put
    back by `--all` once; a second requeue finds nothing; one whose samples the ledger holds is dropped."""
    cfg = new_run(conn, "rq2", tiny_model, f"file://{tmp_path}/out")
    stuck, settled = [Sample.build([5, 6, 7])], [Sample.build([8, 9])]
    q = Queue(Keys(cfg.run).queue_name, connection=conn, serializer=JSONSerializer)
    reg = FailedJobRegistry(queue=q)
    ids = []
    for batch in (stuck, settled):
        job_id = enqueue(conn, cfg, batch)
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        with conn.pipeline() as pipe:
            pipe.lrem(q.key, 0, job_id)
            reg.add(job, pipeline=pipe, exc_string="simulated")
            pipe.execute()
        ids.append(job_id)
    led = Ledger(conn, cfg.run)
    led.mark_spooled([settled[0].id])
    dry = requeue(conn, cfg, all_=True, dry_run=True)
    assert (dry.rq_jobs_requeued, dry.rq_jobs_dropped) == ([ids[0]], [ids[1]])
    assert reg.get_job_ids(cleanup=False) != []
    first = requeue(conn, cfg, all_=True)
    assert (first.rq_jobs_requeued, first.rq_jobs_dropped, first.samples) == ([ids[0]], [ids[1]], [])
    assert q.job_ids == [ids[0]] and reg.get_job_ids(cleanup=False) == []
    second = requeue(conn, cfg, all_=True)
    assert (second.rq_jobs_requeued, second.rq_jobs_dropped) == ([], [])
    assert q.job_ids == [ids[0]]


def test_requeue_refuses_bad_ids_and_needs_a_selector(conn, redis_server, tiny_model, tmp_path):
    new_run(conn, "rq3", tiny_model, f"file://{tmp_path}/out")
    res = cli("requeue", "--run", "rq3", "--redis", redis_server.url)
    assert res.returncode == 2 and "--reason REASON, --sample ID or --all" in res.stderr
    res = cli("requeue", "--run", "rq3", "--redis", redis_server.url, "--sample", "../etc")
    assert res.returncode == 2 and "invalid sample id" in res.stderr
