"""The client every long-running harvest process uses (harvest.state.connection) against a real
redis-server (AOF) SIGKILLed and started again on the same port: calls made while it is away
return once it is back, with its data; one log line when the outage starts and one when it ends;
WATCH, MULTI/EXEC and registered scripts behave as their callers expect across the restart; past
the limit the client gives up, and stays given up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
import redis

from harvest.cli.redisproc import RedisServer
from harvest.state.connection import RedisLost, outage_of, redis_client
from tests.support.ops import wait_until


@pytest.fixture
def server(tmp_path):
    """A redis-server that writes and fsyncs its AOF before it answers: with `everysec` a kill may
    take back its last second (an AOF write is postponed while an fsync runs), and these tests
    are about the client, not that second (harvest.ops.recovery is)."""
    s = _start(RedisServer(str(tmp_path / "redis")))
    yield s
    s.stop()


def _start(s: RedisServer) -> RedisServer:
    """Start it (again: same port, same data dir) with every write on disk before its answer."""
    s.start()
    with redis.Redis.from_url(s.url) as c:
        c.config_set("appendfsync", "always")
    return s


class _Call(threading.Thread):
    """`fn()` on a thread of its own: its result, or what it raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e


def _outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "harvest.redis"]


def test_calls_made_while_redis_is_away_return_when_it_is_back(server, caplog):
    caplog.set_level(logging.INFO, logger="harvest.redis")
    conn = redis_client(server.url, outage_s=60)
    conn.set("a", "1")
    conn.hset("h", mapping={"x": "1"})
    server.kill()
    calls = [_Call(lambda: conn.get("a")), _Call(lambda: conn.hgetall("h"))]
    for c in calls:
        c.start()
    o = outage_of(conn)
    wait_until(lambda: o.since is not None, 10, "the client noticed the outage")
    t0 = time.monotonic()
    wait_until(
        lambda: time.monotonic() - t0 > 3 and all(c.is_alive() for c in calls),
        10,
        "the calls still waiting 3 s into the outage",
    )
    _start(server)  # same port, same data dir: the AOF brings the keys back
    for c in calls:
        c.join(30)
    assert [(c.result, c.error) for c in calls] == [(b"1", None), ({b"x": b"1"}, None)]
    lines = _outage_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"Redis at {server.url} went away (") and "waiting up to 60 s" in lines[0]
    assert lines[1].startswith(f"Redis at {server.url} is back after ")
    assert (o.since, o.lost, o.outages) == (None, None, 1)


def test_watch_multi_and_scripts_across_a_restart(server):
    conn = redis_client(server.url, outage_s=60)
    incr = conn.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert incr(keys=["n"], args=[2]) == 2
    conn.set("w", "0")
    with conn.pipeline(transaction=True) as pipe:
        pipe.watch("w")
        assert pipe.get("w") == b"0"
        server.kill()
        _start(server)
        pipe.multi()
        pipe.set("w", "1")
        with pytest.raises(redis.WatchError):  # the watch died with its connection: the caller reads again
            pipe.execute()
    with conn.pipeline(transaction=True) as pipe:  # the caller's next round goes through
        pipe.watch("w")
        pipe.multi()
        pipe.set("w", "2")
        assert pipe.execute() == [True]
    server.kill()
    _start(server)
    with conn.pipeline(transaction=True) as pipe:  # MULTI/EXEC without WATCH: sent again whole
        pipe.set("m", "1")
        pipe.incr("m")
        assert pipe.execute() == [True, 2]
    server.kill()
    _start(server)
    assert incr(keys=["n"], args=[3]) == 5  # NOSCRIPT on the new server: loaded again, run once
    assert conn.get("w") == b"2"


def test_past_the_limit_the_client_gives_up_and_stays_given_up(server, caplog):
    caplog.set_level(logging.INFO, logger="harvest.redis")
    conn = redis_client(server.url, outage_s=2)
    conn.set("a", "1")
    server.kill()
    t0 = time.monotonic()
    with pytest.raises(RedisLost) as e:
        conn.get("a")
    waited = time.monotonic() - t0
    assert 2.0 <= waited < 5.0, waited  # the limit, and then no more than the last backoff step
    assert e.value.url == server.url and e.value.limit_s == 2.0
    assert str(e.value).startswith(f"lost Redis at {server.url}: it answered, then went away (")
    _start(server)
    t0 = time.monotonic()
    with pytest.raises(RedisLost):
        conn.get("a")  # latched: the Redis that came back is not asked
    assert time.monotonic() - t0 < 0.5
    lines = _outage_lines(caplog)
    assert len(lines) == 2 and "went away" in lines[0] and lines[1].endswith(": stopping"), lines
    assert redis.Redis.from_url(server.url).get("a") == b"1"  # the data was never the problem


def test_a_client_that_stays_up_answers_again_once_redis_is_back(server):
    # The metrics exporter's kind (latch=False): past the limit each call raises RedisLost, and
    # once Redis is back the next call is answered.
    conn = redis_client(server.url, outage_s=1, latch=False)
    conn.set("a", "1")
    server.kill()
    for _ in range(2):
        with pytest.raises(RedisLost):
            conn.get("a")
    assert outage_of(conn).lost is None
    _start(server)
    assert conn.get("a") == b"1"
