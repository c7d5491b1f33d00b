"""The control plane of a fleet, measured by simulation: what one Redis carries per sample.

    python bench/fleet.py [--nodes 1,4,16] [--per-node 300] [--tokens 1024] [--ledger 10000,100000,1000000] [--by-script]
                          [--job 32] [--shard-samples N] [--redis-core 0] [--redis-share 0.02]
    python bench/fleet.py --quick --nodes 2 --per-node 1000 --idle 3   (one line a fleet: Redis µs per sample)
    python bench/fleet.py --quick-rq 40 --idle 2   (one worker's jobs of 32: Redis µs a job, twice)
    python bench/fleet.py --soak [--soak-nodes 16] [--soak-samples 50000] [--seed 1]

One private redis-server (AOF on, as harvest runs it) and, per fleet size, N simulated nodes of
real `harvest worker` and `harvest collect` processes against the zero-cost engine
(engines/synthetic.py: dump chunks written at once, hidden size 4), so the control plane, not
the bytes, is what costs. Everything lives in /dev/shm. The producer is this process (harvest's
Enqueuer). A job holds 32 samples (1k-token samples; `--job`) and a shard as many samples as a 1 GiB
shard of an 8B model (4 capture points x 4096 x bf16: 32 samples of 1k tokens, 4 of 8k; `--shard-samples`), so
jobs and shards amortize as in a real fleet. Per fleet it prints:

- samples/s end to end (enqueue to done);
- Redis commands per sample: executed (INFO commandstats deltas, commands inside Lua scripts
  included) and sent by clients (counted in each process's redis-py, by role and activity:
  producer, worker job / RQ / heartbeat / janitor, collector commit / loop; tests.support.fleet),
  with the bench's own polling taken out;
- Redis main-thread CPU µs per sample (INFO cpu), and per node and second when idle; how much
  of it the kernel's (client reads and writes, AOF writes, page faults) and the bytes a sample
  sends to and takes from Redis;
- Redis memory per queued and per done sample;
- the worker's and the collector's own CPU ms per sample (/proc/<pid>/stat);
- then the cost of one `harvest status` and one metrics scrape with 10k, 100k, 1M samples in a
  ledger synthesized through the ledger's own scripts;
- and a projection: the fleet size (GPUs) at which one Redis core is saturated, for 1k- and
  8k-token samples at 50k prefill tokens/s per GPU (the 8k figure from a fleet of 8k-token
  samples with harvest's default job token cap, 16384: two samples a job).

Ratios are against the smallest fleet of the same run. `--soak` runs the fleet soak instead:
16 nodes, 50k samples, random SIGKILLs of workers, collectors and whole nodes, every sample
accounted for exactly once (tests.support.chaos's accounting). `--by-script` ends with the
largest fleet run again with every command logged, and its Redis µs per sample by harvest script.
`--redis-core N` pins redis-server to core N and the fleet to the other cores, as a fleet's Redis
has a machine of its own: sharing 2 cores with 35 processes inflates what a command costs it.
`--redis-share F` holds redis-server to F of one core, so the fleet waits on it as on a saturated
Redis, which pays no wake-up a round trip (tests.support.cpushare): the cost the projection is about.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
from harvest.errors import ConfigurationError  # noqa: E402
from harvest.producer.enqueue import Enqueuer  # noqa: E402
from harvest.sample import Sample  # noqa: E402
from harvest.state.heartbeat import read_collectors, read_workers  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from tests.support.cpushare import CpuShare  # noqa: E402
from tests.support.fleet import TRIPS, Fleet, RedisStats, install_counter, rq_cost, sent_counts, tagged  # noqa: E402
from tests.support.ledgercost import ledger_cost, print_ledger  # noqa: E402
from tests.support.ports import reserve_ports  # noqa: E402
from tests.support.scriptcost import ScriptLog  # noqa: E402
from tests.support.wait import wait_for  # noqa: E402

POINTS, HIDDEN = [2, 4, 5, 8], 4  # the simulated run: 4 capture points, hidden size 4, fp32 (= the engine's dtype)
REAL_ROW = 4 * 4096 * 2  # bytes a token costs an 8B model's run: 4 capture points x 4096 x bf16
REAL_SHARD = 1 << 30
VOCAB = 128_000
GPU_TOKENS_S = 50_000  # prefill tokens/s of one GPU on an 8B model


def sample_bytes(tokens: int) -> int:
    """A simulated sample's spool file: header block, hidden states, int32 ids, uint8 mask."""
    return 4096 + tokens * (len(POINTS) * HIDDEN * 4 + 5) + 64


