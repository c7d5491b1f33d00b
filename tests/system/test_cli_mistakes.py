"""A new user's common mistakes, each run through the real CLI: every one ends within seconds
with exit status 2, one or two lines naming the fix (flag, variable or service), no traceback,
and nothing registered in Redis or written to the output.

The duration bound (20 s) is a hang guard, not a timing assertion: a model path looked up on an
unreachable hub would retry for tens of seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import free_port
from tests.support.cli import REPO

HANG_GUARD_S = 20.0
# The environment of a machine with no S3 credentials anywhere (no variables, no files, no
# instance metadata), whatever the machine running the test has.
NO_AWS = {
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _harvest(*args: str, cwd: str = REPO, env: dict | None = None, drop: tuple = ()) -> tuple[int, str, float]:
    """The CLI as a user starts it, from `cwd` (this checkout's code either way)."""
    full = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AWS_")}
    full.update(NO_AWS)
    full.update(env or {})
    full["PYTHONPATH"] = REPO
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=full
    )
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _assert_clear(rc: int, out: str, secs: float, *fix: str) -> None:
    assert rc == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 2, out
    assert lines[-1].startswith("harvest: error: "), out
    for f in fix:
        assert f in out, (f, out)
    assert secs < HANG_GUARD_S, f"took {secs:.1f}s: {out}"


@pytest.fixture
def dead_redis() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # a free port: nothing listens there


@pytest.fixture
def data(tmp_path) -> str:
    return write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(6))


REDIS_FIX = ("cannot reach Redis at redis://127.0.0.1:", "--redis URL", "HARVEST_REDIS_URL", "start redis-server")


@pytest.mark.parametrize(
    "cmd",
    [
        ["worker", "--run", "r1", "--dump-dir", "{tmp}/dumps", "--spool-dir", "{tmp}/spool"],
        ["collect", "--run", "r1", "--spool-dir", "{tmp}/spool"],
        ["requeue", "--run", "r1", "--all"],
        ["requeue", "--run", "r1", "--node", "n1"],
        ["status", "--run", "r1"],
        ["produce", "{data}", "--run", "r1", "--model", "{model}", "--out", "{tmp}/out"],
        ["produce", "{data}", "--run", "r1"],
        ["janitor", "--run", "r1"],
        ["runs"],
        ["metrics", "--port", "0"],
        ["reconcile", "--run", "r1"],
        ["run", "{data}", "--model", "{model}", "--out", "{tmp}/out"],
    ],
    ids=lambda c: "-".join(a for a in c[:2] if not a.startswith("{")),
)
def test_redis_down_names_the_url_and_the_fix(cmd, dead_redis, tmp_path, data, tiny_model):
    args = [a.format(tmp=tmp_path, data=data, model=tiny_model) for a in cmd]
    rc, out, secs = _harvest(*args, "--redis", dead_redis)
    _assert_clear(rc, out, secs, *REDIS_FIX, dead_redis)
    assert not (tmp_path / "out").exists()  # run.json is never written before Redis is reached
    assert not (tmp_path / "spool").exists() and not (tmp_path / "dumps").exists()


def test_redis_url_password_is_not_printed(tmp_path):
    url = f"redis://alice:s3cret@127.0.0.1:{free_port()}/0"
    rc, out, secs = _harvest("status", "--run", "r1", "--redis", url)
    _assert_clear(rc, out, secs, "redis://alice:***@127.0.0.1:")
    assert "s3cret" not in out


