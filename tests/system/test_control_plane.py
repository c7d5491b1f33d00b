"""The control plane's cost per sample does not grow with the run, counted on a private
redis-server with INFO commandstats deltas (commands inside Lua scripts included).

- One job of N samples, run by harvest's real RQ worker (HarvestWorker, burst) against the
  zero-cost engine (engines/synthetic.py, real HTTP and dump files, verified as any dump), then
  its shard committed by a real collector: the same commands, one for one, with 100k more samples
  in the ledger; and harvest's own share of a job stays a handful of calls (RQ's is RQ's).
- A status call and a metrics scrape on a ledger of 100k samples (1% failed, four reasons) issue
  exactly as many commands as on one of 1k, and count the failures right (the ledger's
  per-reason counters, not a scan of the failures); a ledger whose counters do not add up (one
  written by an older harvest) is counted by a scan, still right.

bench/fleet.py measures the same costs on a simulated fleet; these tests pin the complexity."""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from collections import Counter

import numpy as np
import pytest
import redis

from harvest.cli.redisproc import RedisServer, free_port
from harvest.collector.collector import Collector
from harvest.config import RunConfig
from harvest.engines.reference import serve
from harvest.engines.synthetic import SyntheticEngine
from harvest.node.dumpdir import claim_dir
from harvest.node.paths import private_dir
from harvest.ops.metrics import RedisCollector, failure_reasons
from harvest.ops.status import compute_status
from harvest.sample import Sample
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import SERIALIZER, run_queue
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.workers.clients.sglang import SGLangClient
from harvest.workers.context import WorkerContext, install
from harvest.workers.rqworker import HarvestWorker
from harvest.workers.safejob import HarvestJob
from tests.support.ops import enqueue

N = 32  # samples a job: the target is per job of 32
POINTS, HIDDEN = [2, 4, 5, 8], 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(str(tmp_path_factory.mktemp("redis-control-plane"))).start()
    yield s
    s.stop()


@pytest.fixture
def r(server) -> redis.Redis:
    c = redis.Redis.from_url(server.url)
    c.flushall()
    return c


def executed(r: redis.Redis, fn) -> Counter:
    """Commands the server executed while `fn` ran (Lua's inner calls included), less the INFO of
    the reading itself."""
    before = {k: v["calls"] for k, v in r.info("commandstats").items()}
    fn()
    after = {k: v["calls"] for k, v in r.info("commandstats").items()}
    out = Counter({k.removeprefix("cmdstat_"): v - before.get(k, 0) for k, v in after.items()})
    out["info"] -= 1
    return +out


def grow(led: Ledger, n: int, start: int, failed_share: int = 0) -> None:
    """`n` more samples through the ledger's own moves: done, and 1 in `failed_share` failed."""
    reasons = ["engine-rejected", "token-mismatch", "incomplete-dump", "nonfinite"]
    for lo in range(start, start + n, 10_000):
        ids = [f"{i:032x}" for i in range(lo, min(start + n, lo + 10_000))]
        led.add_queued(ids)
        failed = ids[::failed_share] if failed_share else []
        if failed:
            led.mark_failed({i: (reasons[k % 4], f"synthetic {k}") for k, i in enumerate(failed)})
        led.mark_done([i for i in ids if i not in set(failed)])


