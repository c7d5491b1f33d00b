"""Shared fixtures: a real redis-server on a private port, a tiny real model built offline, and
a real S3 protocol server (moto's). Every test under tests/system/ is marked `slow`: those start
processes of their own (the harvest CLI, engines, workers, collectors, S3 or Redis servers,
docker); tests/unit/ runs in this process beside the shared Redis."""

from __future__ import annotations

import fcntl
import os
import pathlib
import signal
import subprocess

import pytest
import redis

from harvest.cli.demo import build_tiny_model
from harvest.cli.redisproc import RedisServer
from tests.support.need import need

SYSTEM = pathlib.Path(__file__).parent / "system"

# A suite started in the background of a non-interactive shell (`./.ci/run &`) inherits SIGINT
# ignored, and so does every process it starts: a `harvest run` would then ignore the Ctrl-C the
# stop tests send it, as no person's terminal does, and those tests would fail. A
# handler of this process's own is reset to the default in each child it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The files that take minutes, longest first (2-core machine). `python -m pytest` runs the suite
# on pytest-xdist workers (pyproject.toml's addopts), which take tests in collection order: these
# go first, so the run lasts about as long as its longest chain instead of ending on a slow file
# started last.
SLOW_FIRST = [
    "system/test_sglang_live.py",  # ~5 min: the module's SGLang server, started twice (one worker)
    "system/test_sglang_servers.py",  # ~6 min: two servers of their own (radix cache, TP 2), on the other worker
    "system/test_vllm.py",
    "system/test_exactly_once.py",
    "system/test_audit.py",  # 2-4 min: two faulty runs (one audited twice, one repaired: a third extraction), five audits
    "system/test_chaos.py",
    "system/test_regenerate_chaos.py",  # 2-3 min: a worker killed mid-generation, a node lost, seeds
    "system/test_clock_skew.py",
    "system/test_slurm.py",  # ~7 min at load 15 on 2 cores: four runs, each on a SLURM cluster of its own
    "system/test_trainers.py",
    "system/test_trainers_in_place.py",
    "system/test_local_run_stop.py",
    "system/test_feed_live.py",
    "system/test_control_plane.py",
    "system/test_crash_collector.py",
    "system/test_dead_worker.py",
    "system/test_node_loss.py",
    "system/test_redis_outage.py",
    "system/test_redis_outage_limit.py",
    "system/test_redis_outage_client.py",
    "system/test_run_supervisor.py",
    "system/test_dashboard.py",
]
# Files whose tests must stay on one xdist worker (--dist loadgroup): they share module-scoped
# fixtures that are costly or not safe to run twice at once (an SGLang server, a `harvest run`,
# wheels downloaded into one cache folder).
ONE_WORKER = [
    "system/test_sglang_live.py",
    "system/test_sglang_servers.py",
    "system/test_trainers.py",
    "system/test_sglang_contract.py",
]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker more than the usable cores (the cores this process may run on, not
    psutil's physical count, which says 1 on some 2-vCPU machines), at least 3. A system test
    spends much of its time waiting on the protocol's own timers (a collector's max-wait, heartbeat
    TTLs, graces, polls) rather than computing, so a worker per core leaves the cores partly idle;
    one more fills those waits, and a further one would only stretch every test's waits."""
    return max(3, len(os.sched_getaffinity(0)) + 1)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    rank = {here / name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: each file keeps its order
    for item in items:
        if SYSTEM in item.path.parents:
            item.add_marker(pytest.mark.slow)
        if item.path in {here / name for name in ONE_WORKER}:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_heartbeat_left_behind():
    """A test that starts a worker heartbeat in this process and leaves it started fails here:
    `harvest.state.heartbeat.keep_alive` beats every started heartbeat of the process, so a later
    test's janitor sweep would beat it into a Redis that is gone (its module's Redis, stopped:
    "Connection refused" in that test's sweep)."""
    from harvest.state import heartbeat

    before = set(heartbeat._LIVE)
    yield
    left = set(heartbeat._LIVE) - before
    for name in left:
        heartbeat._LIVE.pop(name, None)
    assert not left, f"heartbeats started and never stopped: {sorted(left)} (call WorkerBeat.stop())"


@pytest.fixture
def conn(redis_server) -> redis.Redis:
    c = redis.Redis.from_url(redis_server.url)
    c.flushall()
    return c


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Built once per run. Under pytest-xdist the workers share one copy in the run's temporary
    folder: the first to take the lock builds it (build_tiny_model renames a finished build into
    place), the others wait and find it there."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"))
    root = tmp_path_factory.getbasetemp().parent  # shared by the run's workers
    with open(root / "tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_tiny_model(str(root / "model" / "tiny"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 protocol server (moto's, in a thread on a free port) for the whole session;
    the S3 environment harvest reads (endpoint, region, credentials) points at it meanwhile."""
    from moto.server import ThreadedMotoServer

    from harvest.cli.redisproc import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {
        "HARVEST_S3_ENDPOINT": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    """A fresh, empty bucket on the session's S3 server; returns its s3:// URL."""
    import uuid

    import boto3

    name = f"harvest-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture
def tiny_fs(request, tmp_path):
    """A real small filesystem (a tmpfs of the size the test parametrizes, default 1m), for disk-full
    tests; needs mount privileges (root in a container), skipped otherwise."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    size = getattr(request, "param", "1m")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        need("a tmpfs mount", f"cannot mount one here ({r.stderr.strip()}): the test needs a real small filesystem")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)
