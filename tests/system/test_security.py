"""No way in through Redis, no secrets in logs, no engine on the network by default.

Real processes throughout: a redis-server (with requirepass where it matters), the reference
engine, `harvest worker`, the moto S3 server."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.redisproc import RedisServer
from harvest.state.keys import Keys
from tests.support.need import need
from tests.support.ops import Procs, cli, new_run


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _worker_burst(procs: Procs, redis_url: str, url: str, tmp_path, run: str) -> str:
    procs.start(
        "worker",
        "worker",
        "--run",
        run,
        "--redis",
        redis_url,
        "--engine-url",
        url,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--spool-dir",
        str(tmp_path / "spool"),
        "--burst",
    )
    assert procs.wait("worker") == 0, procs.log("worker")
    return procs.log("worker")


@pytest.mark.parametrize("serializer", ["pickle", "json"])
def test_a_job_naming_another_function_never_runs(tmp_path, conn, redis_server, tiny_model, procs, serializer):
    # Whoever can write to Redis enqueues `os.system("touch FLAG")`: pickled (RQ's default), or
    # as a JSON job that names the function. Neither may run; the job fails with the reason.
    new_run(conn, "sec", tiny_model, f"file://{tmp_path}/out")
    flag = tmp_path / "pwned"
    q = Queue(
        Keys("sec").queue_name, connection=conn, **({"serializer": JSONSerializer} if serializer == "json" else {})
    )
    q.enqueue_call("os.system", args=(f"touch {flag}",), job_id="evil")
    url = procs.engine("engine", tiny_model, str(tmp_path / "dumps"))
    log = _worker_burst(procs, redis_server.url, url, tmp_path, "sec")
    assert not flag.exists()
    assert conn.hget("rq:job:evil", "status") == b"failed"
    if serializer == "json":
        assert (
            "job evil names function 'os.system'; this worker runs only harvest.workers.job.process_batch: refused"
            in log
        )
    else:
        assert "DeserializationError" in log


def test_password_redis_and_s3_secrets_stay_out_of_logs(tmp_path, tiny_model, procs, s3_bucket, monkeypatch):
    password, secret = "pw-7f3a9c1e55", "sk-d41d8cd98f00b204"
    server = RedisServer(str(tmp_path / "redis"), password=password).start()
    # moto accepts any key; the subprocesses inherit it; the session's own key is back after the test
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    try:
        url_redis = server.url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url_redis.replace(f":{password}@", "")).ping()
        data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(6, seed=5))
        outputs = [
            cli(
                "-v",
                "produce",
                data,
                "--run",
                "pw",
                "--redis",
                url_redis,
                "--model",
                tiny_model,
                "--out",
                s3_bucket,
                "--no-progress",
            )
        ]
        assert outputs[0].returncode == 0, outputs[0].stderr
        engine = procs.engine("engine", tiny_model, str(tmp_path / "dumps"))
        _worker_burst(procs, url_redis, engine, tmp_path, "pw")
        outputs.append(
            cli("-v", "collect", "--run", "pw", "--redis", url_redis, "--spool-dir", str(tmp_path / "spool"), "--burst")
        )
        outputs.append(cli("status", "--run", "pw", "--redis", url_redis))
        assert all(o.returncode == 0 for o in outputs), [o.stderr for o in outputs]
        st = json.loads(cli("status", "--run", "pw", "--redis", url_redis, "--json").stdout)
        assert (st["done"], st["failed"]) == (st["total"], 0) and st["total"] >= 6
        text = "".join(o.stdout + o.stderr for o in outputs) + "".join(procs.log(n) for n in procs.procs)
        assert password not in text and secret not in text
    finally:
        server.stop()


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def test_reference_engine_listens_on_loopback_only(tmp_path, tiny_model, procs):
    ip = _outside_address()
    if ip is None:
        need("a non-loopback address", "the test checks the engine cannot be reached on one")
    url = procs.engine("engine", tiny_model, str(tmp_path / "dumps"))
    port = url.rsplit(":", 1)[1]
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{ip}:{port}/health", timeout=2)
