"""Liveness of started and dequeued jobs by heartbeats and Redis's clock (harvest.ops.liveness), on a
real Redis with RQ's real worker code: HarvestWorker names its execution in its heartbeat in RQ's
own transaction; an execution a live worker is not running (a rolled-back registry) is taken back
once the mismatch outlasts the grace, by Redis time; a job dequeued by a worker that died before
starting it goes back to the queue; retries are due by Redis time, and a due time absurdly far
ahead (a node whose clock runs ahead wrote it) is due at once."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import pytest
from rq import Retry, SimpleWorker
from rq.job import Job
from rq.queue import Queue

from harvest.ops.janitor import MAX_RETRY_INTERVAL_S, promote_due_retries
from harvest.ops.liveness import SUSPECT_GRACE_S, tend_liveness
from harvest.sample import Sample
from harvest.state.heartbeat import HEARTBEAT_TTL_S, WorkerBeat
from harvest.state.jobs import SERIALIZER, run_queue
from harvest.state.keys import Keys, rq_execution_key, worker_key
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.state.spools import redis_time
from harvest.workers.rqworker import PUBSUB_POLL_S, HarvestWorker
from harvest.workers.safejob import HarvestJob
from tests.support.ops import enqueue
from tests.support.synth import make_config
from tests.support.wait import wait_for

RUN = "r"


@pytest.fixture
def run(conn, tmp_path):
    """A run with three queued jobs of two samples each; returns (cfg, job ids)."""
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))
    jobs = [enqueue(conn, cfg, [Sample.build([i, i + 1, 7]), Sample.build([i + 2, 9])]) for i in (10, 20, 30)]
    return cfg, jobs


@pytest.fixture
def worker(conn):
    """A HarvestWorker of the run with its started harvest heartbeat (stopped afterwards)."""
    beats: list[WorkerBeat] = []

    def make(name: str) -> tuple[HarvestWorker, WorkerBeat]:
        beat = WorkerBeat(conn, RUN, name, "node-a", "http://engine")
        beat.start()
        beats.append(beat)
        q = run_queue(conn, RUN, job_class=HarvestJob)
        return HarvestWorker([q], connection=conn, serializer=SERIALIZER, name=name, job_class=HarvestJob), beat

    yield make
    for b in beats:
        b.stop()


def _start_next(w: SimpleWorker):
    """Dequeue and start the next job exactly as RQ's SimpleWorker.execute_job does, up to the call."""
    job, _ = w.dequeue_job_and_maintain_ttl(timeout=1)
    execution = w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    return job, execution


def _named(conn, name: str) -> list[str]:
    return [v.decode() for v in conn.hmget(worker_key(name), "job", "execution")]


def _started(conn) -> list[tuple[str, str]]:
    return run_queue(conn, RUN).started_job_registry.get_job_and_execution_ids(cleanup=False)


def _stamps(conn) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in conn.hgetall(Keys(RUN).suspect_executions).items()}


def test_the_heartbeat_names_the_execution_in_rqs_own_transactions(conn, run, worker):
    _, jobs = run
    w, beat = worker("w-1")
    job, execution = _start_next(w)
    assert job.id == jobs[0] and _started(conn) == [(jobs[0], execution.id)]
    assert _named(conn, "w-1") == [jobs[0], execution.id]
    beat.beat()  # a beat says it again, from memory
    assert _named(conn, "w-1") == [jobs[0], execution.id]
    now = redis_time(conn)
    for t in (now, now + SUSPECT_GRACE_S, now + 10 * SUSPECT_GRACE_S):  # a running job is never suspect
        rep = tend_liveness(conn, RUN, t)
        assert (rep.reaped, rep.suspects, rep.dequeued, rep.dropped) == ([], [], [], [])
    assert _stamps(conn) == {} and _started(conn) == [(jobs[0], execution.id)]
    beat.job_ended()  # the job function returned: still named until RQ removes the execution
    assert _named(conn, "w-1") == [jobs[0], execution.id]
    with conn.pipeline() as pipe:
        w.cleanup_execution(job, pipe, execution)
        pipe.execute()
    assert _started(conn) == [] and _named(conn, "w-1") == ["", ""]


