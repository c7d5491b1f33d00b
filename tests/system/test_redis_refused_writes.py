"""A Redis that answers but refuses writes is waited out like an outage, at the client's one seam
(harvest.state.connection): out of memory (maxmemory with noeviction), MISCONF (a failed RDB save
with stop-writes-on-bgsave-error) and READONLY (a replica), each made real on a private
redis-server. A refused write blocks, one log line names the cause and its fix, and the write is
done once the server takes writes again; past the limit, RedisLost names the refusal."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable

import pytest
import redis

from harvest.cli.redisproc import RedisServer
from harvest.state.connection import RedisLost, redis_client
from harvest.state.refusal import PROBE_KEY
from tests.support.ops import wait_until


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path / "redis"), appendonly=False).start()
    yield s
    s.stop()


def _oom(admin: redis.Redis, tmp_path) -> Callable[[], None]:
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    return lambda: admin.config_set("maxmemory", 0)


def _misconf(admin: redis.Redis, tmp_path) -> Callable[[], None]:
    blocker = tmp_path / "redis" / admin.config_get("dbfilename")["dbfilename"] / "x"
    blocker.mkdir(parents=True)  # a folder where the save renames its file to: the save fails
    admin.config_set("save", "3600 1")  # stop-writes-on-bgsave-error applies with save points
    admin.bgsave()
    wait_until(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err", 10, "the RDB save failed")

    def fix() -> None:
        shutil.rmtree(blocker.parent)
        admin.bgsave()

    return fix


def _readonly(admin: redis.Redis, tmp_path) -> Callable[[], None]:
    primary = RedisServer(str(tmp_path / "primary"), appendonly=False).start()
    port = int(primary.url.rsplit(":", 1)[1].split("/")[0])
    admin.replicaof("127.0.0.1", port)
    wait_until(lambda: admin.info("replication")["master_link_status"] == "up", 10, "the replica synced")

    def fix() -> None:
        admin.replicaof("NO", "ONE")
        primary.stop()

    return fix


CASES = {
    "OOM": (_oom, "Redis is out of memory", "raise its maxmemory"),
    "MISCONF": (_misconf, "Redis cannot save to disk", "free or fix the disk under Redis's dir"),
    "READONLY": (_readonly, "Redis is a read-only replica", "point harvest at the primary"),
}


@pytest.mark.parametrize("code", sorted(CASES))
def test_a_refused_write_waits_then_goes_on(server, tmp_path, caplog, code):
    refuse, cause, fix = CASES[code]
    admin = redis.Redis.from_url(server.url)
    client = redis_client(server.url, outage_s=60)
    client.set("before", 1)
    end = refuse(admin, tmp_path)
    with pytest.raises(redis.ResponseError):
        admin.set("k", "v")  # the server refuses writes now
    client.get("before")  # and answers reads
    caplog.set_level(logging.WARNING, logger="harvest.redis")
    done: list[object] = []
    writer = threading.Thread(target=lambda: done.append(client.set("k", "v")), daemon=True)
    writer.start()
    wait_until(lambda: "refuses writes" in caplog.text, 10, "the refusal's line")
    [line] = [r.getMessage() for r in caplog.records if "refuses writes" in r.getMessage()]
    assert line.startswith(f"Redis at {server.url} refuses writes ({code}: {cause}") and f"; fix: {fix}" in line, line
    assert writer.is_alive() and not done  # waiting, no traceback, no exit
    end()
    writer.join(30)
    assert done == [True] and admin.get("k") == b"v"
    assert "takes writes again after" in caplog.text
    assert admin.exists(PROBE_KEY) == 0  # the probe wrote nothing


def test_a_watched_transaction_reads_again_once_writes_are_taken(server, tmp_path, caplog):
    """A WATCHed EXEC refused: the caller's loop reads again after the wait, never an unguarded EXEC."""
    caplog.set_level(logging.WARNING, logger="harvest.redis")
    admin = redis.Redis.from_url(server.url)
    client = redis_client(server.url, outage_s=60)
    client.set("n", 1)
    _oom(admin, tmp_path)
    reads: list[int] = []

    def incr_watched() -> None:
        with client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch("n")
                    reads.append(int(pipe.get("n") or 0))
                    pipe.multi()
                    pipe.set("n", reads[-1] + 1)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    t = threading.Thread(target=incr_watched, daemon=True)
    t.start()
    wait_until(lambda: "refuses writes" in caplog.text, 10, "the refused EXEC")
    admin.delete("n")  # another client writes meanwhile (DEL is taken out of memory): the watch must see it
    admin.config_set("maxmemory", 0)
    t.join(30)
    assert not t.is_alive() and reads == [1, 0] and admin.get("n") == b"1"


def test_refused_past_the_limit_is_redis_lost_naming_the_refusal(server, tmp_path):
    admin = redis.Redis.from_url(server.url)
    client = redis_client(server.url, outage_s=1)
    client.ping()
    _oom(admin, tmp_path)
    with pytest.raises(RedisLost) as e:
        client.set("k", "v")
    assert e.value.refused and e.value.exit_status == 75
    assert e.value.line().startswith(
        f"Redis at {server.url} refused writes for 1 s (waited 1 s): Redis is out of "
        "memory (used memory over maxmemory, policy noeviction); raise its maxmemory"
    )
    with pytest.raises(RedisLost):  # latched: nothing more reaches Redis
        client.get("k")
    admin.config_set("maxmemory", 0)
