"""`harvest run` keeps its children alive: a worker SIGKILLed mid-run is restarted and the run
finishes with every sample once; a child that keeps dying at start ends the run with its log;
the exit status counts bad rows."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.supervisor import ChildKeepsDying, Supervisor
from harvest.read.reader import RunReader
from tests.support.cli import REPO, harvest_cli, kill_group


def _busy_worker_pid(conn: redis.Redis, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for key in conn.scan_iter(match="harvest:worker:*"):
            h = {k.decode(): v.decode() for k, v in conn.hgetall(key).items()}
            if h.get("state") == "busy":
                return int(h["pid"])
        time.sleep(0.05)
    raise AssertionError("no worker became busy")


def test_a_killed_worker_is_restarted_and_the_run_finishes(tmp_path, tiny_model, redis_server):
    rows = demo_rows(80, seed=7)
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), rows)
    out = tmp_path / "out"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "run",
            dataset,
            "--model",
            tiny_model,
            "--out",
            f"file://{out}",
            "--run",
            "sup",
            "--redis",
            redis_server.url,
            "--no-progress",
            "--work-dir",
            str(tmp_path / "work"),
            "--dump-dir",
            str(tmp_path / "dumps"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        os.kill(_busy_worker_pid(redis.Redis.from_url(redis_server.url)), signal.SIGKILL)
        stdout, stderr = p.communicate(timeout=600)
    finally:
        kill_group(p)  # the run and whatever it started
    assert p.returncode == 0, stdout + stderr
    n = len(RunReader(f"file://{out}/sup"))
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in stdout
    assert "restarted: worker-" in stdout and "1x" in stdout
    log = open(tmp_path / "work" / "logs" / "supervisor.log").read()
    assert "exited with status -9: restarting it in 1s" in log


def test_bad_rows_make_run_exit_1_and_are_named(tmp_path, tiny_model):
    path = tmp_path / "mixed.jsonl"
    rows = demo_rows(6, seed=3)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"colour": "blue"}) + "\n")
    res = harvest_cli(
        "run",
        str(path),
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--run",
        "bad",
        "--no-progress",
        "--work-dir",
        str(tmp_path / "work"),
        "--dump-dir",
        str(tmp_path / "dumps"),
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "bad rows: 2 (each reported above on stderr with its file and line)" in res.stdout
    n = len(rows)
    assert f"bad row {path}:{n + 1}: invalid JSON" in res.stderr
    assert f"bad row {path}:{n + 2}: no usable field" in res.stderr
    done = len(RunReader(str(tmp_path / "out" / "bad")))
    assert done >= 6 and f"samples: {done} done, 0 failed" in res.stdout


def test_a_child_that_keeps_dying_at_start_ends_the_run(tmp_path):
    sup = Supervisor(str(tmp_path), max_deaths=3, window_s=60, backoff_s=(0.05,))
    sup.start("flaky", [], cmd=[sys.executable, "-c", "import sys; print('cannot start: no GPU'); sys.exit(3)"])
    deadline = time.monotonic() + 30
    with pytest.raises(ChildKeepsDying) as e:
        while time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.02)
    assert str(e.value).startswith("flaky died 3 times within 60s (last exit status 3); last lines of its log:\n")
    assert str(e.value).endswith("cannot start: no GPU\n")
    assert sup.restarts() == {"flaky": 2}
    sup.stop()


def test_a_child_that_dies_once_is_started_again(tmp_path):
    marker = tmp_path / "ran-once"
    code = (
        f"import os, sys, time\nif not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close()\n"
        "    sys.exit(1)\ntime.sleep(60)\n"
    )
    sup = Supervisor(str(tmp_path), backoff_s=(0.05,))
    sup.start("once", [], cmd=[sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (sup.restarts() and sup.alive("once")):
        sup.poll()
        time.sleep(0.02)
    assert sup.restarts() == {"once": 1} and sup.alive("once") is not None
    sup.stop()
    assert sup.alive("once") is None
