"""Shared fixtures: a real redis-server on a private port, a tiny real model built offline, and
a real S3 protocol server (moto's). Every test under tests/system/ is marked `slow`: those start
processes of their own (the harvest CLI, engines, workers, collectors, S3 or Redis servers,
docker); tests/unit/ runs in this process beside the shared Redis."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import redis

from harvest.cli.demo import build_tiny_model
from harvest.cli.redisproc import RedisServer

SYSTEM = pathlib.Path(__file__).parent / "system"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SYSTEM in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


@pytest.fixture
def conn(redis_server) -> redis.Redis:
    c = redis.Redis.from_url(redis_server.url)
    c.flushall()
    return c


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"))


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
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): the test needs a real small filesystem")
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)
