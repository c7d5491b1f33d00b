"""A Redis new to a run holds reaping (harvest.ops.recovery, harvest.ops.liveness): a private
redis-server restarted (with its AOF, or empty) under a live worker whose heartbeat it lost is
noticed by `Recovery.check`, which sets `Keys.reap_after` to the server's TIME + one heartbeat
TTL; a janitor pass right after takes nothing back, and the worker's next beat makes its job
healthy again. A run's first server holds nothing, so a fresh run reaps at once."""

from __future__ import annotations

import pytest
from rq import SimpleWorker

from harvest.cli.redisproc import RedisServer
from harvest.ops.janitor import janitor_pass
from harvest.ops.liveness import tend_liveness
from harvest.ops.recovery import Recovery, hold_on_new_server, server_id
from harvest.sample import Sample
from harvest.state.connection import redis_client
from harvest.state.heartbeat import HEARTBEAT_TTL_S, WorkerBeat
from harvest.state.jobs import SERIALIZER, run_queue
from harvest.state.keys import Keys, worker_key
from harvest.state.runstore import publish_run
from harvest.state.spools import redis_time
from tests.support.cli import harvest_cli
from tests.support.ops import enqueue
from tests.support.synth import make_config

RUN = "r"


def _started_job(conn, cfg, name: str) -> str:
    """A job started by worker `name` (RQ's own dequeue and execution), as a running worker holds it."""
    job_id = enqueue(conn, cfg, [Sample.build([1, 2, 3]), Sample.build([4, 5])])
    w = SimpleWorker([run_queue(conn, RUN)], connection=conn, serializer=SERIALIZER, name=name)
    job, _ = w.dequeue_job_and_maintain_ttl(timeout=1)
    w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    assert job.id == job_id
    return job_id


@pytest.fixture
def server(tmp_path):
    s = RedisServer(str(tmp_path / "redis")).start()  # with its AOF: the started job survives the restart
    yield s
    s.stop()


def test_a_restarted_redis_holds_reaping_until_the_live_worker_beats_again(server, tmp_path):
    conn = redis_client(server.url, outage_s=30)
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
    rec = Recovery(conn, cfg)
    assert rec.check(force=True) and conn.get(Keys(RUN).reap_after) is None  # the run's first server
    beat = WorkerBeat(conn, RUN, "w-live", "node-a", "http://engine")
    beat.start()
    try:
        job_id = _started_job(conn, cfg, "w-live")
        beat.job_started(job_id, 2, 1)
        assert tend_liveness(conn, RUN, redis_time(conn)).reaped == []  # healthy: its heartbeat names the job
        before = server_id(conn)
        conn.delete(worker_key("w-live"))  # the beat lost with the server's last second (or all of it)
        server.stop()
        server.start()
        assert rec.check(force=True)  # a new server: reconciled, and reaping held
        assert server_id(conn) != before
        rep = janitor_pass(conn, RUN)  # right after the restart, before the worker beats again
        assert (rep.reaped, rep.forgotten_workers) == ([], [])
        assert len(tend_liveness(conn, RUN, redis_time(conn)).held) == 1
        until = float(conn.get(Keys(RUN).reap_after))
        assert 0 < until - redis_time(conn) <= HEARTBEAT_TTL_S
        beat.beat()  # the live worker's next beat names its job again
        assert tend_liveness(conn, RUN, until).reaped == []  # healthy, hold or not
    finally:
        beat.stop()


def test_a_wiped_redis_holds_reaping_and_gets_the_run_back(tmp_path):
    s = RedisServer(str(tmp_path / "redis"), appendonly=False).start()
    try:
        conn = redis_client(s.url, outage_s=30)
        cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
        rec = Recovery(conn, cfg)
        assert rec.check(force=True) and conn.get(Keys(RUN).reap_after) is None
        s.stop()
        s.start()  # no persistence: empty
        assert not conn.exists(Keys(RUN).config)
        t = redis_time(conn)
        assert rec.check(force=True)
        assert conn.exists(Keys(RUN).config) and t < float(conn.get(Keys(RUN).reap_after)) <= t + HEARTBEAT_TTL_S + 5
    finally:
        s.stop()