@pytest.fixture
def fleet_node(r, tmp_path):
    """One simulated node in this process: the run, the synthetic engine on a port, a worker
    context (as `harvest worker` installs it) and a collector."""
    cfg = publish_run(
        r,
        RunConfig(
            run="cp",
            model="synthetic",
            capture_points=POINTS,
            hidden_size=HIDDEN,
            out_url=f"file://{tmp_path / 'out'}",
            storage_dtype="fp32",
            num_layers=8,
            max_batch_samples=N,
        ),
    )
    dump, spool = str(tmp_path / "dump"), str(tmp_path / "spool")
    port = free_port()
    httpd = serve(SyntheticEngine(dump, POINTS, HIDDEN), "127.0.0.1", port)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    beat = WorkerBeat(r, cfg.run, "node-a-1-aaaaaa", "node-a", f"http://127.0.0.1:{port}")
    beat.start()
    claim = private_dir(claim_dir(private_dir(dump, "dump dir"), beat.name), "claim dir")
    ctx = WorkerContext(
        conn=r,
        cfg=cfg,
        engine=SGLangClient(f"http://127.0.0.1:{port}"),
        dump_dir=dump,
        spool_dir=spool,
        claim_dir=claim,
        beat=beat,
        node="node-a",
    )
    install(ctx)
    yield cfg, ctx, beat, Collector(r, cfg, spool, node="node-a", max_wait=3600)
    install(None)  # type: ignore[arg-type]  # no context left behind for another test of this process
    beat.stop()  # nor a started heartbeat: keep_alive() in a later test would beat it into this module's Redis, gone
    ctx.engine.close()
    httpd.shutdown()
    httpd.server_close()


def test_one_job_and_its_shard_cost_the_same_commands_whatever_the_ledger_holds(r, fleet_node):
    cfg, ctx, beat, collector = fleet_node
    led = Ledger(r, cfg.run)
    rng = np.random.default_rng(7)

    def one_job_and_shard() -> tuple[Counter, Counter]:
        samples = [Sample.build(rng.integers(0, 128_000, 64)) for _ in range(N)]
        enqueue(r, cfg, samples)
        worker = HarvestWorker(
            [run_queue(r, cfg.run, job_class=HarvestJob)],
            connection=r,
            serializer=SERIALIZER,
            name=beat.name,
            job_class=HarvestJob,
            beat=beat,
        )
        job = executed(r, lambda: worker.work(burst=True, logging_level="WARNING"))
        assert led.states([s.id for s in samples]) == ["s"] * N
        shard = executed(r, lambda: collector.step(force=True))
        assert led.states([s.id for s in samples]) == ["d"] * N
        return job, shard

    one_job_and_shard()  # the scripts loaded, RQ's keys made: what a running worker has done long since
    small_job, small_shard = one_job_and_shard()
    grow(led, 100_000, 0)
    big_job, big_shard = one_job_and_shard()
    assert led.counts()["done"] == 100_000 + 3 * N
    assert big_job == small_job  # one for one: nothing of the job reads the ledger's size
    assert big_shard == small_shard
    # a shard: the spool's states (a plain HMGET), the record with the spool's revocation test and
    # the ledger's id, the fence, done with its stats and the record cleared; a job: RQ's own
    # bookkeeping, with the job's start in its execution's transaction (an EVAL of the heartbeat's
    # job line, the ledger's HMGET), the settle (marks, failures; its stats and latencies at the heartbeat:
    # harvest.state.tally). One call each, whatever N; a shard reads its samples' states twice (the
    # view's HMGET, the fence's), and once more to move them (done).
    assert small_shard["evalsha"] == 3 and small_job["evalsha"] == 1 and small_job["eval"] == 1
    assert small_shard["hmget"] == 3 and small_shard["set"] == 2  # the record, the fence's: no SET of the ledger's id


class _CountingConnection(redis.Connection):
    """Counts round trips (a pipeline is one send) on the client the worker is given."""

    sends = 0

    def send_packed_command(self, command, check_health=True):
        type(self).sends += 1
        return super().send_packed_command(command, check_health)


def _burst(r, cfg, rng, beat, rq_conn, jobs: int) -> int:
    """`jobs` jobs of 4 samples enqueued, then run by a burst worker whose RQ calls go on `rq_conn`:
    the round trips the counting connections sent meanwhile."""
    for _ in range(jobs):
        enqueue(r, cfg, [Sample.build(rng.integers(0, 128_000, 16)) for _ in range(4)])
    _CountingConnection.sends = 0
    HarvestWorker(
        [run_queue(rq_conn, cfg.run, job_class=HarvestJob)],
        connection=rq_conn,
        serializer=SERIALIZER,
        name=beat.name,
        job_class=HarvestJob,
        beat=beat,
    ).work(burst=True, logging_level="WARNING")
    return _CountingConnection.sends


