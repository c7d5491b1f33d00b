"""The private redis-server harvest starts for `harvest run` and the tests."""

from __future__ import annotations

import os

import redis

from harvest.cli.redisproc import RedisServer


def test_relative_data_dir_works(tmp_path, monkeypatch):
    # redis-server chdirs into --dir before opening its log file, so a relative path given
    # on the command line (harvest demo's ./harvest-demo/work) must be made absolute first.
    monkeypatch.chdir(tmp_path)
    server = RedisServer(os.path.join("work", "redis")).start()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        assert os.path.isfile(tmp_path / "work" / "redis" / "redis.log")
    finally:
        server.stop()


def test_password_is_required_through_the_url(tmp_path):
    server = RedisServer(str(tmp_path / "r"), password="s3cret").start()
    try:
        assert "s3cret" in server.url
        assert redis.Redis.from_url(server.url).ping()
        bare = server.url.replace(":s3cret@", "")
        try:
            redis.Redis.from_url(bare).ping()
        except redis.AuthenticationError as e:
            assert "authenticat" in str(e).lower()  # RESP3 HELLO or RESP2 NOAUTH wording
        else:
            raise AssertionError("redis-server with requirepass answered without a password")
    finally:
        server.stop()
