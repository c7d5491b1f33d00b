"""Where a job's Redis CPU goes: each ledger step of a job's samples alone, on a run-wide ledger.

    python bench/job_cost.py [--ledger 100000] [--job 32] [--jobs 100] [--redis-core 0]

bench/fleet.py gives a fleet's Redis CPU per sample; this splits one job's share of it. A private
redis-server (AOF everysec, as harvest runs it) holds a ledger of `--ledger` samples (a third
spooled, a third done, the rest queued, synthesized through the ledger's own scripts), so a
sample's fields are found in hashes as large as a run's. Then `--jobs` jobs of `--job` new samples
each go through every step of a sample's life, through harvest's own calls: the producer's move
to queued, the worker's take and settle, the collector's view, record (after a view: with its
spool's revocation test), commit fence and done. Per step it prints the script's µs (commandstats: EVALSHA, its inner
commands included), how much of it the commands the script ran (the hash reads and writes), and
the rest (Lua, the conversion of arguments and replies, the AOF copy of each write); a step of
plain commands (the view) is its commands alone.

Baselines from the same run, since this machine's speed varies from hour to hour:
- an EVALSHA of `return 1`: a script call's floor;
- an HMGET of `--job` fields picked at random in the ledger's state hash (cold: what each step's
  first read of a sample costs), the same read made by a script (what carrying each id into Lua and
  each value out costs), and an HMGET of the same fields again (warm);
- a PING round trip's main-thread CPU (what any round trip costs the server besides its command).

Last, one worker (harvest's RQ worker, in this process, burst) runs `--jobs` jobs against the
synthetic engine: its Redis CPU per job, of which harvest's scripts and the rest (RQ's own
commands, and every round trip's system calls), as bench/fleet.py's in-process line.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import redis  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.sample import Sample  # noqa: E402
from harvest.state import jobcopy  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.packing import PackingRecord, PackingRecords  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from tests.support.fleet import RedisStats, install_counter, rq_cost  # noqa: E402
from tests.support.ops import enqueue  # noqa: E402

STEPS = (
    "producer: to queued",
    "worker: take",
    "worker: settle",
    "collector: view",
    "collector: record",
    "collector: fence",
    "collector: done",
)


def commandstats(conn: redis.Redis) -> Counter:
    return Counter({k.removeprefix("cmdstat_"): v["usec"] for k, v in conn.info("commandstats").items()})


class StepCost:
    """Commandstats µs by step: the step's scripts (EVALSHA) and, of those, the commands they ran;
    a step made of plain commands (the collector's view) is its commands alone. A step is measured
    over all the jobs at once (one INFO before and after): an INFO between two calls evicts the
    caches the next call would find warm, 15-20 µs a call on this VM."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn, self.script, self.inner = conn, Counter(), Counter()

    def measure(self, step: str, calls: list) -> list:
        before = commandstats(self.conn)
        out = [fn() for fn in calls]
        d = commandstats(self.conn) - before
        inner = sum(v for k, v in d.items() if k not in ("evalsha", "info"))
        self.script[step] += d["evalsha"] or inner
        self.inner[step] += inner
        return out


def fill(led: Ledger, size: int) -> list[str]:
    """A run in progress: `size` samples, a third spooled, a third done, the rest queued."""
    ids = [os.urandom(16).hex() for _ in range(size)]
    for lo in range(0, size, 2000):
        part = ids[lo : lo + 2000]
        led.add_queued(part)
        kind = (lo // 2000) % 3
        if kind:
            led.settle_job(part, "spool-old", {i: "row" for i in part}, {})
        if kind == 2:
            led.mark_done(part)
    return ids


def baselines(
    conn: redis.Redis, led: Ledger, ids: list[str], job: int, n: int = 60, rounds: int = 7
) -> dict[str, float]:
    """µs a call, the median of `rounds` rounds of `n` calls (a round that met a neighbour's burst is dropped)."""
    one, state = conn.register_script("return 1"), led.keys.state
    hm = conn.register_script("return #redis.call('HMGET', KEYS[1], unpack(ARGV))")
    out = {}
    for name, fn in (
        ("EVALSHA of `return 1`", lambda: one()),
        (f"HMGET of {job} random fields, cold", lambda: conn.hmget(state, random.sample(ids, job))),
        ("the same HMGET in a script", lambda: hm(keys=[state], args=random.sample(ids, job))),
        (f"HMGET of {job} fields, warm", lambda: conn.hmget(state, ids[:job])),
    ):
        per_call = []
        for _ in range(rounds):
            before = commandstats(conn)
            for _ in range(n):
                fn()
            d = commandstats(conn) - before
            per_call.append(sum(v for k, v in d.items() if k != "info") / n)
        out[name] = statistics.median(per_call)
    r0, t0 = RedisStats.read(conn), time.monotonic()
    for _ in range(3000):
        conn.ping()
    r = RedisStats.read(conn).since(r0)
    idle = idle_us_s(conn) * (time.monotonic() - t0)
    out["PING round trip (main-thread CPU)"] = max(0.0, r.cpu_s * 1e6 - idle) / 3000
    return out


def idle_us_s(conn: redis.Redis, seconds: float = 1.0, _memo: dict = None) -> float:
    """The server's own CPU per second with no client (serverCron), measured once."""
    if _memo is None:
        _memo = {}
    if "v" not in _memo:
        r0 = RedisStats.read(conn)
        time.sleep(seconds)
        _memo["v"] = RedisStats.read(conn).since(r0).cpu_s * 1e6 / seconds
    return _memo["v"]


def life(conn: redis.Redis, cfg: RunConfig, records: PackingRecords, job: int, jobs: int) -> StepCost:
    """`jobs` jobs of `job` samples each through every step, as a fleet makes them: the worker's settle
    keeps a ref into its job's copy for each sample (harvest.state.jobcopy); its stats and latencies,
    and the collector's commit stats, go at their heartbeats (harvest.state.tally), not here. The producer's step is timed on its own samples: the samples the others take are
    enqueued with their RQ job (untimed), which the settle copies. Each step runs for every job
    before the next step: a call finds its code warm and its samples' fields cold, as in a fleet."""
    led, cost = Ledger(conn, cfg.run), StepCost(conn)
    fresh = [[os.urandom(16).hex() for _ in range(job)] for _ in range(jobs)]
    cost.measure(STEPS[0], [lambda f=f: led.add_queued(f) for f in fresh])
    batches = [[Sample.build(np.random.randint(0, 1000, 64)) for _ in range(job)] for _ in range(jobs)]
    job_ids = [enqueue(conn, cfg, b) for b in batches]
    ids = [[s.id for s in b] for b in batches]
    cost.measure(STEPS[1], [lambda i=i: led.take(i) for i in ids])
    refs = [{sid: jobcopy.ref(j, n) for n, sid in enumerate(i)} for i, j in zip(ids, job_ids, strict=False)]
    cost.measure(
        STEPS[2],
        [lambda i=i, r=r: led.settle_job(i, "spool-a", {}, {}, refs=r) for i, r in zip(ids, refs, strict=False)],
    )
    cost.measure(STEPS[3], [lambda i=i: led.states_and_owners(i) for i in ids])
    keys = [f"{led.keys.prefix}:packing:bench-{n}" for n in range(jobs)]
    raws = cost.measure(
        STEPS[4],
        [
            lambda i=i, k=k, n=n: records.put_owned(
                k, PackingRecord(f"shard-{n}", i, "spool-a"), "bench", samples=False
            )
            for n, (i, k) in enumerate(zip(ids, keys, strict=False))
        ],
    )
    recs = [PackingRecord(f"shard-{n}", i, "spool-a", index={"shard": "x" * 2000}).to_json() for n, i in enumerate(ids)]
    cost.measure(
        STEPS[5],
        [
            lambda i=i, k=k, rec=rec, raw=raw: led.fence_commit("spool-a", i, k, rec, raw[0])
            for i, k, rec, raw in zip(ids, keys, recs, raws, strict=False)
        ],
    )
    cost.measure(
        STEPS[6],
        [
            lambda i=i, k=k: led.mark_done(i, clear=records.ended(k), counted=False)
            for i, k in zip(ids, keys, strict=False)
        ],
    )
    return cost


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ledger", type=int, default=100_000, help="samples in the run-wide ledger")
    ap.add_argument("--job", type=int, default=32, help="samples a job (and a shard)")
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--redis-core", type=int, help="pin redis-server to this core, this process to the others")
    args = ap.parse_args()
    if args.job < 1 or args.jobs < 1 or args.ledger < args.job:
        ap.exit(2, "job_cost.py: --job and --jobs must be at least 1, and --ledger at least --job\n")
    cores = os.sched_getaffinity(0)
    if args.redis_core is not None and (args.redis_core not in cores or len(cores) < 2):
        ap.exit(
            2,
            f"job_cost.py: --redis-core {args.redis_core}: give one of this process's cores "
            f"{sorted(cores)}, with another left for it\n",
        )
    random.seed(1)
    install_counter("bench", "other")
    root = tempfile.mkdtemp(prefix="harvest-jobcost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    server = RedisServer(os.path.join(root, "redis")).start()
    if args.redis_core is not None:
        os.sched_setaffinity(server.proc.pid, {args.redis_core})
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.redis_core})
    conn = redis.Redis.from_url(server.url)
    try:
        cfg = publish_run(
            conn,
            RunConfig(
                run="jobcost",
                model="synthetic",
                capture_points=[2, 4, 5, 8],
                hidden_size=4,
                out_url=os.path.join(root, "out"),
                storage_dtype="fp32",
                max_batch_samples=args.job,
                max_batch_tokens=args.job * 64,
                num_layers=8,
            ),
        )
        led, records = Ledger(conn, cfg.run), PackingRecords(conn, cfg.run)
        t0 = time.monotonic()
        ids = fill(led, args.ledger)
        print(
            f"redis-server {conn.info('server')['redis_version']} (AOF everysec); a ledger of {args.ledger} samples "
            f"({time.monotonic() - t0:.0f} s to fill); jobs of {args.job}"
        )
        base = baselines(conn, led, ids, args.job)
        print("baselines (µs of Redis CPU a call):")
        for name, us in base.items():
            print(f"  {name:42s} {us:8.1f}")
        life(conn, cfg, records, args.job, 3)  # scripts loaded
        cost = life(conn, cfg, records, args.job, args.jobs)
        print(
            f"\n{'step (one call a job)':24s} {'step µs':>10} {'its commands':>13} {'the rest':>9}  {'µs a sample':>11}"
        )
        for step in STEPS:
            s, i, n = cost.script[step] / args.jobs, cost.inner[step] / args.jobs, args.job
            print(f"{step:24s} {s:10.1f} {i:13.1f} {s - i:9.1f}  {s / n:11.2f}")
        s, i = sum(cost.script.values()) / args.jobs, sum(cost.inner.values()) / args.jobs
        print(f"{'all steps':24s} {s:10.1f} {i:13.1f} {s - i:9.1f}  {s / args.job:11.2f}")
        cold = base[f"HMGET of {args.job} random fields, cold"] / args.job
        print(
            f"  (a cold field read costs {cold:.2f} µs here; the steps cost {s / args.job / cold:.1f} cold reads a "
            f"sample; a script call's floor is {base['EVALSHA of `return 1`']:.1f} µs)"
        )
        q = rq_cost(
            conn,
            root,
            cfg,
            args.jobs,
            idle_us_s(conn),
            lambda n: [Sample.build(np.random.randint(0, 1000, 64)) for _ in range(n)],
        )
        n = q["job"]
        print(
            f"\none worker's jobs of {n} (in this process): {q['cpu_us']:.0f} µs a job ({q['cpu_us'] / n:.1f} a "
            f"sample), of which harvest's scripts {q['scripts_us']:.0f} ({q['scripts_us'] / n:.1f} a sample) and the "
            f"rest, RQ's commands and every round trip's system calls, {q['rq_us']:.0f} ({q['rq_us'] / n:.1f} a "
            f"sample); {q['commands']:.0f} commands and {q['trips']:.0f} round trips a job"
        )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
