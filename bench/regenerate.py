"""Does the regeneration stage keep the engine generating? Harvest against a direct client, same engine, same run.

One reference engine (`harvest engine`, a random Llama big enough that a decode step, not HTTP,
dominates) serves both paths, greedy (temperature 0), so both generate the very same tokens:

(a) direct: `--threads` threads (default: a job's size, the conversations one job of harvest has
    in flight) take the chats one at a time and write each one's turns in order with
    `SGLangClient.complete`, from the prompts harvest's producer builds (`RowTokenizer(...,
    regenerate=True)`, `harvest.state.conversation.Conversation.splice`); nothing else runs. A conversation
    that would fail in harvest (a turn that ends at once) is dropped from the count there too.
(b) harvest: `harvest run --regenerate --max-new-tokens N --on-length keep --engine-url` on the
    same chats against the same engine, with a Redis this bench starts, so the run's stats
    (`tokens_generated`, `generation_ms`: the sum of the jobs' generation steps) are read after
    it exits; the workers' job lines give each job's generation interval (their union is the
    stage's wall time when workers overlap) and its whole duration (generation + extraction).

Run as (a), (b), (a) per `--repeat` (the baseline is the mean of the two around (b)). Prints
generated tokens/s of both and three ratios:
- generation stage (the goal, >= 0.9): tokens over the wall time during which some job was
  generating (the union of the jobs' generation steps). It compares what the same engine turns
  out while harvest generates with what a plain client gets; start-up and extraction are other
  stages with benches of their own (bench/pipeline.py).
- over `generation_ms` as the stat reads: the jobs' steps summed, so with one worker the same
  figure, and with W workers generating at once a per-worker rate (up to W times too low).
- end to end: tokens over the whole `harvest run` (start-up, producer, extraction, commit):
  what a user waits, not a throughput of the generation stage.
Also the engine's busy share (its forward-lock seconds, /get_server_info, polled at 5 Hz in
every phase) in the direct phases and within harvest's generation stage: their ratio is the same
comparison, insensitive to the engine's step cost drifting between phases on a shared machine
(harvest's also counts the extraction prefills that run while another job generates).
Per job: when it started, how long it generated and extracted, and how full its slots stayed
(its conversations' tokens over job size x its longest conversation: the share of a batching
engine's slots a job keeps busy while it waits for its slowest conversation; the reference engine
runs one request per forward, so there the job boundary costs only the round trips of the last
conversations, but on SGLang or vLLM a step costs about the same at any batch size).

The engine is pinned to its own cores and everything else to the others (`--no-pin` shares them),
as on a GPU node where the forward does not run on the host CPU.

    python bench/regenerate.py --quick        # ~1 min a repeat: 48 chats, jobs of 16, 8 new tokens a turn
    python bench/regenerate.py --chats 96 --max-new-tokens 32 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import redis  # noqa: E402

from harvest.cli.demo import build_tiny_model  # noqa: E402
from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.health import wait_healthy  # noqa: E402
from harvest.producer.rows import Row  # noqa: E402
from harvest.producer.tokenize import RowTokenizer  # noqa: E402
from harvest.sample import Sample, split_jobs  # noqa: E402
from harvest.state.conversation import turn_seed  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.workers.clients.base import GenParams, Rejected  # noqa: E402
from harvest.workers.clients.sglang import SGLangClient  # noqa: E402
from tests.support.benchengine import start_pinned_engine  # noqa: E402

WORDS = (
    "the model reads a long prompt and writes hidden states for every token so that a small draft network "
    "can learn to guess what the large target network will say next river mountain forest city code"
).split()


def make_chats(n: int, seed: int) -> list[list[dict]]:
    """Chats of 1 to 3 assistant turns (half with a system prompt); the answers they bring are rewritten."""
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    chats = []
    for _ in range(n):
        msgs = [{"role": "system", "content": say(6)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": say(rng.randint(3, 20))}, {"role": "assistant", "content": say(5)}]
        chats.append(msgs)
    return chats


def conversations(model: str, chats: list[list[dict]]) -> list[Sample]:
    """The samples harvest's producer makes of the chats: skeletons and their cuts."""
    from transformers import AutoTokenizer

    tok = RowTokenizer(AutoTokenizer.from_pretrained(model), regenerate=True)
    out = tok([Row({"messages": m}, f"chats.jsonl:{i + 1}") for i, m in enumerate(chats)])
    bad = [s for s in out if not isinstance(s, Sample)]
    if bad:
        raise SystemExit(f"the producer refused a chat: {bad[0]}")
    return out