def make_samples(n: int, tokens: int, rng: np.random.Generator) -> list[Sample]:
    return [Sample.build(rng.integers(0, VOCAB, tokens)) for _ in range(n)]


def commands(sent: Counter) -> int:
    return sum(v for (_, c), v in sent.items() if c != TRIPS)


def trips(sent: Counter) -> int:
    return sum(v for (_, c), v in sent.items() if c == TRIPS)


def executed(r: RedisStats, bench: Counter) -> dict[str, int]:
    """Commands the server executed less those this process sent for its polling (`bench.*`)."""
    out = dict(r.calls)
    for (act, cmd), n in bench.items():
        if act.startswith("bench") and cmd != TRIPS:
            k = cmd.lower()
            out[k] = out.get(k, 0) - n
    return {k: v for k, v in out.items() if v > 0}


def new_run(
    conn: redis.Redis, root: str, run: str, tokens: int, job: int, job_tokens: int, shard_samples: int | None = None
) -> RunConfig:
    per_shard = shard_samples or max(1, REAL_SHARD // (tokens * REAL_ROW))
    cfg = RunConfig(
        run=run,
        model="synthetic",
        capture_points=POINTS,
        hidden_size=HIDDEN,
        out_url=os.path.join(root, "out"),
        storage_dtype="fp32",
        max_batch_samples=job,
        max_batch_tokens=job_tokens,
        shard_bytes=per_shard * sample_bytes(tokens),
        num_layers=8,
    )
    return publish_run(conn, cfg)


def wait_ready(conn: redis.Redis, fleet: Fleet, timeout: float = 900) -> None:
    def ready() -> bool:
        for name, p in fleet.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}); see {fleet.root}/logs/{name}.log")
        with tagged("bench.poll"):
            return (
                len(read_workers(conn, fleet.run)[0]) == fleet.nodes * fleet.workers
                and len(read_collectors(conn, fleet.run)[0]) == fleet.nodes
            )

    wait_for(ready, timeout, f"{fleet.nodes} nodes of {fleet.run} up", poll=0.5)


def measure_fleet(
    conn: redis.Redis,
    url: str,
    root: str,
    nodes: int,
    samples: int,
    tokens: int,
    job: int,
    job_tokens: int,
    idle_s: float,
    base_us_s: float,
    rng: np.random.Generator,
    shard_samples: int | None = None,
) -> dict:
    run = f"fleet{nodes}t{tokens}"
    cfg = new_run(conn, root, run, tokens, job, job_tokens, shard_samples)
    todo = make_samples(samples, tokens, rng)
    ports = reserve_ports(nodes)  # below the ephemeral range, held from other benches and tests
    fleet = Fleet(os.path.join(root, run), url, run, nodes, base_port=ports.first)
    try:
        fleet.start_all()
        wait_ready(conn, fleet)
        time.sleep(1.0)
        s0, b0, r0, c0, t0 = fleet.sent(), sent_counts(), RedisStats.read(conn), fleet.cpu(), time.monotonic()
        with tagged("producer"):
            enq = Enqueuer(conn, cfg, max_queued=samples)
            for s in todo:
                enq.add(s)
            enq.flush()
        led = Ledger(conn, run)

        def done() -> bool:
            with tagged("bench.poll"):
                c = led.counts()
            return c["done"] + c["failed"] >= samples

        wait_for(done, 600, f"{samples} samples of {run} done", poll=0.2)
        t1 = time.monotonic()
        b1, r1, c1, s1 = sent_counts(), RedisStats.read(conn), fleet.cpu(), fleet.sent()
        time.sleep(idle_s)
        b2, r2, s2 = sent_counts(), RedisStats.read(conn), fleet.sent()
        with tagged("bench.poll"):
            stats, failed = led.stats(), led.counts()["failed"]
    finally:
        fleet.stop()
        ports.close()
    run_r, idle_r = r1.since(r0), r2.since(r1)
    sent = (s1 - s0) + Counter({k: v for k, v in (b1 - b0).items() if not k[0].startswith("bench")})
    idle_sent = (s2 - s1) + Counter({k: v for k, v in (b2 - b1).items() if not k[0].startswith("bench")})
    ex, idle_ex = executed(run_r, b1 - b0), executed(idle_r, b2 - b1)
    idle_cpu_us_s = max(0.0, idle_r.cpu_s * 1e6 / idle_s - base_us_s)  # the fleet's, beyond an idle server's own
    return {
        "nodes": nodes,
        "samples": samples,
        "tokens": tokens,
        "job": job,
        "failed": failed,
        "seconds": t1 - t0,
        "jobs": enq.stats.jobs,
        "shards": stats.get("shards", 0),
        "executed": ex,
        "sent": sent,
        "idle_executed": sum(idle_ex.values()) / idle_s,
        "idle_sent": commands(idle_sent) / idle_s,
        "idle_trips": trips(idle_sent) / idle_s,
        "idle_cpu_us_s": idle_cpu_us_s,
        # what the run cost beyond the fleet's idle background over the same seconds
        "cpu_us": run_r.cpu_s * 1e6,
        "busy_cpu_us": run_r.cpu_s * 1e6 - (idle_cpu_us_s + base_us_s) * (t1 - t0),
        "usec": run_r.usec,
        "mem_done": RedisStats.read(conn).memory - r0.memory,
        "sys_us": run_r.sys_s * 1e6,
        "net_in": run_r.net_in,
        "net_out": run_r.net_out,
        "cpu": {k: c1[k] - c0.get(k, 0) for k in c1},
    }


