"""Ledger moves inside a caller's MULTI/EXEC survive a Redis that forgot its scripts: a private
redis-server restarted (its script cache empty, its data kept by its AOF) between redis-py's
load of a pipeline's scripts and the EXEC that harvest's client sends again after the outage,
and a server whose script cache was flushed before the transaction. An EVALSHA queued there
would fail the EXEC with NoScriptError while the transaction's other commands (the jobs enqueued
with the move) ran anyway."""

from __future__ import annotations

import pytest
import redis
from redis.client import Pipeline

from harvest.cli.redisproc import RedisServer
from harvest.collector.collector import Collector
from harvest.formats.index import index_file
from harvest.ops.reclaim import reclaim_spool
from harvest.ops.reconcile import reconcile
from harvest.sample import Sample
from harvest.state.connection import redis_client
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch, payload_row
from harvest.state.runstore import publish_run
from tests.support.ops import enqueue
from tests.support.synth import make_config, spool_samples


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path / "redis")).start()
    yield s
    s.stop()


@pytest.fixture
def conn(server):
    """harvest's client (it waits out an outage and sends a transaction again) on the private server."""
    c = redis_client(server.url, outage_s=30)
    yield c
    c.close()


def _restart_before_exec(monkeypatch, server) -> list[int]:
    """Restart `server` once, gracefully (its AOF keeps every write), just before the first
    transaction's batch is sent: after redis-py loaded the pipeline's scripts, if any."""
    done: list[int] = []
    real = Pipeline._execute_transaction

    def execute(self, connection, commands, raise_on_error):
        if not done:
            done.append(1)
            server.stop()
            server.start()
        return real(self, connection, commands, raise_on_error)

    monkeypatch.setattr(Pipeline, "_execute_transaction", execute)
    return done


def _samples(n: int, seed: int = 0) -> list[Sample]:
    return [Sample.build([seed + i, seed + i + 1, 7], [0, 1, 1]) for i in range(n)]


def _jobs(conn, run) -> list[list[str]]:
    return [[s.id for s in decode_batch(j.args[0])[1]] for j in run_queue(conn, run).get_jobs()]


@pytest.fixture(params=["restart", "flush"])
def forget(request, monkeypatch, server, conn):
    """Make the server forget the ledger's scripts in the way the test is parametrized with."""

    def go() -> list[int]:
        if request.param == "flush":
            conn.script_flush()
            return [1]
        return _restart_before_exec(monkeypatch, server)

    return go


def test_an_enqueue_transaction_moves_the_ledger_on_a_server_that_forgot_the_script(conn, forget, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    samples = _samples(3)
    Ledger(conn, cfg.run).add_queued([samples[0].id])  # the script is in the server's cache now
    forgotten = forget()
    job = enqueue(conn, cfg, samples)  # the producer's MULTI/EXEC: the ledger move and the job together
    assert forgotten
    assert Ledger(conn, cfg.run).states([s.id for s in samples]) == ["q"] * 3
    assert [j.id for j in run_queue(conn, cfg.run).get_jobs()] == [job]


def test_reclaim_moves_and_enqueues_in_one_transaction_on_a_server_that_forgot_the_script(conn, forget, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    ledger, samples = Ledger(conn, cfg.run), _samples(4)
    ids = [s.id for s in samples]
    ledger.add_queued(ids)
    assert ledger.mark_spooled(ids, owner="spool-a", rows=[payload_row(cfg.run, s) for s in samples]) == ids
    ledger.reclaim("spool-b", ids[:1])  # loads the reclaim script: a restart must make the server forget it
    forgotten = forget()
    rep = reclaim_spool(conn, cfg, "spool-a")
    assert forgotten
    assert sorted(rep.samples) == sorted(ids) and ledger.states(ids) == ["q"] * 4
    assert sorted(i for job in _jobs(conn, cfg.run) for i in job) == sorted(ids)
    assert ledger.counts() == {"queued": 4, "spooled": 0, "done": 0, "failed": 0, "total": 4}


def test_reconcile_requeues_a_lost_index_on_a_server_that_forgot_the_script(conn, forget, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", shard_bytes=1))  # one sample a shard
    spool = str(tmp_path / "spool")
    ids = [s.id for s in spool_samples(spool, cfg, [12, 7, 30])]
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued(ids)
    ledger.mark_spooled(ids)
    c = Collector(conn, cfg, spool, node="a", shard_bytes=1)
    while c.step(force=True):
        pass
    assert ledger.states(ids) == ["d"] * 3
    shard = next(n for n in c.out.list("index", ".json") if ids[0] in c.out.read_json(f"index/{n}")["samples"])
    c.out.delete(index_file(shard.removesuffix(".json")))  # lost: its shard still holds the tokens
    ledger.requeue_done([])  # nothing: the scripts of the moves are loaded by the collector's calls already
    forgotten = forget()
    rep = reconcile(conn, cfg)
    assert forgotten
    assert rep.requeued == [ids[0]] and ledger.states(ids) == ["q", "d", "d"]
    assert _jobs(conn, cfg.run) == [[ids[0]]]


def test_a_plain_client_reaches_the_server_again_after_the_restart(server):
    """The fixture's restart is graceful: what the AOF held is there again (the tests above rely on it)."""
    c = redis.Redis.from_url(server.url)
    c.set("k", "v")
    server.stop()
    server.start()
    assert redis.Redis.from_url(server.url).get("k") == b"v"