def direct(url: str, samples: list[Sample], threads: int, max_new: int, tag: str) -> tuple[int, float, dict[str, int]]:
    """(tokens, seconds, tokens per conversation): every conversation's turns written, `threads` at a
    time, as harvest.workers.regenerate.write_turns writes them (a turn that ends at once drops its conversation)."""
    client = SGLangClient(url)

    def write(i_s: tuple[int, Sample]) -> tuple[str, int]:
        i, s = i_s
        pieces, generated = s.conv.pieces(s.input_ids), []
        for k in range(s.conv.turns):
            prompt, _ = s.conv.splice(pieces, generated)
            r = client.complete(
                f"hg-bench-{tag}-{i}-{k}",
                prompt.tolist(),
                GenParams(max_new, 0.0, 1.0, turn_seed(s.id, k), s.conv.stop),
            )
            if isinstance(r, Rejected):
                raise SystemExit(f"engine rejected a direct request: {r.message}")
            if not (r.tokens[:-1] if r.finish_reason == "stop" else r.tokens):
                return s.id, 0
            generated.append(r.tokens)
        return s.id, sum(len(g) for g in generated)

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(threads)
    try:
        per = dict(pool.map(write, enumerate(samples)))
    finally:
        pool.shutdown(cancel_futures=True)  # stopped (SIGTERM): the conversations not started are not
    dt = time.perf_counter() - t0
    client.close()
    return sum(per.values()), dt, per


JOB_GEN = re.compile(
    r"^(\S+ \S+) harvest\.worker INFO job (\S+): (\d+) conversations written, (\d+) tokens in ([\d.]+)s"
)
JOB_END = re.compile(r"^(\S+ \S+) harvest\.worker INFO job (\S+): (\d+) samples, \d+ tokens, ([\d.]+)s: spooled")


def job_lines(logs: str) -> dict[str, dict]:
    """Per job, from the workers' logs: its generation step's [start, end] and the whole job's [start, end]
    (epoch seconds; the lines are stamped when each step ends)."""
    jobs: dict[str, dict] = {}
    for name in sorted(os.listdir(logs)):
        if not name.startswith("worker-"):
            continue
        with open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                if m := JOB_GEN.match(line):
                    end = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    jobs.setdefault(m[2], {"worker": name})["gen"] = (end - float(m[5]), end)
                    jobs[m[2]]["convs"], jobs[m[2]]["tokens"] = int(m[3]), int(m[4])
                elif m := JOB_END.match(line):
                    end = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    jobs.setdefault(m[2], {"worker": name})["job"] = (end - float(m[4]), end)
    return jobs


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged(intervals))


