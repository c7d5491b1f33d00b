"""Shared fixtures: a real redis-server on a private port and a tiny real model built offline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from harvest.demo import build_tiny_model
from harvest.redisproc import RedisServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def harvest_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `harvest` CLI in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