def test_default_redis_url_comes_from_the_environment(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    rc, out, secs = _harvest("status", "--run", "r1", env={"HARVEST_REDIS_URL": url})
    _assert_clear(rc, out, secs, url, "HARVEST_REDIS_URL")


@pytest.mark.parametrize("cmd", ["run", "produce"])
def test_s3_without_credentials_names_the_variables(cmd, tmp_path, data, tiny_model, conn, redis_server):
    extra = ["--run", "r1"] if cmd == "produce" else []
    rc, out, secs = _harvest(
        cmd, data, *extra, "--model", tiny_model, "--out", "s3://harvest-bucket/out", "--redis", redis_server.url
    )
    _assert_clear(
        rc, out, secs, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HARVEST_S3_ENDPOINT", "s3://harvest-bucket/out"
    )
    assert conn.keys("*") == []


def test_s3_endpoint_down_names_the_endpoint(tmp_path, data, tiny_model, conn, redis_server):
    endpoint = f"http://127.0.0.1:{free_port()}"
    rc, out, secs = _harvest(
        "produce",
        data,
        "--run",
        "r1",
        "--model",
        tiny_model,
        "--out",
        "s3://b/out",
        "--redis",
        redis_server.url,
        "--s3-endpoint",
        endpoint,
        env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
    )
    _assert_clear(rc, out, secs, endpoint, "--s3-endpoint", "HARVEST_S3_ENDPOINT")
    assert conn.keys("*") == []


def test_an_output_that_is_neither_local_nor_s3_is_refused_before_anything(
    tmp_path, data, tiny_model, conn, redis_server
):
    rc, out, secs = _harvest(
        "produce", data, "--run", "r1", "--model", tiny_model, "--out", "gs://bucket/out", "--redis", redis_server.url
    )
    _assert_clear(rc, out, secs, "gs://bucket/out", "file://", "s3://")
    assert conn.keys("*") == []


@pytest.mark.parametrize("cmd", [["collect"], ["worker", "--dump-dir", "{tmp}/dumps"]], ids=["collect", "worker"])
def test_collect_and_worker_of_an_s3_run_without_credentials(cmd, tmp_path, conn, redis_server, tiny_model):
    from harvest.state.keys import Keys
    from tests.support.ops import new_run

    new_run(conn, "r1", tiny_model, str(tmp_path / "out"))
    # The run's output moved to S3 by hand: the collector (which writes it) and the worker (which
    # reads its jobs' rows there) must say what they lack before packing or taking a job.
    raw = conn.get("harvest:r1:config").decode().replace(str(tmp_path / "out"), "s3://bucket/out")
    conn.set("harvest:r1:config", raw)
    rc, out, secs = _harvest(
        *(a.format(tmp=tmp_path) for a in cmd),
        "--run",
        "r1",
        "--redis",
        redis_server.url,
        "--spool-dir",
        str(tmp_path / "spool"),
    )
    _assert_clear(rc, out, secs, "AWS_ACCESS_KEY_ID", "HARVEST_S3_ENDPOINT")
    assert not (tmp_path / "spool").exists() and not (tmp_path / "dumps").exists()
    keys = Keys("r1")  # no heartbeat and no spool lease was ever written
    assert conn.exists(keys.workers, keys.collectors, keys.spool_leases) == 0


def test_engine_layers_out_of_range_is_one_line(tmp_path, tiny_model):
    rc, out, secs = _harvest("engine", "--model", tiny_model, "--dump-dir", str(tmp_path / "d"), "--layers", "2,99")
    _assert_clear(rc, out, secs, "--layers [99]", "[0, 8]")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("cmd", ["run", "produce"])
def test_missing_dataset_leaves_nothing_behind(cmd, tmp_path, tiny_model, conn, redis_server):
    extra = ["--run", "r1"] if cmd == "produce" else ["--run", "r1", "--work-dir", str(tmp_path / "work")]
    rc, out, secs = _harvest(
        cmd,
        str(tmp_path / "nope.jsonl"),
        *extra,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--redis",
        redis_server.url,
    )
    _assert_clear(rc, out, secs, "nope.jsonl does not exist", "DATASET")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "work").exists()
    assert conn.keys("*") == []