def ping_cost(conn: redis.Redis, base_us_s: float, n: int = 3000) -> float:
    """Redis main-thread CPU of one PING round trip, less an idle server's own: what a round trip
    costs the server on this machine (its system calls), the unit a fleet's cost is compared to."""
    r0 = RedisStats.read(conn)
    t0 = time.monotonic()
    with tagged("bench.ping"):
        for _ in range(n):
            conn.ping()
    r = RedisStats.read(conn).since(r0)
    return max(0.0, r.cpu_s * 1e6 - base_us_s * (time.monotonic() - t0)) / n


def memory_per_queued(conn: redis.Redis, root: str, tokens: int, job: int, n: int, rng) -> float:
    cfg = new_run(conn, root, "memq", tokens, job, job * tokens)
    todo = make_samples(n, tokens, rng)
    m0 = conn.info("memory")["used_memory"]
    with tagged("bench.memq"):
        enq = Enqueuer(conn, cfg, max_queued=n)
        for s in todo:
            enq.add(s)
        enq.flush()
    return (conn.info("memory")["used_memory"] - m0) / n


ROLES = ("producer", "worker.job", "worker.rq", "worker.beat", "worker.janitor", "collector.commit", "collector.loop")


def print_fleets(res: list[dict], mem_q: float, ping_us: float) -> None:
    base = res[0]
    print(
        f"\n{'fleet':>18} {'samples':>8} {'s/s':>7} {'x':>5} {'exec/s':>7} {'sent/s':>7} {'trips/s':>7} {'cpu µs/s':>9} "
        f"{'busy µs/s':>9} {'PINGs/s':>7} {'KB/done':>8} {'worker ms/s':>11} {'coll ms/s':>9}   idle/node: trips/s  µs/s"
    )
    for r in res:
        n = r["samples"]
        sps = n / r["seconds"]
        print(
            f"{r['nodes']:>4} nodes {r['tokens']:>5} tok {n:>8} {sps:>7.0f} {sps / (base['samples'] / base['seconds']):>5.2f} "
            f"{sum(r['executed'].values()) / n:>7.2f} {commands(r['sent']) / n:>7.2f} {trips(r['sent']) / n:>7.2f} "
            f"{r['cpu_us'] / n:>9.1f} {r['busy_cpu_us'] / n:>9.1f} {r['busy_cpu_us'] / n / max(ping_us, 1e-9):>7.1f} "
            f"{r['mem_done'] / n / 1e3:>8.2f} "
            f"{r['cpu'].get('worker', 0) * 1e3 / n:>11.2f} {r['cpu'].get('collector', 0) * 1e3 / n:>9.2f}   "
            f"{r['idle_trips'] / r['nodes']:>14.1f} {r['idle_cpu_us_s'] / r['nodes']:>5.0f}"
        )
    print(
        f"  (s/s: samples/s end to end; x: against {base['nodes']} node(s); exec/s, sent/s: Redis commands per sample "
        f"executed (Lua's inner ones included) and sent by clients; trips/s: round trips (a pipeline is one); cpu: Redis "
        f"main-thread µs per sample, busy: less the idle fleet's; PINGs/s: busy in PING round trips measured in "
        f"this run; KB/done: Redis memory left per done sample; worker/coll ms/s: their own CPU per sample)"
    )
    print(
        f"  Redis memory per queued sample ({base['tokens']}-token samples, jobs of {base['job']}): "
        f"{mem_q / 1e3:.1f} KB"
    )
    for r in res:
        n, jobs, shards = r["samples"], r["jobs"], max(1, r["shards"])
        by_role, by_trips, by_cmd = Counter(), Counter(), {}
        for (act, cmd), v in r["sent"].items():
            if cmd == TRIPS:
                by_trips[act] += v
                continue
            by_role[act] += v
            by_cmd.setdefault(act, Counter())[cmd] += v
        print(
            f"\n  {r['nodes']} nodes, {r['tokens']}-token samples: {n} samples, {jobs} jobs ({n / max(1, jobs):.1f} "
            f"samples/job), {shards} shards ({n / shards:.1f} samples/shard), {r['failed']} failed; commands sent per "
            f"sample by activity [per job] (round trips per sample) top commands:"
        )
        for act in sorted(by_role, key=lambda a: (a not in ROLES, ROLES.index(a) if a in ROLES else 0, a)):
            top = ", ".join(f"{c} {v / n:.2f}" for c, v in by_cmd[act].most_common(6))
            print(
                f"    {act:<18} {by_role[act] / n:6.2f}  [{by_role[act] / max(1, jobs):6.1f}]  ({by_trips[act] / n:5.2f})  "
                f"{top}"
            )
        top = sorted(r["executed"].items(), key=lambda kv: -kv[1])[:10]
        print("    executed per sample: " + ", ".join(f"{k} {v / n:.2f}" for k, v in top))
        cpu = sorted(r["usec"].items(), key=lambda kv: -kv[1])[:6]
        print(
            "    Redis µs per sample by command (commandstats; a script's include its inner calls): "
            + ", ".join(f"{k} {v / n:.1f}" for k, v in cpu if v > 0)
        )
        print(
            f"    of the Redis CPU, in the kernel (client reads and writes, AOF writes, page faults): "
            f"{r['sys_us'] / n:.1f} µs per sample of {r['cpu_us'] / n:.1f}; bytes per sample from clients "
            f"{r['net_in'] / n / 1e3:.2f} KB, to them {r['net_out'] / n / 1e3:.2f} KB"
        )