def test_an_execution_a_live_idle_worker_does_not_run_is_taken_back_after_the_grace(conn, run, worker):
    """A Redis rolled back under the fleet: its started registry names a job the worker finished
    after the rollback point; the worker is alive and idle, so no dead-worker reaping applies."""
    _, jobs = run
    w, beat = worker("w-1")
    _job, execution = _start_next(w)
    with conn.pipeline() as pipe:  # the worker ended the job; the rollback brought the execution back
        beat.clear_execution(execution.id, pipe)
        pipe.execute()
    entry = f"{jobs[0]}:{execution.id}"
    q = run_queue(conn, RUN)
    t = redis_time(conn)
    assert tend_liveness(conn, RUN, t).suspects == []
    assert _stamps(conn) == {entry: t}
    assert tend_liveness(conn, RUN, t + SUSPECT_GRACE_S - 1).suspects == [] and _stamps(conn) == {entry: t}
    rep = tend_liveness(conn, RUN, t + SUSPECT_GRACE_S)
    assert (rep.suspects, rep.reaped, rep.gave_up, rep.dropped) == ([entry], [], [], [])
    assert q.job_ids == [jobs[1], jobs[2], jobs[0]] and _started(conn) == [] and _stamps(conn) == {}
    assert not conn.exists(rq_execution_key(jobs[0], execution.id))
    assert conn.hgetall(Keys(RUN).reaped) == {}  # not a death: not counted against max_reaps
    assert Ledger(conn, RUN).counts()["queued"] == 6


def test_a_mismatch_that_resolves_loses_its_stamp(conn, run, worker):
    _, jobs = run
    w, beat = worker("w-1")
    _job, execution = _start_next(w)
    with conn.pipeline() as pipe:
        beat.clear_execution(execution.id, pipe)
        pipe.execute()
    t = redis_time(conn)
    tend_liveness(conn, RUN, t)
    assert list(_stamps(conn)) == [f"{jobs[0]}:{execution.id}"]
    with conn.pipeline() as pipe:  # the worker's next beat names it again (it was running it after all)
        beat.name_execution(jobs[0], execution.id, pipe)
        pipe.execute()
    assert tend_liveness(conn, RUN, t + SUSPECT_GRACE_S).suspects == [] and _stamps(conn) == {}
    assert _started(conn) == [(jobs[0], execution.id)]


def test_a_stale_execution_beside_the_one_its_worker_runs_is_dropped_without_a_second_enqueue(conn, run, worker):
    _, jobs = run
    w, beat = worker("w-1")
    job, stale = _start_next(w)
    with conn.pipeline() as pipe:  # the same job started again by the same worker: a second execution
        beat.clear_execution(stale.id, pipe)
        pipe.execute()
    current = w.prepare_execution(job)
    w.prepare_job_execution(job)  # sends the transaction prepare_execution began (harvest.workers.rqworker)
    assert _named(conn, "w-1") == [jobs[0], current.id]
    t = redis_time(conn)
    tend_liveness(conn, RUN, t)
    rep = tend_liveness(conn, RUN, t + SUSPECT_GRACE_S)
    assert (rep.suspects, rep.dropped) == ([], [f"{jobs[0]}:{stale.id}"])
    assert _started(conn) == [(jobs[0], current.id)] and run_queue(conn, RUN).job_ids == jobs[1:]


def test_a_live_worker_naming_another_job_gets_the_old_one_taken_back(conn, run, worker):
    _, jobs = run
    w, beat = worker("w-1")
    _first, e1 = _start_next(w)
    with conn.pipeline() as pipe:
        beat.clear_execution(e1.id, pipe)
        pipe.execute()
    _second, e2 = _start_next(w)  # it runs the second job now; the first one's execution was rolled back in
    t = redis_time(conn)
    tend_liveness(conn, RUN, t)
    assert _stamps(conn) == {f"{jobs[0]}:{e1.id}": t}
    rep = tend_liveness(conn, RUN, t + SUSPECT_GRACE_S)
    assert rep.suspects == [f"{jobs[0]}:{e1.id}"]
    assert _started(conn) == [(jobs[1], e2.id)] and run_queue(conn, RUN).job_ids == [jobs[2], jobs[0]]


