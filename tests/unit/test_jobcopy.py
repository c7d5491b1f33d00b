"""A spooled sample's row kept as a ref to one copy of its job (harvest.state.jobcopy): the copy
is made server-side by the settle call, counts its refs exactly through every move out of `s`
(done, failed, reclaimed, a repair), goes with its last ref, and resolves to the very rows the
job carried, after RQ deleted the job's own hash."""

import json

import numpy as np
import pytest

from harvest.config import RunConfig
from harvest.ops.ledgercheck import check_ledger
from harvest.ops.reclaim import reclaim_spool
from harvest.sample import Sample
from harvest.state import jobcopy
from harvest.state.jobs import enqueue_samples, fetch_job, run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch, payload_row
from harvest.state.spools import SpoolLeases


def _samples(n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(5, 40))
        out.append(Sample.build(rng.integers(0, 70_000, size=t).tolist(), rng.integers(0, 2, size=t).tolist()))
    return out


def _enqueued(conn, run: str, samples: list[Sample], job_id: str) -> Ledger:
    ledger = Ledger(conn, run)
    with conn.pipeline(transaction=True) as pipe:
        pipe.multi()
        ledger.add_queued([s.id for s in samples], pipe=pipe)
        enqueue_samples(run_queue(conn, run), run, samples, job_id, pipe)
        pipe.execute()
    return ledger


def _settle(
    ledger: Ledger,
    run: str,
    samples: list[Sample],
    job_id: str,
    spooled: list[Sample],
    owner: str,
    failures: dict | None = None,
) -> tuple[list[str], list[str]]:
    rows = {s.id: payload_row(run, s) for s in samples}
    refs = {s.id: jobcopy.ref(job_id, i) for i, s in enumerate(samples)}
    return ledger.settle_job([s.id for s in spooled], owner, rows, failures or {}, refs=refs)


def _refs(conn, ledger: Ledger, job_id: str) -> int | None:
    v = conn.hget(ledger.keys.job_copy(job_id), jobcopy.REFS_FIELD)
    return None if v is None else int(v)


def test_refs_are_kept_counted_and_the_copy_goes_with_the_last(conn):
    run, jid = "jc1", "hv-jc1-job"
    samples = _samples(5)
    ledger = _enqueued(conn, run, samples, jid)
    marked, failed = _settle(
        ledger, run, samples, jid, samples[:4], "spool1", failures={samples[4].id: ("bad-dump", "x")}
    )
    assert marked == [s.id for s in samples[:4]] and failed == [samples[4].id]
    kept = conn.hmget(ledger.keys.state, [s.id for s in samples[:4]])  # the refs are in the state values
    assert [k.decode() for k in kept] == [f"s:spool1@{jid}#{i}" for i in range(4)]
    assert conn.exists(ledger.keys.spooled_payload) == 0
    assert _refs(conn, ledger, jid) == 4
    ids = [s.id for s in samples[:4]]
    conn.set("rec", "r0")  # the commit fence reads the owner in a value that holds a ref
    assert not ledger.fence_commit("spool", ids, "rec", "r1", "r0")  # an id that starts spool1's owns none
    assert not ledger.fence_commit("spool1", [s.id for s in samples], "rec", "r1", "r0")  # one failed
    assert ledger.fence_commit("spool1", ids, "rec", "r1", "r0") and conn.get("rec") == b"r1"
    # the failed sample keeps its row in full, for requeue
    assert ledger.failed_payloads([samples[4].id]) == [payload_row(run, samples[4])]
    conn.delete(fetch_job(conn, jid).key)  # RQ deletes its job when the job ends: the copy stays
    rows = ledger.spooled_payloads([s.id for s in samples[:4]])
    assert [decode_batch({"v": 2, "run": run, "samples": [json.loads(r)]})[1][0].id for r in rows] == [
        s.id for s in samples[:4]
    ]
    assert ledger.mark_done([samples[0].id, samples[1].id]) == [samples[0].id, samples[1].id]
    assert _refs(conn, ledger, jid) == 2
    assert ledger.mark_failed({samples[2].id: ("bad-spool", "y")}) == [samples[2].id]
    assert _refs(conn, ledger, jid) == 1
    assert ledger.mark_done([samples[3].id]) == [samples[3].id]
    assert not conn.exists(ledger.keys.job_copy(jid))
    assert conn.hlen(ledger.keys.spooled_payload) == 0


def test_a_retried_job_adds_only_what_it_moves(conn):
    run, jid = "jc2", "hv-jc2-job"
    samples = _samples(3, seed=1)
    ledger = _enqueued(conn, run, samples, jid)
    _settle(ledger, run, samples, jid, samples[:2], "spool1")
    marked, _ = _settle(ledger, run, samples, jid, samples, "spool1")  # the job again: two already spooled
    assert marked == [samples[2].id] and _refs(conn, ledger, jid) == 3


def test_a_job_redis_forgot_keeps_its_rows_in_full(conn):
    # A rollback lost the enqueue (and so the job's hash) of a job a worker was running: the settle
    # call refuses the refs before writing anything, and the rows are sent again in full.
    run, jid = "jc3", "hv-jc3-job"
    samples = _samples(2, seed=2)
    ledger = Ledger(conn, run)
    marked, _ = _settle(ledger, run, samples, jid, samples, "spool1")
    assert marked == [s.id for s in samples]
    assert ledger.spooled_payloads([s.id for s in samples]) == [payload_row(run, s) for s in samples]
    assert not conn.exists(ledger.keys.job_copy(jid))
    assert ledger.counts()["spooled"] == 2