def project(short: dict, long: dict) -> None:
    """GPUs one Redis core carries: 1e6 µs/s over (samples/s per GPU x µs per sample + idle µs/s per GPU)."""
    print("\nprojection: one Redis core (1e6 µs/s of main-thread CPU) saturates at")
    for r in (short, long):
        per_gpu = GPU_TOKENS_S / r["tokens"]
        c_s = r["busy_cpu_us"] / r["samples"]
        c_idle = r["idle_cpu_us_s"] / r["nodes"]  # a simulated node: one worker and one collector
        gpus = 1e6 / (per_gpu * c_s + c_idle)
        cmds = commands(r["sent"]) / r["samples"] * per_gpu * gpus
        print(
            f"  {r['tokens']:>5}-token samples ({per_gpu:.1f} samples/s per GPU, {c_s:.1f} µs per sample, "
            f"{c_idle:.0f} µs/s idle per GPU): {gpus:,.0f} GPUs ({per_gpu * gpus:,.0f} samples/s, {cmds:,.0f} commands/s "
            f"sent)"
        )


def _checked(ap: argparse.ArgumentParser, args: argparse.Namespace) -> CpuShare | None:
    """The options checked before anything starts (a bad one: one line, exit 2); the Redis CPU share."""
    try:  # a bad share or no cgroup to write
        share = CpuShare(args.redis_share) if args.redis_share is not None else None
    except ConfigurationError as e:
        ap.exit(2, f"fleet.py: {e}\n")
    if args.shard_samples is not None and args.shard_samples < 1:
        ap.exit(2, f"fleet.py: --shard-samples {args.shard_samples}: give at least 1\n")
    cores = os.sched_getaffinity(0)
    if args.redis_core is not None and (args.redis_core not in cores or len(cores) < 2):
        ap.exit(
            2,
            f"fleet.py: --redis-core {args.redis_core}: give one of this process's cores {sorted(cores)}, "
            "with another left for the fleet\n",
        )
    return share


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,4,16")
    ap.add_argument("--per-node", type=int, default=300, help="samples per node (at least 600 a fleet)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument(
        "--job",
        type=int,
        default=32,
        help="samples a job in the fleets of --tokens samples (and the in-process worker's queued-memory measure)",
    )
    ap.add_argument(
        "--shard-samples",
        type=int,
        help="samples a shard holds at most in the fleets of --tokens samples "
        "(default: as many as a 1 GiB shard of an 8B model: 32 of 1k tokens), to measure what a shard's "
        "calls cost",
    )
    ap.add_argument("--long-tokens", type=int, default=8192)
    ap.add_argument("--long-per-node", type=int, default=40)
    ap.add_argument("--ledger", default="10000,100000,1000000")
    ap.add_argument(
        "--idle",
        type=float,
        default=20.0,
        help="seconds of idle fleet measured after each run (two of the "
        "fleet's longest periods, 10 s: a shorter window catches some periodic calls and misses others)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--by-script",
        action="store_true",
        help="then the largest fleet again with its Redis µs by harvest script (SLOWLOG; tests.support.scriptcost)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="only the --nodes fleets, one line each: Redis main-thread CPU "
        "µs per sample (an ablation's figure; give a short --idle)",
    )
    ap.add_argument(
        "--quick-rq",
        type=int,
        metavar="JOBS",
        help="only one worker's JOBS jobs of --job 64-token "
        "samples, twice: Redis CPU µs a job, commands and round trips (an ablation's figure)",
    )
    ap.add_argument("--soak", action="store_true", help="the fleet soak instead (see the module docstring)")
    ap.add_argument("--soak-nodes", type=int, default=16)
    ap.add_argument("--soak-samples", type=int, default=50_000)
    ap.add_argument("--soak-kills", type=int, default=12)
    ap.add_argument("--redis-core", type=int, help="pin redis-server to this core, the fleet to the others")
    ap.add_argument(
        "--redis-share",
        type=float,
        help="hold redis-server to this share of one core (a CPU cgroup: root), "
        "so the fleet waits on it as on a saturated Redis (tests.support.cpushare)",
    )
    args = ap.parse_args()
    share = _checked(ap, args)
    sys.stdout.reconfigure(line_buffering=True)  # each table shows as it is printed, also into a log
    install_counter("bench", "other")
    rng = np.random.default_rng(args.seed)
    root = tempfile.mkdtemp(prefix="harvest-fleet-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    server = RedisServer(os.path.join(root, "redis")).start()
    if share is not None:
        share.attach(server.proc.pid)
    if args.redis_core is not None:  # the fleet's processes inherit this process's cores
        os.sched_setaffinity(server.proc.pid, {args.redis_core})
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {args.redis_core})
    conn = redis.Redis.from_url(server.url)
    t0 = time.monotonic()
    try:
        if args.soak:
            from tests.support.fleet_soak import soak

            return soak(conn, server, root, args.soak_nodes, args.soak_samples, args.soak_kills, args.seed)
        print(
            f"redis-server {conn.info('server')['redis_version']} (AOF everysec), {os.cpu_count()} cores"
            f"{'' if args.redis_core is None else f' (Redis alone on core {args.redis_core})'}"
            f"{'' if share is None else f', Redis held to {share.share:.1%} of a core'}; "
            f"simulated samples: {len(POINTS)} x {HIDDEN} fp32 per token",
            flush=True,
        )
        r0 = RedisStats.read(conn)
        time.sleep(args.idle)
        base_us_s = RedisStats.read(conn).since(r0).cpu_s * 1e6 / args.idle  # serverCron and the rest, no client
        print(
            f"  an idle redis-server's own CPU: {base_us_s:.0f} µs/s (taken out of the fleets' idle figures)",
            flush=True,
        )
        ping_us = ping_cost(conn, base_us_s)
        print(
            f"  the baseline, one PING round trip from one client: {ping_us:.1f} µs of Redis CPU (this machine's cost "
            f"of a round trip; the fleets' µs per sample are also given in PINGs)",
            flush=True,
        )
        if args.quick_rq:
            for rep in range(2):
                q = rq_cost(
                    conn,
                    root,
                    new_run(conn, root, f"rq{rep}", 64, args.job, args.job * 64),
                    args.quick_rq,
                    base_us_s,
                    lambda n: make_samples(n, 64, rng),
                )
                print(
                    f"quick-rq: jobs of {args.job}: {q['cpu_us']:.0f} µs a job ({q['cpu_us'] / args.job:.1f} a sample), "
                    f"{q['commands']:.0f} commands, {q['trips']:.0f} round trips",
                    flush=True,
                )
            return 0
        if args.quick:
            for n in [int(x) for x in args.nodes.split(",")]:
                r = measure_fleet(
                    conn,
                    server.url,
                    root,
                    n,
                    max(600, n * args.per_node),
                    args.tokens,
                    args.job,
                    args.job * args.tokens,
                    args.idle,
                    base_us_s,
                    rng,
                    args.shard_samples,
                )
                print(
                    f"quick: {n} nodes {r['samples']} samples {r['seconds']:.1f}s redis_us_per_sample "
                    f"{r['cpu_us'] / r['samples']:.2f} busy {r['busy_cpu_us'] / r['samples']:.2f}",
                    flush=True,
                )
                conn.flushall()
            return 0
        mem_q = memory_per_queued(conn, root, args.tokens, args.job, 3000, rng)
        conn.flushall()
        res = []
        for n in [int(x) for x in args.nodes.split(",")]:
            samples = max(600, n * args.per_node)
            res.append(
                measure_fleet(
                    conn,
                    server.url,
                    root,
                    n,
                    samples,
                    args.tokens,
                    args.job,
                    args.job * args.tokens,
                    args.idle,
                    base_us_s,
                    rng,
                    args.shard_samples,
                )
            )
            print(
                f"  fleet of {n}: {samples} samples in {res[-1]['seconds']:.1f}s, Redis "
                f"{res[-1]['cpu_us'] / res[-1]['seconds'] / 1e4:.1f}% busy",
                flush=True,
            )
            conn.flushall()
        big = max(int(x) for x in args.nodes.split(","))
        long = measure_fleet(
            conn,
            server.url,
            root,
            big,
            big * args.long_per_node,
            args.long_tokens,
            32,
            RunConfig.__dataclass_fields__["max_batch_tokens"].default,
            args.idle,
            base_us_s,
            rng,
        )
        print(
            f"  fleet of {big}, {args.long_tokens}-token samples: {long['samples']} in {long['seconds']:.1f}s",
            flush=True,
        )
        conn.flushall()
        print_fleets(res + [long], mem_q, ping_us)  # each stage's table as soon as it is measured
        project(res[-1], long)
        print("\none worker's jobs (64-token samples; in this process): Redis CPU per job and per sample", flush=True)
        for j in (8, 32, 128):
            q = rq_cost(
                conn,
                root,
                new_run(conn, root, f"rq{j}", 64, j, j * 64),
                100,
                base_us_s,
                lambda n: make_samples(n, 64, rng),
            )
            split = (
                ""
                if share
                # a held server's command times are wall times, its waits for the CPU in them
                else (
                    f", of which harvest's scripts {q['scripts_us']:6.0f} ({q['scripts_us'] / q['job']:4.1f} a sample) and "
                    f"the rest, RQ's, {q['rq_us']:6.0f} ({q['rq_us'] / q['job']:4.1f} a sample)"
                )
            )
            print(
                f"  jobs of {q['job']:>3}: {q['cpu_us']:7.0f} µs a job ({q['cpu_us'] / q['job']:5.1f} a sample){split}; "
                f"{q['commands']:.0f} commands executed and {q['trips']:.0f} round trips a job",
                flush=True,
            )
        conn.flushall()
        print_ledger(ledger_cost(conn, [int(x) for x in args.ledger.split(",")], POINTS, HIDDEN))
        if args.by_script:
            conn.flushall()
            with ScriptLog(conn) as log:
                r = measure_fleet(
                    conn,
                    server.url,
                    root,
                    big,
                    big * args.per_node,
                    args.tokens,
                    args.job,
                    args.job * args.tokens,
                    args.idle,
                    base_us_s,
                    rng,
                    args.shard_samples,
                )
                usec, calls, entries = log.read()
            print(
                f"\n{big} nodes again, every command logged ({entries} entries; the log slows the server): Redis µs "
                f"per sample by script [calls per sample, µs a call]"
            )
            for name, v in usec.most_common(12):
                print(
                    f"  {name:<38} {v / r['samples']:6.1f}  [{calls[name] / r['samples']:.3f}, {v / calls[name]:6.1f}]"
                )
        print(f"\n{time.monotonic() - t0:.0f}s in all")
    finally:
        server.stop()
        if share is not None:
            share.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