def harvest_run(args, url: str, dump_dir: str, model: str, data: str, base: str, redis_url: str, run: str) -> dict:
    work = os.path.join(base, f"work-{run}")
    cmd = [
        sys.executable,
        "-m",
        "harvest.cli",
        "run",
        data,
        "--model",
        model,
        "--out",
        f"file://{base}/out",
        "--run",
        run,
        "--engine-url",
        url,
        "--dump-dir",
        dump_dir,
        "--workers",
        str(args.workers),
        "--redis",
        redis_url,
        "--work-dir",
        work,
        "--no-progress",
        "--batch-samples",
        str(args.batch_samples),
        "--regenerate",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--on-length",
        "keep",
    ]
    start, t0 = time.time(), time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 1):  # 1: some conversations failed (counted out on both sides)
        raise SystemExit(f"harvest run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    stats = Ledger(redis.Redis.from_url(redis_url), run).stats()
    jobs = job_lines(os.path.join(work, "logs"))
    gen = [j["gen"] for j in jobs.values() if "gen" in j]
    return {
        "start": start,
        "wall": wall,
        "tokens": stats.get("tokens_generated", 0),
        "gen_ms": stats.get("generation_ms", 0),
        "convs": stats.get("conversations_written", 0),
        "gen_union": union(gen),
        "jobs": jobs,
        "cmd": " ".join(cmd[1:]),
    }


class EngineWatch(threading.Thread):
    """Polls the engine's busy seconds (its forward lock) at 5 Hz over one kept-alive connection while a
    phase runs (every phase, so each pays the same polling): busy share overall and within windows."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, timeout=10)
        self.stop = threading.Event()
        self.points = [self.sample()]

    def sample(self) -> tuple[float, float]:
        return time.time(), self.http.get("/get_server_info").json()["busy_seconds"]

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.points.append(self.sample())

    def finish(self) -> EngineWatch:
        self.stop.set()
        self.join()
        self.points.append(self.sample())
        self.http.close()
        return self

    @property
    def busy(self) -> float:
        return self.points[-1][1] - self.points[0][1]

    def busy_within(self, intervals: list[tuple[float, float]]) -> float:
        """Busy seconds inside the intervals (each poll period's busy time spread evenly over it)."""
        total = 0.0
        for (t0, b0), (t1, b1) in zip(self.points, self.points[1:], strict=False):
            if t1 > t0:
                inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in merged(intervals))
                total += (b1 - b0) * inside / (t1 - t0)
        return total


def occupancy(samples: list[Sample], per: dict[str, int], job_size: int) -> list[float]:
    """Per job (as the producer cuts them): its conversations' tokens over job size x its longest one."""
    out = []
    for job in split_jobs(samples, job_size, 1 << 62):
        counts = [per.get(s.id, 0) for s in job]
        if max(counts):
            out.append(sum(counts) / (job_size * max(counts)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="every turn's cap (a random model rarely stops)")
    ap.add_argument("--batch-samples", type=int, default=32, help="harvest's job size (the run's default: 32)")
    ap.add_argument("--workers", type=int, default=2, help="harvest run --workers")
    ap.add_argument("--threads", type=int, default=0, help="the direct client's concurrency (0: min(64, job size))")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="(a), (b), (a) this many times; medians")
    ap.add_argument("--quick", action="store_true", help="48 chats, jobs of 16, 8 new tokens a turn (~1 min a repeat)")
    ap.add_argument(
        "--engine-cores",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="cores the engine is pinned to (its torch threads); the rest get everything else",
    )
    ap.add_argument("--no-pin", action="store_true", help="share all cores; the engine gets --engine-cores threads")
    args = ap.parse_args()
    if args.quick:
        args.chats, args.batch_samples, args.max_new_tokens = 48, 16, 8
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops the engine, Redis and a harvest run
    threads = args.threads or min(64, args.batch_samples)

    base = tempfile.mkdtemp(prefix="harvest-bench-regen-")
    model = build_tiny_model(
        os.path.join(os.path.expanduser("~/.cache/harvest"), f"bench-model-{args.layers}x{args.hidden}"),
        layers=args.layers,
        hidden=args.hidden,
    )
    chats = make_chats(args.chats, seed=7)
    data = os.path.join(base, "chats.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in chats)
    samples = conversations(model, chats)
    turns = sum(s.conv.turns for s in samples)
    print(
        f"model: Llama {args.layers} layers, hidden {args.hidden} (random); {len(samples)} chats, {turns} turns, "
        f"<= {args.max_new_tokens} new tokens a turn; harvest: {args.workers} workers, jobs of {args.batch_samples}; "
        f"direct: {threads} threads",
        flush=True,
    )

    bench_engine = start_pinned_engine(model, base, "regen", args.engine_cores, pin=not args.no_pin)
    engine, url, dump_dir = bench_engine.proc, bench_engine.url, bench_engine.dump_dir
    if not args.no_pin:
        print(f"engine pinned to cores {bench_engine.cores}, the rest to {bench_engine.rest}", flush=True)
    server = RedisServer(os.path.join(base, "redis"), appendonly=False).start()
    try:

        def running() -> None:
            if engine.poll() is not None:
                raise SystemExit("engine exited")

        if not wait_healthy(url, 120, check=running, interval=0.1, probe_timeout=2):
            raise SystemExit("engine did not start")
        direct(url, samples[:4], 4, 4, "warm")  # the engine's first forwards (allocator, lazy init)
        reps = []

        def measured(fn):
            watch = EngineWatch(url)
            watch.start()
            out = fn()
            return out, watch.finish()

        for rep in range(args.repeat):
            a1, w1 = measured(lambda r=rep: direct(url, samples, threads, args.max_new_tokens, f"{r}a"))
            h, wh = measured(lambda r=rep: harvest_run(args, url, dump_dir, model, data, base, server.url, f"regen{r}"))
            a2, w2 = measured(lambda r=rep: direct(url, samples, threads, args.max_new_tokens, f"{r}b"))
            tokens, per = a1[0], a1[2]
            if a2[0] != tokens or h["tokens"] != tokens:
                print(f"note: tokens differ: direct {tokens} and {a2[0]}, harvest {h['tokens']}", flush=True)
            d_tps = statistics.mean([a1[0] / a1[1], a2[0] / a2[1]])
            d_busy = statistics.mean([w1.busy / a1[1], w2.busy / a2[1]])
            gen = [j["gen"] for j in h["jobs"].values() if "gen" in j]
            gen_wall = h["gen_union"] or h["gen_ms"] / 1000
            h_busy = wh.busy_within(gen) / gen_wall if gen else float("nan")
            g_tps, s_tps, e2e_tps = (
                h["tokens"] / gen_wall,
                h["tokens"] * 1000 / max(h["gen_ms"], 1),
                h["tokens"] / h["wall"],
            )
            reps.append((d_tps, g_tps, s_tps, e2e_tps, d_busy, h_busy))
            print(f"\nrun {rep + 1}: {h['cmd']}", flush=True)
            print(
                f"  direct  {a1[0] / a1[1]:6.1f} and {a2[0] / a2[1]:6.1f} tokens/s ({tokens} tokens in {a1[1]:.1f} s and "
                f"{a2[1]:.1f} s; engine busy {w1.busy / a1[1]:.0%} and {w2.busy / a2[1]:.0%}, "
                f"{1000 * w1.busy / max(tokens, 1):.1f} and {1000 * w2.busy / max(tokens, 1):.1f} ms of forward a token)",
                flush=True,
            )
            print(
                f"  harvest {h['tokens']} tokens, {h['convs']} conversations; generation stage {gen_wall:.1f} s (union of the "
                f"jobs' steps; generation_ms sums {h['gen_ms'] / 1000:.1f} s), whole run {h['wall']:.1f} s; engine busy "
                f"{h_busy:.0%} during the generation stage, {wh.busy / h['wall']:.0%} of the run",
                flush=True,
            )
            t0 = h["start"]
            for name, j in sorted(h["jobs"].items(), key=lambda kv: kv[1].get("job", kv[1].get("gen", (0, 0)))[0]):
                g, w = j.get("gen", (t0, t0)), j.get("job", (t0, t0))
                print(
                    f"    job ..{name[-6:]} {j['worker'][:-4]}: {j.get('convs', 0):3d} convs, {j.get('tokens', 0):5d} tokens; "
                    f"starts {w[0] - t0:5.1f} s, generates {g[1] - g[0]:5.1f} s, extracts {w[1] - g[1]:4.1f} s, "
                    f"ends {w[1] - t0:5.1f} s",
                    flush=True,
                )
            first = min((a for a, _ in gen), default=t0)
            last = max((b for _, b in gen), default=t0)
            print(
                f"    run start to first generation {first - t0:.1f} s; last generation to run exit {t0 + h['wall'] - last:.1f} s",
                flush=True,
            )
            occ = occupancy(samples, per, args.batch_samples)
            print(
                "  job slot occupancy (tokens / (job size x longest conversation)): "
                + ", ".join(f"{o:.2f}" for o in occ),
                flush=True,
            )
        d, g, s, e, db, hb = (statistics.median(r[k] for r in reps) for k in range(6))
        print(f"\nmedians of {len(reps)} run(s), generated tokens/s")
        print(f"  direct client ({threads} threads)                   {d:7.1f}")
        print(f"  harvest, generation stage (union of job steps)   {g:7.1f}   ratio {g / d:.3f}   <- the goal (>= 0.9)")
        print(f"  harvest, over generation_ms (summed over jobs)   {s:7.1f}   ratio {s / d:.3f}")
        print(f"  harvest, end to end (whole harvest run)          {e:7.1f}   ratio {e / d:.3f}")
        print(
            f"  engine busy: direct {db:.0%}, harvest's generation stage {hb:.0%} (ratio {hb / db:.3f}: "
            "the same comparison, insensitive to the engine's step cost drifting between phases)"
        )
    finally:
        engine.terminate()
        engine.wait()
        server.stop()
        shutil.rmtree(dump_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        if os.path.exists(dump_dir + ".lock"):  # harvest run's lock beside its dump dir
            os.unlink(dump_dir + ".lock")


if __name__ == "__main__":
    main()
