"""A producer's job names its rows in storage (harvest.formats.jobrows) instead of carrying its
tokens through Redis: the job in Redis is small, every reader gets the exact samples back from
the object, reclaim reads them through the job's copy after RQ deleted the job, and rows that are
gone or changed are refused by name, never read as other tokens."""

from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np
import pytest
from rq import Retry

from harvest.config import RunConfig
from harvest.errors import StorageError
from harvest.formats import jobrows
from harvest.formats.runfile import run_location
from harvest.ops.reclaim import reclaim_spool
from harvest.ops.stranded import STRANDED_GRACE_S, sweep, tend_stranded
from harvest.producer.enqueue import Enqueuer
from harvest.sample import Sample
from harvest.state import jobcopy
from harvest.state.failures import JOB_LOST
from harvest.state.jobs import fetch_job, run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import PayloadError, batch_ids, decode_batch, inline, payload_row
from harvest.state.runstore import publish_run
from harvest.state.spools import SpoolLeases, redis_time
from harvest.workers.context import WorkerContext
from harvest.workers.job import BatchJob


def _samples(n: int, tokens: int = 700, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [
        Sample.build(rng.integers(0, 150_000, size=tokens).tolist(), rng.integers(0, 2, size=tokens).tolist())
        for _ in range(n)
    ]


def _produce(conn, tmp_path, run: str, samples: list[Sample], per_job: int = 4) -> RunConfig:
    cfg = RunConfig(
        run=run, model="/m", capture_points=[2], hidden_size=4, out_url=str(tmp_path / "out"), max_batch_samples=per_job
    )
    enq = Enqueuer(conn, cfg, max_queued=len(samples))
    for s in samples:
        enq.add(s)
    enq.flush()
    return cfg


def _jobs(conn, run: str):
    return sorted(run_queue(conn, run).get_jobs(), key=lambda j: j.id)


def test_a_producers_job_names_its_rows_in_one_object_and_decodes_to_the_exact_samples(conn, tmp_path):
    samples = _samples(10)
    cfg = _produce(conn, tmp_path, "jr1", samples)
    folder = tmp_path / "out" / "jr1" / jobrows.FOLDER
    (name,) = os.listdir(folder)  # one object for the flush's pending samples, named by its digest
    data = (folder / name).read_bytes()
    assert name == hashlib.sha256(data).hexdigest()[:32] + ".jsonl"
    assert data.decode().splitlines() == [payload_row("jr1", s) for s in samples]
    jobs = _jobs(conn, "jr1")
    assert [len(decode_batch(j.args[0])[1]) for j in jobs] == [4, 4, 2]
    got = [s for j in jobs for s in decode_batch(j.args[0])[1]]
    assert sorted((s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in got) == sorted(
        (s.id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples
    )
    payload = jobs[0].args[0]
    assert "samples" not in payload and payload["rows"]["url"] == str(folder / name)
    assert batch_ids(payload) == [s.id for s in decode_batch(payload)[1]]  # who it covers, from Redis alone
    # the job in Redis holds none of its tokens: 4 samples of 700 tokens, a few hundred bytes
    assert len(zlib.decompress(conn.hget(jobs[0].key, "data"))) < 600
    assert inline(inline(payload)) == inline(payload) and "samples" in inline(payload)
    assert Ledger(conn, "jr1").counts()["queued"] == 10 and cfg.run == "jr1"


def test_the_same_rows_make_the_same_object(tmp_path):
    loc = run_location(str(tmp_path), "r")
    rows = [(s.id, payload_row("r", s)) for s in _samples(3, 50)]
    a, b = jobrows.write(loc, rows), jobrows.write(loc, rows)
    assert a.url == b.url and os.listdir(tmp_path / "r" / "jobs") == [os.path.basename(a.url)]
    ids = [sid for sid, _ in rows]
    assert [r["id"] for r in jobrows.read(a.ref(ids[::-1]))] == ids[::-1]  # a job's own order


def test_rows_that_are_gone_or_changed_or_named_outside_jobs_are_refused_by_name(conn, tmp_path):
    _produce(conn, tmp_path, "jr2", _samples(2, 60), per_job=2)
    (job,) = _jobs(conn, "jr2")
    ref = job.args[0]["rows"]
    path = ref["url"]
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw.replace(raw[10:14], b"AAAA", 1) if raw[10:14] != b"AAAA" else raw.replace(raw[10:14], b"BBBB", 1))
    with pytest.raises(
        PayloadError,
        match=rf"^job rows {path} \[0, {ref['at'][1]}\) changed since they were written "
        r"\(digest differs\)$",
    ):
        decode_batch(job.args[0])
    os.unlink(path)
    with pytest.raises(PayloadError, match=rf"^job rows {path} are missing: deleted from the run's jobs/ folder\?$"):
        decode_batch(job.args[0])
    elsewhere = {**job.args[0], "rows": {**ref, "url": str(tmp_path / "run.json")}}
    with pytest.raises(PayloadError, match=r"not a jobs/<digest>.jsonl range$"):
        decode_batch(elsewhere)
    with pytest.raises(PayloadError, match="^malformed job rows reference"):
        decode_batch({**job.args[0], "rows": {"url": path}})


def test_reclaim_reads_a_producers_rows_through_the_job_copy_after_rq_deleted_the_job(conn, tmp_path):
    samples = _samples(4, 80, seed=2)
    cfg = _produce(conn, tmp_path, "jr3", samples)
    (job,) = _jobs(conn, "jr3")
    ledger, spool = Ledger(conn, "jr3"), "spool-lost"
    SpoolLeases(conn, "jr3").renew(spool, "node-a")
    order = decode_batch(job.args[0])[1]
    refs = {s.id: jobcopy.ref(job.id, i) for i, s in enumerate(order)}
    rows = {s.id: payload_row("jr3", s) for s in order}
    assert ledger.settle_job([s.id for s in order], spool, rows, {}, refs=refs)[0] == [s.id for s in order]
    assert conn.hget(ledger.keys.state, order[0].id).decode() == f"s:{spool}{refs[order[0].id]}"  # its ref
    conn.delete(job.key)  # RQ deletes a finished job's hash: the copy keeps where the rows are
    assert ledger.spooled_payloads([s.id for s in order]) == [rows[s.id] for s in order]
    rep = reclaim_spool(conn, cfg, spool)
    assert sorted(rep.samples) == sorted(s.id for s in samples) and rep.lost == []
    again = [s for j in rep.jobs for s in decode_batch(fetch_job(conn, j).args[0])[1]]
    assert sorted((s.id, s.input_ids.tolist()) for s in again) == sorted((s.id, s.input_ids.tolist()) for s in samples)


def test_a_worker_hands_a_job_back_when_the_store_fails_and_refuses_rows_that_are_gone(conn, tmp_path):
    _produce(conn, tmp_path, "jr4", _samples(2, 50), per_job=2)
    (job,) = _jobs(conn, "jr4")
    cfg = RunConfig(run="jr4", model="/m", capture_points=[2], hidden_size=4, out_url=str(tmp_path / "out"))
    dirs = [tmp_path / d for d in ("dump", "spool", "claim")]
    for d in dirs:
        d.mkdir()
    ctx = WorkerContext(
        conn=conn, cfg=cfg, engine=None, dump_dir=str(dirs[0]), spool_dir=str(dirs[1]), claim_dir=str(dirs[2])
    )
    path = job.args[0]["rows"]["url"]
    os.rename(path, path + ".away")
    os.mkdir(path)  # the store answers with an error that is not "no such object" (a directory: EISDIR)
    out = BatchJob(ctx, job.args[0], None).load()
    assert isinstance(out, Retry) and out.max == ctx.retries  # handed back: its samples stay queued, untouched
    os.rmdir(path)
    with pytest.raises(PayloadError, match="are missing: deleted from the run's jobs/ folder"):
        BatchJob(ctx, job.args[0], None).load()  # RQ fails the job; the stranded sweep takes its samples
    os.rename(path + ".away", path)
    loaded = BatchJob(ctx, job.args[0], None)
    assert loaded.load() is None and [s.id for s in loaded.samples] == [s.id for s in decode_batch(job.args[0])[1]]


def test_samples_of_a_failed_job_whose_rows_are_gone_fail_as_job_lost_and_a_rerun_enqueues_them(conn, tmp_path):
    samples = _samples(3, 40, seed=5)
    cfg = publish_run(conn, _produce(conn, tmp_path, "jr5", samples))
    (job,) = _jobs(conn, "jr5")
    os.unlink(job.args[0]["rows"]["url"])
    q = run_queue(conn, "jr5")
    with conn.pipeline() as pipe:  # what RQ does with a job whose function raised
        q.remove(job, pipeline=pipe)
        q.failed_job_registry.add(job, ttl=600, pipeline=pipe)
        pipe.execute()
    t = redis_time(conn)
    assert sorted(tend_stranded(conn, cfg, t).stranded) == sorted(s.id for s in samples)
    rep = tend_stranded(conn, cfg, t + STRANDED_GRACE_S)
    assert sorted(rep.lost) == sorted(s.id for s in samples) and rep.requeued == []
    ledger = Ledger(conn, "jr5")
    assert {f["reason"] for f in ledger.failures().values()} == {JOB_LOST}
    _produce(conn, tmp_path, "jr5", samples)  # the producer holds the tokens again: f -> q, in a new object
    assert ledger.counts()["queued"] == 3 and len(os.listdir(tmp_path / "out" / "jr5" / "jobs")) == 1


def test_a_store_that_is_down_strands_nothing_and_fails_nothing_as_lost(conn, tmp_path):
    samples = _samples(3, 40, seed=6)
    cfg = publish_run(conn, _produce(conn, tmp_path, "jr6", samples))
    (job,) = _jobs(conn, "jr6")
    path = job.args[0]["rows"]["url"]
    os.rename(path, path + ".away")
    os.mkdir(path)  # the store fails on every read (EISDIR)
    t = redis_time(conn)
    assert sweep(conn, cfg, t, {}).stranded == []  # the queued job covers its samples by the ids it names
    q = run_queue(conn, "jr6")
    with conn.pipeline() as pipe:  # RQ failed the job (its worker's retries spent on the store)
        q.remove(job, pipeline=pipe)
        q.failed_job_registry.add(job, ttl=600, pipeline=pipe)
        pipe.execute()
    stamps = {s.id: t for s in samples}
    with pytest.raises(StorageError, match="reading the job rows"):
        sweep(conn, cfg, t + STRANDED_GRACE_S, stamps)  # due, but its rows unreadable: nothing failed
    assert Ledger(conn, "jr6").counts()["queued"] == 3
    os.rmdir(path)
    os.rename(path + ".away", path)
    rep = sweep(conn, cfg, t + STRANDED_GRACE_S, stamps)
    assert sorted(rep.requeued) == sorted(s.id for s in samples) and rep.lost == []


def test_requeue_all_puts_rq_failed_jobs_back_without_reading_their_rows_so_a_store_that_is_down_stops_nothing(
    conn, tmp_path
):
    """`requeue --all` puts RQ's failed jobs back as they are (their sample ids are in Redis) and then the
    ledger's failed samples: a store that is down must not stop either part (no StorageError from a
    failed job's rows before every failed sample went back)."""
    from harvest.ops.requeue import requeue

    samples = _samples(5, 40, seed=7)
    cfg = publish_run(conn, _produce(conn, tmp_path, "jr7", samples, per_job=4))
    ledger, last = Ledger(conn, "jr7"), samples[4]
    (job,) = [j for j in _jobs(conn, "jr7") if last.id not in batch_ids(j.args[0])]  # the first 4 samples' job
    q = run_queue(conn, "jr7")
    with conn.pipeline() as pipe:  # RQ failed the job (its worker's retries spent on the store)
        q.remove(job, pipeline=pipe)
        q.failed_job_registry.add(job, ttl=600, pipeline=pipe)
        pipe.execute()
    ledger.settle_job([], "", {last.id: payload_row("jr7", last)}, {last.id: ("engine-rejected", "simulated")})
    path = job.args[0]["rows"]["url"]
    os.rename(path, path + ".away")
    os.mkdir(path)  # the store fails on every read (EISDIR)
    res = requeue(conn, cfg, all_=True)
    assert (res.rq_jobs_requeued, res.rq_jobs_dropped, res.samples) == ([job.id], [], [last.id])
    assert q.failed_job_registry.get_job_ids(cleanup=False) == [] and job.id in q.job_ids
    assert ledger.counts()["queued"] == 5 and ledger.counts()["failed"] == 0