def test_rqs_own_round_trips_a_job_are_a_few_whatever_the_jobs(server, r, fleet_node):
    """RQ's bookkeeping a job, as RQ's SimpleWorker sends it (the suspension flag, the idle state,
    the dequeue's LMOVE and the job's hash, the execution's two transactions, the job's last
    heartbeat, the success), less what harvest.workers.rqworker.HarvestWorker cuts: its worker heartbeat
    (throttled) and its success's reads. Harvest's calls go on the context's client, not counted
    here. Counted as the difference between bursts of 2 and 6 jobs, so the worker's start and end
    cancel out."""
    cfg, _, beat, _ = fleet_node
    rq_conn = redis.Redis.from_url(server.url, connection_class=_CountingConnection)
    burst = functools.partial(_burst, r, cfg, np.random.default_rng(3), beat, rq_conn)
    burst(1)
    per_job = (burst(6) - burst(2)) / 4
    assert Ledger(r, cfg.run).counts()["spooled"] == 4 * 9
    assert per_job == 9, per_job


def test_a_jobs_own_calls_are_one_round_trip_whatever_the_jobs(server, r, fleet_node):
    """Harvest's calls a job (harvest.workers.job), on the worker context's client: the settle, in one
    round trip (the job's start rides in RQ's transaction that starts its execution,
    HarvestWorker.prepare_execution; its end in RQ's outcome transaction). RQ's calls go on another client,
    not counted here; as above, the difference between bursts of 2 and 6 jobs. The heartbeat reads
    as a finished job's: idle, no job, every job counted. The jobs' stats and durations wait in the
    worker's tally (harvest.state.tally) and one flush writes them all: each job's duration once."""
    cfg, ctx, beat, _ = fleet_node
    rng = np.random.default_rng(5)
    counted = redis.Redis.from_url(server.url, connection_class=_CountingConnection)
    mine = WorkerBeat(counted, cfg.run, beat.name, "node-a", beat.identity["engine"])
    counting = dataclasses.replace(ctx, conn=counted, beat=mine)
    install(counting)
    try:
        burst = functools.partial(_burst, r, cfg, rng, mine, r)
        burst(1)
        counting.tally.flush()
        jobs_before = int(r.hget(mine.key, "jobs_done"))
        hist = Ledger(r, cfg.run).keys.histogram("job_seconds")
        observed, spooled = int(r.hget(hist, "count") or 0), Ledger(r, cfg.run).stats()["samples_spooled"]
        per_job = (burst(6) - burst(2)) / 4
    finally:
        install(ctx)
    assert Ledger(r, cfg.run).counts()["spooled"] == 4 * 9
    assert per_job == 1, per_job
    assert int(r.hget(mine.key, "jobs_done")) == jobs_before + 8
    assert int(r.hget(hist, "count")) == observed  # nothing written by the jobs themselves
    assert counting.tally.flush() and not counting.tally.flush()
    assert int(r.hget(hist, "count")) == observed + 8
    assert Ledger(r, cfg.run).stats()["samples_spooled"] == spooled + 8 * 4
    assert {k: r.hget(mine.key, k) for k in ("state", "job", "job_samples", "attempt")} == {
        "state": b"idle",
        "job": b"",
        "job_samples": b"0",
        "attempt": b"",
    }