def test_dead_workers_execution_is_reaped_even_once_its_execution_hash_expired(conn, run):
    _, jobs = run
    w = SimpleWorker([run_queue(conn, RUN)], connection=conn, serializer=SERIALIZER, name="gone-1")  # no heartbeat
    _job, execution = _start_next(w)
    conn.delete(rq_execution_key(jobs[0], execution.id))  # as its TTL (job timeout + 60 s, Redis's clock) does
    rep = tend_liveness(conn, RUN, redis_time(conn))
    assert (rep.reaped, rep.suspects, rep.dropped) == ([jobs[0]], [], [])
    assert run_queue(conn, RUN).job_ids == [jobs[1], jobs[2], jobs[0]] and _started(conn) == []
    assert conn.hget(Keys(RUN).reaped, jobs[0]) == b"1"


def test_an_execution_whose_job_is_gone_is_dropped(conn, run):
    _, jobs = run
    w = SimpleWorker([run_queue(conn, RUN)], connection=conn, serializer=SERIALIZER, name="gone-2")
    _job, execution = _start_next(w)
    conn.delete(rq_execution_key(jobs[0], execution.id), Job.key_for(jobs[0]))
    rep = tend_liveness(conn, RUN, redis_time(conn))
    assert (rep.reaped, rep.dropped) == ([], [f"{jobs[0]}:{execution.id}"]) and _started(conn) == []


def test_a_job_dequeued_by_a_worker_that_died_before_starting_it_goes_back_to_the_queue(conn, run):
    _, jobs = run
    q = run_queue(conn, RUN)
    job, _ = Queue.dequeue_any([q], timeout=1, connection=conn, serializer=SERIALIZER)  # BLMOVE, then the kill
    assert job.id == jobs[0] and q.intermediate_queue.get_job_ids() == [jobs[0]]
    t = redis_time(conn)
    assert tend_liveness(conn, RUN, t).dequeued == [] and _stamps(conn) == {f"{jobs[0]}:dequeued": t}
    assert tend_liveness(conn, RUN, t + SUSPECT_GRACE_S - 1).dequeued == []
    assert tend_liveness(conn, RUN, t + SUSPECT_GRACE_S).dequeued == [jobs[0]]
    assert q.job_ids == [jobs[1], jobs[2], jobs[0]] and q.intermediate_queue.get_job_ids() == []
    assert _stamps(conn) == {}


def test_retries_are_due_by_redis_time_and_a_due_time_absurdly_far_ahead_is_due_now(conn, run):
    _, jobs = run
    q = run_queue(conn, RUN)
    for j in jobs:
        q.remove(j)
    now = redis_time(conn)
    reg = q.scheduled_job_registry
    conn.zadd(
        reg.key,
        {
            jobs[0]: math.floor(now) - 5,  # due
            jobs[1]: math.floor(now) + 100,  # backing off
            jobs[2]: math.floor(now) + 7200,
        },
    )  # scheduled by a node whose clock runs 2 h ahead
    assert promote_due_retries(conn, RUN, now) == [jobs[0], jobs[2]]
    assert q.job_ids == [jobs[0], jobs[2]] and reg.get_job_ids(cleanup=False) == [jobs[1]]
    conn.zadd(reg.key, {jobs[1]: math.floor(now) + MAX_RETRY_INTERVAL_S})  # the longest backoff: not absurd
    assert promote_due_retries(conn, RUN, now) == [] and reg.get_job_ids(cleanup=False) == [jobs[1]]


def test_a_retry_is_scheduled_by_redis_time_whatever_the_nodes_clock(conn, run, worker, monkeypatch):
    """RQ schedules a returned Retry at its node's `now() + interval`; HarvestWorker stamps it again
    by Redis's TIME. The node's clock is shifted 2 h ahead for RQ's job code only, as a skewed node's."""
    import rq.job
    import rq.utils

    monkeypatch.setattr(rq.job, "now", lambda: rq.utils.now() + timedelta(hours=2))
    _, jobs = run
    w, _ = worker("w-1")
    job, execution = _start_next(w)
    job.ended_at = job.started_at
    before = math.ceil(redis_time(conn))
    w.handle_job_retry(job, run_queue(conn, RUN), Retry(max=3, interval=[120]), job.started_job_registry, execution)
    after = math.ceil(redis_time(conn))
    score = conn.zscore(run_queue(conn, RUN).scheduled_job_registry.key, jobs[0])
    assert before + 120 <= score <= after + 120
    assert _started(conn) == [] and _named(conn, "w-1") == ["", ""]


