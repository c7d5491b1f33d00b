"""Stranded samples (harvest.ops.stranded) on a real Redis with RQ's real registry code: samples
queued whose job RQ filed as failed (RQ's own StartedJobRegistry.cleanup, run with the time a clock
2 h ahead reads) are found by the cheap check, stamped by Redis time, and enqueued again once the
grace has passed, from the job data RQ kept; samples whose job vanished come back from any other
kept row, or fail as job-lost when no row is left; and between checks a janitor pass costs this
module one Redis command."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from rq import SimpleWorker
from rq.job import Job

from harvest.ids import job_id_for
from harvest.ops.stranded import CHECK, CHECK_INTERVAL_S, STRANDED_GRACE_S, SWEEP, tend_stranded
from harvest.sample import Sample
from harvest.state.failures import JOB_LOST
from harvest.state.jobs import SERIALIZER, enqueue_samples, run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch, payload_row
from harvest.state.runstore import publish_run
from harvest.state.spools import redis_time
from tests.support.ops import enqueue
from tests.support.synth import make_config

RUN = "r"


@pytest.fixture
def cfg(conn, tmp_path):
    return publish_run(conn, make_config(f"file://{tmp_path / 'out'}", run=RUN))


def _stamps(conn) -> dict[str, float]:
    return {
        m.decode(): s
        for m, s in conn.zrange(Keys(RUN).stranded, 0, -1, withscores=True)
        if m.decode() not in (CHECK, SWEEP)
    }


def _queued_jobs(conn) -> dict[str, list[list[int]]]:
    q = run_queue(conn, RUN)
    return {j.id: [s.input_ids.tolist() for s in decode_batch(j.args[0])[1]] for j in q.get_jobs()}


def test_samples_of_a_job_rq_failed_are_enqueued_again_after_the_grace(conn, cfg):
    a = [Sample.build([1, 2, 3]), Sample.build([4, 5]), Sample.build([6, 7, 8, 9])]
    b = [Sample.build([11, 12]), Sample.build([13])]
    ja, jb = enqueue(conn, cfg, a), enqueue(conn, cfg, b)
    q = run_queue(conn, RUN)
    w = SimpleWorker([q], connection=conn, serializer=SERIALIZER, name="node-b-1")  # starts job a
    job, _ = w.dequeue_job_and_maintain_ttl(timeout=1)
    w.prepare_execution(job)
    w.prepare_job_execution(job, remove_from_intermediate_queue=True)
    # What RQ's maintenance on a node whose clock runs 2 h ahead does to that running job:
    q.started_job_registry.cleanup(timestamp=redis_time(conn) + 7200)
    assert (
        q.failed_job_registry.get_job_ids(cleanup=False) == [ja]
        and q.started_job_registry.get_job_ids(cleanup=False) == []
    )
    led = Ledger(conn, RUN)
    assert led.counts()["queued"] == 5 and q.job_ids == [jb]

    t = redis_time(conn)
    rep = tend_stranded(conn, cfg, t)
    assert (rep.checked, rep.excess, rep.swept, sorted(rep.stranded), rep.requeued) == (
        True,
        3,
        True,
        sorted(s.id for s in a),
        [],
    )
    assert _stamps(conn) == {s.id: t for s in a}
    assert tend_stranded(conn, cfg, t + CHECK_INTERVAL_S - 1).checked is False  # one check per interval, fleet-wide
    rep = tend_stranded(conn, cfg, t + 20)  # checked, still stranded, not yet due: no sweep
    assert (rep.checked, rep.excess, rep.swept) == (True, 3, False)
    rep = tend_stranded(conn, cfg, t + STRANDED_GRACE_S)
    assert (rep.swept, sorted(rep.requeued), len(rep.jobs), rep.lost) == (True, sorted(s.id for s in a), 1, [])
    assert rep.jobs[0].startswith(job_id_for(RUN, [s.id for s in a]) + "-s")
    assert _queued_jobs(conn) == {jb: [s.input_ids.tolist() for s in b], rep.jobs[0]: [s.input_ids.tolist() for s in a]}
    assert _stamps(conn) == {}
    assert led.counts() == {"queued": 5, "spooled": 0, "done": 0, "failed": 0, "total": 5}
    assert led.stats()["samples_stranded"] == 3
    rep = tend_stranded(conn, cfg, t + STRANDED_GRACE_S + CHECK_INTERVAL_S)
    assert (rep.checked, rep.excess, rep.swept) == (True, 0, False)  # every queued sample is in a job again


def test_rows_come_from_wherever_redis_kept_one_and_samples_without_any_fail_as_job_lost(conn, cfg, caplog):
    q = run_queue(conn, RUN)
    led = Ledger(conn, RUN)
    with_row, orphan, nothing = Sample.build([21, 22]), Sample.build([23, 24, 25]), Sample.build([26])
    led.add_queued([with_row.id, orphan.id, nothing.id])  # their jobs were lost
    led.keep_failed_payloads({with_row.id: payload_row(RUN, with_row)})  # a failed sample requeued once
    with conn.pipeline() as pipe:  # a job hash of this queue in no list or registry
        pipe.multi()
        enqueue_samples(q, RUN, [orphan], "orphan-job", pipe)
        pipe.execute()
    conn.lrem(q.key, 0, "orphan-job")
    assert q.job_ids == [] and conn.exists(Job.key_for("orphan-job"))
    t = redis_time(conn)
    assert tend_stranded(conn, cfg, t).excess == 3
    caplog.set_level(logging.WARNING, logger="harvest.janitor")
    rep = tend_stranded(conn, cfg, t + STRANDED_GRACE_S)
    assert sorted(rep.requeued) == sorted([with_row.id, orphan.id]) and rep.lost == [nothing.id]
    assert sorted(map(sorted, _queued_jobs(conn).values())) == sorted(
        map(sorted, [[with_row.input_ids.tolist(), orphan.input_ids.tolist()]])
    )
    assert {sid: f["reason"] for sid, f in led.failures().items()} == {nothing.id: JOB_LOST}
    assert "produce the dataset again" in led.failures()[nothing.id]["message"]
    lost_lines = [r for r in caplog.records if JOB_LOST in r.getMessage()]
    assert len(lost_lines) == 1 and lost_lines[0].levelno == logging.WARNING
    assert led.counts() == {"queued": 2, "spooled": 0, "done": 0, "failed": 1, "total": 3}
    assert _stamps(conn) == {}


def test_no_sweep_while_every_queued_sample_is_queued_dequeued_started_or_scheduled(conn, cfg):
    q = run_queue(conn, RUN)
    jobs = [enqueue(conn, cfg, [Sample.build([i, i + 1]), Sample.build([i + 2])]) for i in (30, 40, 50, 60)]
    w = SimpleWorker([q], connection=conn, serializer=SERIALIZER, name="node-a-1")
    started, _ = w.dequeue_job_and_maintain_ttl(timeout=1)  # started
    w.prepare_execution(started)
    w.prepare_job_execution(started, remove_from_intermediate_queue=True)
    dequeued, _ = w.dequeue_job_and_maintain_ttl(timeout=1)  # only dequeued (in RQ's intermediate list)
    q.remove(jobs[2])
    q.scheduled_job_registry.schedule(
        Job.fetch(jobs[2], connection=conn, serializer=SERIALIZER), datetime.now(UTC) + timedelta(seconds=30)
    )  # a retry backing off
    assert (started.id, dequeued.id, q.job_ids) == (jobs[0], jobs[1], [jobs[3]])
    t = redis_time(conn)
    rep = tend_stranded(conn, cfg, t)
    assert (rep.checked, rep.excess, rep.swept) == (True, 0, False) and _stamps(conn) == {}


def test_a_job_that_ends_during_the_check_starts_no_sweep(conn, cfg, monkeypatch):
    # The race a busy fleet hits: the check's snapshot counts the job's samples queued, and the
    # job ends (its samples spooled, its hash deleted) before the check reads the job's size.
    from harvest.ops import stranded

    samples = [Sample.build([80, 81]), Sample.build([82])]
    job = enqueue(conn, cfg, samples)
    real, looked = stranded.job_sizes, []

    def ending_meanwhile(c, ids):
        if not looked:
            Ledger(conn, RUN).mark_spooled([s.id for s in samples], owner="spool-1")
            run_queue(conn, RUN).remove(job)
            Job.fetch(job, connection=conn, serializer=SERIALIZER).delete()
        looked.append(list(ids))
        return real(c, ids)

    monkeypatch.setattr(stranded, "job_sizes", ending_meanwhile)
    rep = tend_stranded(conn, cfg, redis_time(conn))
    assert (rep.checked, rep.excess, rep.swept) == (True, 0, False) and _stamps(conn) == {}
    assert looked == [[job]]  # the second look found nothing queued: no size to read


def test_between_checks_a_pass_costs_one_command(conn, cfg):
    enqueue(conn, cfg, [Sample.build([70, 71])])
    t = redis_time(conn)
    assert tend_stranded(conn, cfg, t).checked
    conn.config_resetstat()
    assert not tend_stranded(conn, cfg, t + 1).checked
    calls = {k: v["calls"] for k, v in conn.info("commandstats").items() if k != "cmdstat_config|resetstat"}
    assert calls == {"cmdstat_zscore": 1}
