"""`harvest status` and `harvest metrics` report exact counts before, during and after a run with
injected failures (samples the engine rejects), on real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rq.job import Job
from rq.serializers import JSONSerializer

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from harvest.ops.status import compute_status, render
from harvest.sample import Sample
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from harvest.state.runstore import load_run
from tests.support.ops import REPO, Procs, cli, enqueue, new_run, wait_until
from tests.support.wait import OutputReader


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _status(url: str, run: str) -> dict:
    res = cli("status", "--run", run, "--redis", url, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _counts(st: dict) -> tuple:
    return st["total"], st["queued"], st["in_flight"], st["spooled"], st["done"], st["failed"]


def _scrape(port: int) -> dict[tuple, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("harvest_"):
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "run")))] = s.value
    return out


def test_status_and_metrics_exact_during_and_after_a_run_with_failures(tmp_path, conn, redis_server, tiny_model, procs):
    run, url = "stat1", redis_server.url
    new_run(conn, run, tiny_model, f"file://{tmp_path}/out", batch=4)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(10, seed=7))
    assert cli("produce", data, "--run", run, "--redis", url).returncode == 0
    q = run_queue(conn, run)
    good_jobs = list(q.job_ids)
    good = {
        s.id: s.num_tokens
        for j in good_jobs
        for s in decode_batch(Job.fetch(j, connection=conn, serializer=JSONSerializer).args[0])[1]
    }
    n = len(good)
    rejected = [Sample.build([10**6, 3]), Sample.build([4, 10**6]), Sample.build([10**6])]
    enqueue(conn, load_run(conn, run), rejected)
    jobs = len(good_jobs) + 1
    first_job = good_jobs[0]
    first_n = len(decode_batch(Job.fetch(first_job, connection=conn, serializer=JSONSerializer).args[0])[1])

    port = free_port()
    procs.start("metrics", "metrics", "--redis", url, "--port", str(port), "--addr", "127.0.0.1", "--run", run)

    def scrape():
        try:
            return _scrape(port)
        except httpx.HTTPError:
            return None

    m = wait_until(scrape, 60, "the metrics exporter answering")

    # Before any worker: everything queued.
    st = _status(url, run)
    assert _counts(st) == (n + 3, n + 3, 0, 0, 0, 0)
    assert st["jobs"] == {"queued": jobs, "started": 0, "scheduled": 0, "failed": 0}
    assert st["workers"] == {} and st["failures"] == [] and st["eta_seconds"] is None
    assert m[("harvest_samples", (("state", "queued"),))] == n + 3
    assert m[("harvest_queue_jobs", (("registry", "queued"),))] == jobs

    # During: a worker holding the first job (held by spool backpressure) shows as in flight.
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    os.makedirs(spool)
    blocker = os.path.join(spool, "e" * 32 + ".safetensors")
    with open(blocker, "wb") as f:
        f.write(b"\0" * (2 << 20))
    engine = procs.engine("engine", tiny_model, dumps)
    wargs = ["worker", "--run", run, "--redis", url, "--engine-url", engine, "--dump-dir", dumps, "--spool-dir", spool]
    procs.start("worker-a", *wargs, "--max-spool-mb", "1")
    wait_until(lambda: _status(url, run)["in_flight"], 60, "the worker's job in flight")
    st = _status(url, run)
    assert _counts(st) == (n + 3, n + 3 - first_n, first_n, 0, 0, 0)
    assert st["jobs"]["started"] == 1 and st["jobs"]["queued"] == jobs - 1
    ((host, ws),) = st["workers"].items()
    assert [(w["state"], w["job"], w["job_samples"], w["engine"]) for w in ws] == [("busy", first_job, first_n, engine)]
    m = _scrape(port)
    assert m[("harvest_workers", (("host", host), ("state", "busy")))] == 1
    assert m[("harvest_queue_jobs", (("registry", "started"),))] == 1

    procs.procs["worker-a"].send_signal(signal.SIGTERM)  # finish that job, then stop
    os.unlink(blocker)
    assert procs.wait("worker-a", 60) == 0
    st = _status(url, run)
    assert _counts(st) == (n + 3, n + 3 - first_n, 0, first_n, 0, 0)
    assert st["workers"] == {} and st["window_counts"]["samples_spooled"] == first_n

    # The rest, with a burst worker: the injected samples fail, the others wait on the spool.
    procs.start("worker-b", *wargs, "--burst")
    assert procs.wait("worker-b", 120) == 0
    st = _status(url, run)
    assert _counts(st) == (n + 3, 0, 0, n, 0, 3)
    assert st["failures"][0]["reason"] == "engine-rejected" and st["failures"][0]["count"] == 3
    assert len(st["failures"]) == 1 and "outside the vocabulary" in st["failures"][0]["example"]

    # After: the collector commits; status and metrics agree on every count.
    procs.start("collector", "collect", "--run", run, "--redis", url, "--spool-dir", spool, "--max-wait", "1")
    wait_until(lambda: Ledger(conn, run).counts()["done"] == n, 120, "every good sample done")
    wait_until(
        lambda: (_status(url, run)["collectors"] or [{}])[0].get("spool_files") == 0,
        30,
        "the collector's heartbeat showing an empty spool",
    )
    st = _status(url, run)
    assert _counts(st) == (n + 3, 0, 0, 0, n, 3)
    assert st["tokens_done"] == sum(good.values())
    # All committed within the last minute (the window counts exactly; rates are those over its seconds).
    w = st["window_counts"]
    assert (w["samples_done"], w["tokens_done"], w["bytes_done"]) == (n, sum(good.values()), st["bytes_done"])
    assert st["samples_per_s"] == pytest.approx(n / st["window_seconds"])
    assert st["eta_seconds"] == 0.0 and st["jobs"] == {"queued": 0, "started": 0, "scheduled": 0, "failed": 0}
    assert [c["node"] for c in st["collectors"]] == [host] and st["dead_collectors"] == []
    assert st["mb_per_s"] == pytest.approx(st["bytes_done"] / st["window_seconds"] / 1e6)

    m = _scrape(port)
    assert {s: m[("harvest_samples", (("state", s),))] for s in ("queued", "spooled", "done", "failed")} == {
        "queued": 0,
        "spooled": 0,
        "done": n,
        "failed": 3,
    }
    assert m[("harvest_failed_samples", (("reason", "engine-rejected"),))] == 3
    assert m[("harvest_samples_done_total", ())] == n
    assert m[("harvest_samples_spooled_total", ())] == n
    assert m[("harvest_samples_failed_total", ())] == 3
    assert m[("harvest_tokens_done_total", ())] == sum(good.values())
    assert m[("harvest_shard_bytes_total", ())] == st["bytes_done"]
    assert m[("harvest_dump_bytes_total", ())] > 0
    assert m[("harvest_job_seconds_count", ())] == jobs  # every job ran exactly once
    assert m[("harvest_job_seconds_bucket", (("le", "+Inf"),))] == jobs
    # One engine call per job; the rejected batch is retried one by one, still one timed call.
    assert m[("harvest_engine_seconds_count", ())] == jobs
    assert m[("harvest_job_retries_total", ())] == 0 and m[("harvest_jobs_reaped_total", ())] == 0

    text = render(compute_status(conn, run))
    assert f"total {n + 3}   queued 0   in flight 0   spooled 0   done {n}   failed 3" in text
    assert "engine-rejected: 3" in text and f"harvest requeue --run {run}" in text


def test_status_watch_refreshes_in_place(conn, redis_server, tiny_model, tmp_path):
    new_run(conn, "stat2", tiny_model, f"file://{tmp_path}/out")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "status",
            "--run",
            "stat2",
            "--redis",
            redis_server.url,
            "--watch",
            "0.5",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    reader = OutputReader(p.stdout)
    try:  # Ctrl-C once two whole frames are out (a signal before the CLI is up would kill it, not stop it)
        reader.wait_for(lambda out: out.count("  samples  total 0") >= 2, 120, "two frames of `status --watch`", p)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(20)
        out = reader.close()
    assert p.returncode == 0
    # Piped, click drops the clear-screen codes, so the frames follow one another.
    assert out.count("run stat2 ") >= 2 and out.count("  samples  total 0") == out.count("run stat2 ")
    res = cli("status", "--run", "nosuchrun", "--redis", redis_server.url)
    assert res.returncode == 2 and "run 'nosuchrun' is not in Redis" in res.stderr