def test_status_and_metrics_cost_the_same_on_a_ledger_of_100k(r):
    publish_run(
        r,
        RunConfig(
            run="big",
            model="synthetic",
            capture_points=POINTS,
            hidden_size=HIDDEN,
            out_url="/nonexistent",
            num_layers=8,
        ),
    )
    led = Ledger(r, "big")
    grow(led, 1_000, 0, failed_share=100)
    small = executed(r, lambda: compute_status(r, "big"))
    small_m = executed(r, lambda: list(RedisCollector(r, ["big"]).collect()))
    grow(led, 99_000, 1_000, failed_share=100)
    big = executed(r, lambda: compute_status(r, "big"))
    big_m = executed(r, lambda: list(RedisCollector(r, ["big"]).collect()))
    assert big == small and big_m == small_m
    assert sum(big.values()) <= 40 and "hscan" not in big and "hscan" not in big_m
    truth = Counter(json.loads(v)["reason"] for v in r.hvals(led.keys.failed))
    assert sum(truth.values()) == 1_000
    st = compute_status(r, "big")
    assert {f.reason: f.count for f in st.failures} == truth and failure_reasons(r, "big") == truth
    assert all(r.hexists(led.keys.failed, f.example.split(":")[0]) for f in st.failures)


def test_failure_counters_follow_every_move_and_a_ledger_without_them_is_scanned(r):
    led = Ledger(r, "fc")
    ids = [f"{i:032x}" for i in range(10)]
    led.add_queued(ids)
    led.mark_failed({i: ("engine-rejected" if k < 6 else "nonfinite", f"m{k}") for k, i in enumerate(ids)})
    assert led.failure_counts()[0] == {"engine-rejected": 6, "nonfinite": 4}
    assert led.requeue(ids[:3]) == ids[:3]  # f -> q
    assert led.mark_done(ids[6:8]) == ids[6:8]  # f -> d
    counts, examples = led.failure_counts()
    assert counts == {"engine-rejected": 3, "nonfinite": 2}
    assert examples["nonfinite"].startswith(f"{ids[9]}: m9")  # the latest failure of its reason
    assert led.requeue(ids[3:6]) == ids[3:6]
    assert led.failure_counts()[0] == {"nonfinite": 2} and "engine-rejected" not in led.failure_counts()[1]
    r.delete(led.keys.failed_reasons)  # a ledger an older harvest wrote: no counters
    assert led.failure_counts()[0] == {"nonfinite": 2}  # scanned, still right


def test_a_batched_move_is_the_per_sample_move_it_replaced(r):
    """Over several of the script's batches, with ids listed twice and samples in every state: the
    same moves, counters and side tables as one sample at a time."""
    led = Ledger(r, "mv")
    ids = [f"{i:032x}" for i in range(1000)]
    assert led.add_queued(ids + ids[:10]) == ids  # twice in one call: queued once
    assert led.mark_spooled(ids[:600], owner="sp1", rows=[f"row{i}" for i in range(600)]) == ids[:600]
    assert led.mark_failed({i: ("nonfinite", "x") for i in ids[550:700]}) == ids[550:700]  # s and q -> f
    assert led.mark_spooled(ids[690:710] + ids[690:700], owner="sp2") == ids[700:710]  # f stays f
    assert led.counts() == {"queued": 290, "spooled": 560, "done": 0, "failed": 150, "total": 1000}
    assert r.hgetall(led.keys.spool_counts) == {b"sp1": b"550", b"sp2": b"10"}
    owners = Counter(v for v in r.hvals(led.keys.state) if v.startswith(b"s"))
    assert owners == {b"s:sp1": 550, b"s:sp2": 10} and r.hlen(led.keys.spooled_payload) == 550  # sp2's had no rows
    done = led.mark_done(ids[::-1], tokens=[3] * 1000, stats={"shards": 1})
    assert sorted(done) == ids and led.counts()["done"] == 1000
    assert r.hlen(led.keys.spool_counts) == r.hlen(led.keys.spooled_payload) == r.hlen(led.keys.failed) == 0
    assert set(r.hvals(led.keys.state)) == {b"d"}
    assert led.stats() == {"samples_done": 1000, "tokens_done": 3000, "shards": 1}
    assert led.failure_counts() == ({}, {})
