"""The Redis client of every harvest process (harvest.state.connection), where no Redis has to die:
first contact fails at once, the limit's sources and their order, the latch, and the CLI's line
and exit status for a Redis lost. The outages themselves, with a redis-server killed and started
again, are in tests/system/test_redis_outage_client.py."""

from __future__ import annotations

import copy
import time

import click
import pytest
import redis
from click.testing import CliRunner

from harvest.cli.errors import HarvestGroup, redis_wait_option, translate
from harvest.cli.redisproc import free_port
from harvest.state.connection import (
    DEFAULT_OUTAGE_S,
    OUTAGE_ENV,
    REDIS_LOST_EXIT,
    OutageRetry,
    RedisLost,
    give_up,
    is_connection_error,
    outage_limit,
    outage_of,
    redis_client,
)


def test_a_redis_never_reached_fails_at_once_with_redis_own_error():
    conn = redis_client(f"redis://127.0.0.1:{free_port()}/0", outage_s=60)
    t0 = time.monotonic()
    with pytest.raises(redis.ConnectionError) as e:
        conn.ping()
    assert time.monotonic() - t0 < 2.0  # not the 60 s an outage of a reached Redis would be waited for
    assert not isinstance(e.value, RedisLost)
    o = outage_of(conn)
    assert (o.reached, o.since, o.lost) == (False, None, None)


def test_the_limit_comes_from_the_option_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.delenv(OUTAGE_ENV, raising=False)
    assert outage_limit() == DEFAULT_OUTAGE_S == 300.0
    monkeypatch.setenv(OUTAGE_ENV, "42.5")
    assert outage_limit() == 42.5
    assert outage_limit(7) == 7.0
    monkeypatch.setenv(OUTAGE_ENV, "soon")
    with pytest.raises(ValueError, match=f"{OUTAGE_ENV}='soon': expected seconds"):
        outage_limit()
    monkeypatch.setenv(OUTAGE_ENV, "-1")
    with pytest.raises(ValueError, match="expected seconds >= 0"):
        outage_limit()


def test_every_connection_of_a_client_shares_one_outage(redis_server, conn):
    client = redis_client(redis_server.url, outage_s=30)
    retry = client.connection_pool.connection_kwargs["retry"]
    assert isinstance(retry, OutageRetry) and copy.deepcopy(retry) is retry  # redis-py deep-copies it per connection
    assert client.ping() is True
    pool = client.connection_pool
    extra = pool.get_connection()  # a second connection of the pool
    try:
        assert extra.retry is retry
    finally:
        pool.release(extra)
    o = outage_of(client)
    assert (o.reached, o.limit_s, o.outages) == (True, 30.0, 0)
    assert outage_of(redis.Redis.from_url(redis_server.url)) is None


def test_a_client_given_up_sends_nothing_more(redis_server, conn):
    client = redis_client(redis_server.url, outage_s=30)
    client.set("k", "before")
    lost = give_up(client, redis.ConnectionError("Connection closed by server."))
    assert isinstance(lost, RedisLost) and lost.limit_s == 30.0 and lost.cause == "Connection closed by server."
    with pytest.raises(RedisLost):
        client.set("k", "after")
    with pytest.raises(RedisLost), client.pipeline() as pipe:
        pipe.set("k", "piped")
        pipe.execute()
    assert conn.get("k") == b"before"  # the live Redis got neither
    assert give_up(client, redis.TimeoutError("again")) is lost  # latched once


def test_connection_conditions_are_told_from_answers():
    assert is_connection_error(redis.ConnectionError("x")) and is_connection_error(redis.TimeoutError("x"))
    assert is_connection_error(RedisLost("redis://h:1/0", 3, 300, "gone"))
    assert is_connection_error(redis.AuthenticationError("x"))  # a login refused mid-job: no fault of the samples
    assert not is_connection_error(redis.ResponseError("OOM command not allowed"))
    assert not is_connection_error(ValueError("x"))
    assert not isinstance(RedisLost("redis://h:1/0", 3, 300, "gone"), (redis.ConnectionError, redis.TimeoutError))


def test_a_lost_redis_is_one_line_naming_url_limit_and_wait_with_exit_75():
    @click.group(cls=HarvestGroup)
    def cli() -> None:
        pass

    @cli.command("svc")
    def svc() -> None:
        raise RedisLost("redis://alice:s3cret@10.0.0.5:6379/0", 301.4, 300, "Connection refused.")

    res = CliRunner().invoke(cli, ["svc"])
    assert res.exit_code == REDIS_LOST_EXIT == 75
    lines = [ln for ln in res.output.splitlines() if ln]
    assert lines == [
        (
            "harvest: error: lost Redis at redis://alice:***@10.0.0.5:6379/0: it answered, then went away (Connection "
            "refused.) and did not come back within 300 s (waited 301 s). Start Redis again (with its data: AOF) and "
            "run the same command: the spool, the packing records and the jobs in flight resume (--redis-wait or "
            "HARVEST_REDIS_OUTAGE_S waits longer)"
        )
    ]


def test_a_hint_is_added_to_the_line():
    e = RedisLost("redis://127.0.0.1:7/0", 12, 10, "Connection refused.")
    e.hint = "its private redis-server did not start again: redis-server exited with 1"
    assert (
        translate(e)
        .for_user()
        .startswith(
            "lost Redis at redis://127.0.0.1:7/0: it answered, then went away (Connection "
            "refused.) and did not come back within 10 s (waited 12 s); its private "
            "redis-server did not start again: redis-server exited with 1. Start Redis"
        )
    )


def test_the_wait_option_help_names_the_contract():
    @click.command()
    @redis_wait_option
    def cmd(redis_wait) -> None:
        click.echo(repr(redis_wait))

    assert CliRunner().invoke(cmd, ["--redis-wait", "12"]).output == "12.0\n"
    assert CliRunner().invoke(cmd, []).output == "None\n"
    text = " ".join(CliRunner().invoke(cmd, ["--help"]).output.split())
    assert f"exit status {REDIS_LOST_EXIT}" in text
    assert f"[default: {OUTAGE_ENV}, else {DEFAULT_OUTAGE_S:.0f}]" in text
