"""Transient failures with real processes: an engine that is down makes the job wait and retry
(samples stay queued) a bounded number of times, then its samples fail with the transient reason;
once the engine is up, `harvest requeue --reason engine-unavailable` brings them back and they finish."""

from __future__ import annotations

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.ops import Procs, cli, new_run, wait_until


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def test_engine_down_retries_then_fails_then_requeue_finishes(tmp_path, conn, redis_server, tiny_model, procs):
    run, url = "retry1", redis_server.url
    new_run(conn, run, tiny_model, f"file://{tmp_path}/out", batch=8)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(5, seed=11))
    assert cli("produce", data, "--run", run, "--redis", url).returncode == 0
    led = Ledger(conn, run)
    n = led.counts()["total"]
    assert run_queue(conn, run).count == 1

    port = free_port()  # nothing listens here yet
    engine_url = f"http://127.0.0.1:{port}"
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    procs.start(
        "worker",
        "worker",
        "--run",
        run,
        "--redis",
        url,
        "--engine-url",
        engine_url,
        "--dump-dir",
        dumps,
        "--spool-dir",
        spool,
        "--retries",
        "2",
        "--retry-backoff",
        "1",
    )

    # First failed attempt: the job waits in RQ's scheduled registry, its samples still queued.
    wait_until(lambda: led.stats().get("job_retries", 0) >= 1, 60, "the job put back for a retry")
    assert led.counts()["queued"] == n and led.counts()["failed"] == 0
    # Budget spent (1 attempt + 2 retries): the samples fail with the transient reason.
    wait_until(lambda: led.counts()["failed"] == n, 120, "the samples failed once the retries were spent")
    assert led.stats()["job_retries"] == 2
    fails = led.failures()
    assert {f["reason"] for f in fails.values()} == {"engine-unavailable"}
    # the engine client's tries within the last attempt ("failed 5 times") apart from the job's attempts
    assert all(
        f["message"].startswith(f"engine {engine_url} failed 5 times; last error: ")
        and f["message"].endswith(" (the job's attempt 3 of 3: it gave up after 2 retries)")
        for f in fails.values()
    )
    q = run_queue(conn, run)
    assert (q.count, q.scheduled_job_registry.count, q.failed_job_registry.count) == (0, 0, 0)

    procs.engine("engine", tiny_model, dumps, port=port)
    res = cli("requeue", "--run", run, "--redis", url, "--reason", "engine-unavailable")
    assert res.stdout.startswith(f"requeued {n} failed samples in 1 jobs"), res.stdout + res.stderr
    procs.start("collector", "collect", "--run", run, "--redis", url, "--spool-dir", spool, "--max-wait", "1")
    wait_until(lambda: led.counts()["done"] == n, 120, "the requeued samples done")
    assert led.counts() == {"queued": 0, "spooled": 0, "done": n, "failed": 0, "total": n}
    assert conn.hlen(Keys(run).failed_payload) == 0
