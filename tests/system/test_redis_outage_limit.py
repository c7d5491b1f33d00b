"""A Redis away past a worker's limit (`--redis-wait`): the worker stops with one line naming the
URL and the limit, exit status 75, having sent nothing more to Redis; its job, still "started"
under its name, is put back by another worker's janitor once Redis is back, and every sample is
done exactly once, none failed (worker-error least of all).

The worker is caught inside its job deterministically with the spool backpressure of
tests/system/test_dead_worker.py: over `--max-spool-mb` it waits in the job (job started, its
samples queued) until a placeholder spool file goes."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import redis

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import RedisServer
from harvest.state.heartbeat import read_workers
from harvest.state.jobs import run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.cli import REPO, kill_group
from tests.support.ops import Procs, cli, new_run, wait_until


def test_a_worker_past_its_limit_stops_and_its_job_is_done_by_another(tmp_path, tiny_model):
    server = RedisServer(str(tmp_path / "redis")).start()
    procs = Procs(str(tmp_path / "logs"))
    run = "limit"
    try:
        conn = redis.Redis.from_url(server.url)
        new_run(conn, run, tiny_model, f"file://{tmp_path}/out", batch=3)
        data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(9, seed=3))
        res = cli("produce", data, "--run", run, "--redis", server.url)
        assert res.returncode == 0, res.stdout + res.stderr
        expected = {k.decode() for k in conn.hkeys(Keys(run).state)}
        dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
        os.makedirs(spool)
        blocker = os.path.join(spool, "f" * 32 + ".safetensors")  # spool over the limit: the worker waits in its job
        with open(blocker, "wb") as f:
            f.write(b"\0" * (2 << 20))
        url = procs.engine("engine", tiny_model, dumps)
        args = [
            "worker",
            "--run",
            run,
            "--redis",
            server.url,
            "--engine-url",
            url,
            "--dump-dir",
            dumps,
            "--spool-dir",
            spool,
        ]
        procs.start("a", *args, "--max-spool-mb", "1", "--redis-wait", "3")

        def busy():
            alive, _ = read_workers(conn, run)
            return next((w for w in alive if w["state"] == "busy"), None)

        job = wait_until(busy, 60, "worker a in a job")["job"]
        conn.close()
        server.kill()
        wait_until(lambda: "did not come back within 3 s" in procs.log("a"), 30, "worker a gave Redis up")
        os.unlink(blocker)  # its job goes on, and meets the latched client at its next Redis call
        assert procs.wait("a", 60) == 75
        lines = [ln for ln in procs.log("a").splitlines() if ln.startswith("harvest: error: ")]
        assert len(lines) == 1 and lines[0].startswith(
            f"harvest: error: lost Redis at {server.url}: it answered, then went away ("
        ), lines
        assert "did not come back within 3 s (waited 3 s). Start Redis again" in lines[0], lines
        claim_dir = os.path.join(dumps, f".claimed-{_worker_name(procs.log('a'))}")
        assert os.path.isdir(claim_dir), os.listdir(dumps)  # left as it was: the janitor removes it

        server.start()  # same port, same AOF: the job is still "started" under worker a's name
        conn = redis.Redis.from_url(server.url)
        assert job in run_queue(conn, run).started_job_registry.get_job_ids()
        procs.start("b", *args)
        procs.start(
            "collector", "collect", "--run", run, "--redis", server.url, "--spool-dir", spool, "--max-wait", "1"
        )
        ledger = Ledger(conn, run)
        wait_until(lambda: ledger.counts()["done"] == len(expected), 120, "every sample committed")
        c = ledger.counts()
        assert (c["done"], c["failed"], c["queued"], c["spooled"]) == (len(expected), 0, 0, 0)
        assert conn.hget(Keys(run).reaped, job) == b"1"  # worker a's job, put back by b's janitor once
        assert run_queue(conn, run).started_job_registry.get_job_ids() == []
        copies: Counter = Counter()
        for path in glob.glob(str(tmp_path / "out" / run / "index" / "*.json")):
            with open(path) as f:
                copies.update(json.load(f)["samples"])
        assert copies == Counter({sid: 1 for sid in expected})
        assert "worker-error" not in procs.log("a") + procs.log("b")
    finally:
        procs.close()
        server.stop()


def _worker_name(log: str) -> str:
    """Worker a's name, from its start line (harvest.workers.worker)."""
    line = next(ln for ln in log.splitlines() if "worker started: " in ln)
    return line.split("worker started: ", 1)[1].split(",", 1)[0]


def test_a_collector_past_its_limit_stops_with_exit_75(tmp_path, tiny_model):
    server = RedisServer(str(tmp_path / "redis")).start()
    procs = Procs(str(tmp_path / "logs"))
    try:
        conn = redis.Redis.from_url(server.url)
        new_run(conn, "clim", tiny_model, f"file://{tmp_path}/out")
        conn.close()
        procs.start(
            "collector",
            "collect",
            "--run",
            "clim",
            "--redis",
            server.url,
            "--spool-dir",
            str(tmp_path / "spool"),
            "--redis-wait",
            "2",
            "--pack-workers",
            "2",
        )
        wait_until(lambda: "collector started: " in procs.log("collector"), 60, "the collector started")
        server.kill()
        assert procs.wait("collector", 60) == 75
        lines = [ln for ln in procs.log("collector").splitlines() if ln.startswith("harvest: error: ")]
        assert len(lines) == 1 and lines[0].startswith(
            f"harvest: error: lost Redis at {server.url}: it answered, then went away ("
        ), lines
        assert "did not come back within 2 s" in lines[0] and "Traceback" not in procs.log("collector")
    finally:
        procs.close()
        server.stop()


def test_harvest_run_whose_redis_cannot_come_back_stops_with_exit_75(tmp_path, tiny_model):
    from tests.system.test_redis_outage import _busy, _private_redis  # the same harness as the riding-out test

    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(12, seed=5))
    work = tmp_path / "work"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "run",
            data,
            "--model",
            tiny_model,
            "--out",
            str(tmp_path / "out"),
            "--run",
            "gone",
            "--batch-samples",
            "2",
            "--no-progress",
            "--work-dir",
            str(work),
            "--dump-dir",
            str(tmp_path / "dumps"),
            "--redis-wait",
            "4",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        pid, port = wait_until(lambda: _private_redis(p), 60, "harvest run's redis-server")
        conn = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        wait_until(lambda: _busy(conn), 120, "a worker in a job", poll=0.01)
        conn.close()
        # A corrupt AOF: the server that is started again refuses to load it and exits at once.
        manifest = glob.glob(str(work / "redis" / "appendonlydir" / "*.manifest"))[0]
        os.kill(pid, signal.SIGKILL)
        with open(manifest, "w") as f:
            f.write("not a manifest\n")
        stdout, stderr = p.communicate(timeout=120)
    finally:
        kill_group(p)  # the run and whatever it started
        p.wait()
    assert p.returncode == 75, stdout + stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("harvest: error: ")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(
        f"harvest: error: lost Redis at redis://127.0.0.1:{port}/0: it answered, then went away ("
    ), lines
    assert (
        "did not come back within 4 s" in lines[0]
        and "; its private redis-server did not start again: "
        f"redis-server exited with 1; see {work}/redis/redis.log. Start Redis again"
        in lines[0]
    ), lines
    assert "Traceback" not in stderr, stderr
    with pytest.raises(redis.ConnectionError):  # the keeper stopped trying when the run stopped
        redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").ping()