def test_reclaim_rebuilds_jobs_from_the_copy_and_drops_its_refs(conn):
    run, jid = "jc4", "hv-jc4-job"
    samples = _samples(6, seed=3)
    ledger = _enqueued(conn, run, samples, jid)
    leases = SpoolLeases(conn, run)
    spool = "spool-lost"
    leases.renew(spool, "node-a")
    _settle(ledger, run, samples, jid, samples, spool)
    conn.delete(fetch_job(conn, jid).key)
    cfg = RunConfig(run=run, model="/m", capture_points=[2], hidden_size=4, out_url="/o", max_batch_samples=4)
    rep = reclaim_spool(conn, cfg, spool)
    assert sorted(rep.samples) == sorted(s.id for s in samples) and rep.lost == []
    assert not conn.exists(ledger.keys.job_copy(jid))
    again = [s for j in rep.jobs for s in decode_batch(fetch_job(conn, j).args[0])[1]]
    assert sorted((s.id, s.input_ids.tolist()) for s in again) == sorted((s.id, s.input_ids.tolist()) for s in samples)


def test_a_ref_to_a_copy_that_is_gone_or_to_another_sample_resolves_to_nothing(conn):
    run, jid = "jc5", "hv-jc5-job"
    samples = _samples(2, seed=4)
    ledger = _enqueued(conn, run, samples, jid)
    _settle(ledger, run, samples, jid, samples, "spool1")
    key = ledger.keys.state
    conn.hset(key, samples[0].id, f"s:spool1@{jid}#1")  # names the other sample's row
    assert ledger.spooled_payloads([s.id for s in samples]) == [None, payload_row(run, samples[1])]
    conn.hset(key, samples[1].id, "s:spool1@hv-jc5-gone#0")
    assert ledger.spooled_payloads([samples[1].id]) == [None]
    with pytest.raises(ValueError, match="malformed payload ref"):
        jobcopy.parse_ref("@no-index")


def test_the_ledger_check_drops_a_stray_ref_with_its_count(conn):
    run, jid = "jc6", "hv-jc6-job"
    samples = _samples(2, seed=5)
    ledger = _enqueued(conn, run, samples, jid)
    _settle(ledger, run, samples, jid, samples, "spool1")
    conn.hset(ledger.keys.spooled_payload, samples[1].id, f"@{jid}#1")  # a ref an older harvest kept here too
    conn.hincrby(ledger.keys.job_copy(jid), jobcopy.REFS_FIELD, 1)
    conn.hset(ledger.keys.state, samples[0].id, "d")  # a hand repair that forgot the ref's count
    conn.hincrby(ledger.keys.counts, "s", -1)
    conn.hincrby(ledger.keys.counts, "d", 1)
    conn.hincrby(ledger.keys.spool_counts, "spool1", -1)
    rep = check_ledger(conn, run)
    assert rep.problems == [
        f"payload without spooled: 1 (e.g. {samples[1].id})",
        f"copy of job {jid}: its counter says 3 refs, the ledger holds 2",
    ]
    check_ledger(conn, run, repair=True)
    assert _refs(conn, ledger, jid) == 1 and conn.exists(ledger.keys.spooled_payload) == 0
    assert check_ledger(conn, run).ok
    conn.hset(ledger.keys.state, samples[1].id, "d")  # the last ref gone by hand: the copy is an orphan
    conn.hincrby(ledger.keys.counts, "s", -1)
    conn.hincrby(ledger.keys.counts, "d", 1)
    conn.hdel(ledger.keys.spool_counts, "spool1")
    assert check_ledger(conn, run).problems == [f"copy of job {jid}: its counter says 1 refs, the ledger holds 0"]
    check_ledger(conn, run, repair=True)
    assert not conn.exists(ledger.keys.job_copy(jid)) and check_ledger(conn, run).ok


def test_refs_an_older_harvest_kept_in_the_spooled_payload_hash_are_read_and_dropped_as_before(conn):
    run, jid = "jc7", "hv-jc7-job"
    samples = _samples(3, seed=6)
    ledger = _enqueued(conn, run, samples, jid)
    _settle(ledger, run, samples, jid, samples, "spool1")
    k, ids = ledger.keys, [s.id for s in samples]
    for i, sid in enumerate(ids[:2]):  # as a harvest before fused state values wrote them
        conn.hset(k.state, sid, "s")
        conn.hset(k.spool_owner, sid, "spool1")
        conn.hset(k.spooled_payload, sid, f"@{jid}#{i}")
    assert check_ledger(conn, run).ok
    conn.delete(fetch_job(conn, jid).key)
    assert ledger.spooled_payloads(ids) == [payload_row(run, s) for s in samples]
    assert ledger.mark_done(ids[:1]) == ids[:1] and _refs(conn, ledger, jid) == 2
    assert ledger.mark_failed({ids[1]: ("bad-spool", "y")}) == [ids[1]] and _refs(conn, ledger, jid) == 1
    assert conn.exists(k.spooled_payload) == 0 and conn.exists(k.spool_owner) == 0
    assert ledger.mark_done(ids[2:]) == ids[2:] and not conn.exists(k.job_copy(jid))
    assert check_ledger(conn, run).ok