@pytest.mark.parametrize(
    "cmd",
    [["run", "--out", "out"], ["produce", "--run", "r1", "--dry-run"], ["produce", "--run", "r1", "--out", "out"]],
    ids=lambda c: "-".join(c[:1] + c[3:]),
)
def test_typo_in_a_relative_model_path_never_asks_the_hub(cmd, tmp_path, data, tiny_model, conn, redis_server):
    os.makedirs(tmp_path / "models")
    os.symlink(tiny_model, tmp_path / "models" / "tiny")
    rc, out, secs = _harvest(
        cmd[0],
        data,
        *cmd[1:],
        "--model",
        "models/tiny2",
        "--redis",
        redis_server.url,
        cwd=str(tmp_path),
        drop=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),
    )
    _assert_clear(rc, out, secs, "'models/tiny2' does not exist", "not looked up on the model hub", "--model")
    assert not (tmp_path / "out").exists()
    assert conn.keys("*") == []


def test_model_folder_without_config(tmp_path, data, conn, redis_server):
    (tmp_path / "empty").mkdir()
    rc, out, secs = _harvest(
        "produce",
        data,
        "--run",
        "r1",
        "--model",
        str(tmp_path / "empty"),
        "--out",
        str(tmp_path / "out"),
        "--redis",
        redis_server.url,
    )
    _assert_clear(rc, out, secs, "has no config.json", "--model")
    assert conn.keys("*") == []


def test_status_of_an_unknown_run_says_how_to_start_it(redis_server, conn):
    rc, out, secs = _harvest("status", "--run", "nosuch", "--redis", redis_server.url)
    _assert_clear(rc, out, secs, "run 'nosuch' is not in Redis", "harvest run", "harvest produce")


def test_bad_producer_option_on_run_is_one_line(tmp_path, data, tiny_model):
    rc, out, secs = _harvest("run", data, "--model", tiny_model, "--out", str(tmp_path / "out"), "--field", "bogus")
    _assert_clear(rc, out, secs, "--field 'bogus'", "LOGICAL=COLUMN")
    assert not (tmp_path / "out").exists()


def test_version_and_runs(redis_server, conn, tmp_path, tiny_model):
    from harvest import __version__
    from tests.support.ops import new_run

    rc, out, _ = _harvest("--version")
    assert (rc, out.strip()) == (0, f"harvest {__version__}")
    rc, out, _ = _harvest("runs", "--redis", redis_server.url)
    assert (rc, out.strip()) == (0, "no runs in Redis (start one with `harvest run` or `harvest produce`)")
    new_run(conn, "r1", tiny_model, str(tmp_path / "out"))
    new_run(conn, "r2", tiny_model, str(tmp_path / "out"))
    conn.hset("harvest:r1:counts", mapping={"q": 3, "d": 1})
    rc, out, _ = _harvest("runs", "--redis", redis_server.url)
    lines = out.strip().splitlines()
    assert rc == 0 and len(lines) == 3, out
    assert lines[0].split()[:7] == ["run", "settled", "total", "queued", "spooled", "done", "failed"]
    assert lines[1].split()[:8] == ["r1", "25.0%", "4", "3", "0", "1", "0", "0"]
    assert lines[2].split()[:8] == ["r2", "0.0%", "0", "0", "0", "0", "0", "0"]


def test_demo_prepare_writes_what_the_compose_quickstart_mounts(tmp_path):
    """.env.example's run reads MODEL_DIR=./models, MODEL_NAME=tiny, DATA_DIR=./data, DATASET=demo.jsonl."""
    import json

    from harvest.cli.demo import demo_rows

    rc, out, _ = _harvest("demo", "--prepare", ".", cwd=str(tmp_path))
    assert rc == 0, out
    assert "model: ./models/tiny" in out and "dataset: ./data/demo.jsonl" in out
    cfg = json.loads((tmp_path / "models" / "tiny" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 8 and (tmp_path / "models" / "tiny" / "tokenizer.json").exists()
    rows = [json.loads(line) for line in (tmp_path / "data" / "demo.jsonl").read_text().splitlines()]
    assert rows == demo_rows()
    assert sorted(os.listdir(tmp_path)) == ["data", "models"]  # nothing else: no run, no output