def test_a_run_first_reconciled_holds_nothing_and_a_rolled_back_epoch_holds(conn, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
    keys = Keys(RUN)
    assert Recovery(conn, cfg).check(force=True) and conn.get(keys.reap_after) is None
    assert not Recovery(conn, cfg).check(force=True) and conn.get(keys.reap_after) is None  # reconciled already
    conn.set(keys.ledger_epoch, "an-older-server")  # as a rollback or a failover restores it
    t = redis_time(conn)
    assert Recovery(conn, cfg).check(force=True)
    until = float(conn.get(keys.reap_after))
    assert t + HEARTBEAT_TTL_S <= until <= redis_time(conn) + HEARTBEAT_TTL_S
    assert 0 < conn.ttl(keys.reap_after) <= HEARTBEAT_TTL_S + 2  # gone with the hold


def test_the_operators_janitor_right_after_a_rollback_holds_reaping(conn, redis_server, tmp_path):
    """`harvest janitor` keeps no Recovery: on a server the run's ledger was not reconciled on, it
    holds reaping (harvest.ops.recovery.hold_on_new_server) before its pass, so a worker whose
    heartbeat the rollback took is not taken for dead; once the run's processes reconciled, the
    same command reaps its job."""
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
    keys = Keys(RUN)
    Recovery(conn, cfg).check(force=True)
    job_id = _started_job(conn, cfg, "w-gone")
    conn.set(keys.ledger_epoch, "an-older-server")  # as a rollback restores it: not this server
    args = ("janitor", "--run", RUN, "--redis", redis_server.url)
    res = harvest_cli(*args, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (
        f"Redis server {server_id(conn)[:12]} is new to run {RUN} and its ledger is not reconciled on it yet"
        in res.stderr
    )
    assert res.stdout.startswith("reaped 0 jobs") and conn.exists(keys.reap_after)
    assert job_id in run_queue(conn, RUN).started_job_registry.get_job_ids(cleanup=False)
    res = harvest_cli("reconcile", "--run", RUN, "--redis", redis_server.url, timeout=120)  # as a worker would
    assert res.returncode == 0 and conn.get(keys.ledger_epoch).decode() == server_id(conn), res.stderr[-2000:]
    conn.delete(keys.reap_after)  # (the hold it took on a server new to the ledger, over)
    res = harvest_cli(*args, timeout=120)
    assert res.returncode == 0 and "is new to run" not in res.stderr, res.stderr[-2000:]
    assert res.stdout.startswith("reaped 1 jobs"), res.stdout


def test_hold_on_new_server_judges_a_server_new_as_recovery_does(conn, tmp_path):
    """Held: a recorded epoch of another server; no epoch on a server that lost the run, or that
    replaced the one the caller's last pass talked to. Not held: the epoch is this server's, or none
    is recorded yet on the run's first server."""
    keys = Keys(RUN)
    publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
    sid = server_id(conn)

    def held(seen=None) -> bool:
        conn.delete(keys.reap_after)
        got_sid, was_held = hold_on_new_server(conn, RUN, seen)
        assert got_sid == sid and was_held == (conn.get(keys.reap_after) is not None)
        return was_held

    assert not held() and not held(sid)  # the run's first server, never reconciled
    assert held("another-server")  # no epoch, but not the server the last pass talked to
    conn.set(keys.ledger_epoch, "an-older-server")
    assert held() and held(sid)
    conn.set(keys.ledger_epoch, sid)
    assert not held() and not held("another-server")  # reconciled on this one
    conn.delete(keys.ledger_epoch, keys.config)
    assert held()  # a server that lost the run