def test_a_held_janitor_lock_makes_the_run_wide_part_once_per_hold_for_the_fleet(conn, run):
    from harvest.ops.janitor import janitor_pass

    _, jobs = run
    lock = Keys(RUN).janitor_lock
    janitor_pass(conn, RUN, hold_s=5)
    assert 0 < conn.pttl(lock) <= 5000
    w = SimpleWorker([run_queue(conn, RUN)], connection=conn, serializer=SERIALIZER, name="gone-3")
    _start_next(w)  # a worker with no heartbeat: dead
    assert janitor_pass(conn, RUN, hold_s=5).reaped == []  # another worker's pass within the hold
    conn.delete(lock)  # as its TTL does, by Redis's clock
    assert janitor_pass(conn, RUN).reaped == [jobs[0]] and not conn.exists(lock)


def test_a_new_redis_holds_reaping_by_a_missing_heartbeat_until_its_stamp_by_redis_time(conn, run, tmp_path):
    from harvest.ops.janitor import janitor_pass
    from harvest.ops.liveness import hold_reaping

    _, jobs = run
    keys = Keys(RUN)
    w = SimpleWorker([run_queue(conn, RUN)], connection=conn, serializer=SERIALIZER, name="gone-4")
    conn.sadd(keys.workers, "gone-4")
    _job, execution = _start_next(w)  # its heartbeat is missing: alive on a new Redis, or dead
    claim_dir = tmp_path / "dumps" / ".claimed-gone-4"
    claim_dir.mkdir(parents=True)
    old = time.time() - 60
    os.utime(claim_dir, (old, old))
    t = redis_time(conn)
    until = hold_reaping(conn, RUN)  # as harvest.ops.recovery does for a new server
    assert t + HEARTBEAT_TTL_S <= until <= redis_time(conn) + HEARTBEAT_TTL_S
    assert hold_reaping(conn, RUN, 1) == until  # a hold is never shortened
    rep = tend_liveness(conn, RUN, t)
    assert (rep.reaped, rep.held, rep.reap_held) == ([], [f"{jobs[0]}:{execution.id}"], True)
    rep = janitor_pass(conn, RUN, str(tmp_path / "dumps"))
    assert (rep.reaped, rep.forgotten_workers, rep.claim_dirs_removed) == ([], [], [])
    assert _started(conn) == [(jobs[0], execution.id)] and claim_dir.exists()
    assert tend_liveness(conn, RUN, until - 0.01).reaped == []
    rep = tend_liveness(conn, RUN, until)  # by Redis's clock, whatever the node's
    assert (rep.reaped, rep.held, rep.reap_held) == ([jobs[0]], [], False)
    conn.set(keys.reap_after, repr(redis_time(conn) - 1))  # the hold over: the rest of the janitor too
    rep = janitor_pass(conn, RUN, str(tmp_path / "dumps"))
    assert rep.forgotten_workers == ["gone-4"] and rep.claim_dirs_removed == [".claimed-gone-4"]


def test_a_workers_command_thread_stops_within_its_poll_even_after_its_unsubscribe_was_read(conn, worker):
    """RQ's command thread (pubsub) is stopped at every worker's teardown, and redis-py 8's stop waits
    for it. Once the thread has read the unsubscribe reply it waits in `get_message` to be subscribed
    again, for RQ's sleep time: 60 s (RQ 3.0), forever (2.x). A burst worker's teardown stalled a
    minute under load that way. HarvestWorker's thread polls every PUBSUB_POLL_S (1 s): the bound
    below is generous for a loaded machine, and a third of RQ's."""
    w, _ = worker("w-pubsub")
    w.subscribe()
    wait_for(lambda: w.pubsub.subscribed, timeout=10, what="the command thread subscribed")
    w.pubsub.unsubscribe()
    wait_for(lambda: not w.pubsub.subscribed, timeout=10, what="the thread read the unsubscribe reply")
    t0 = time.monotonic()
    w.pubsub_thread.stop()
    took = time.monotonic() - t0
    w.pubsub.close()
    assert not w.pubsub_thread.is_alive() and took < 20 * PUBSUB_POLL_S, took
