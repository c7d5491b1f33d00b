"""Is the engine the bottleneck? The full pipeline against a direct client, same engine, same run.

(a) direct: W threads send the same batches of token ids to one reference engine, wait for
    each request's dump files, read them and delete them. This is the most a worker could
    do: nothing but the engine and reading its output.
(b) pipeline: `harvest run --engine-url` on the same rows against the same engine: producer,
    a private Redis, W workers (claim, verify, spool) and the collector committing shards to
    a local folder, timed from the command's start to its exit.

The engine is pinned to its own cores and everything else (the direct client, the pipeline,
Redis) to the others (`--no-pin` shares them), as on a GPU node where the forward does not
run on the host CPU. The engine reports its busy seconds and request count
(/get_server_info), polled during each phase, which splits (b)'s wall time into start-up
(before the first forward), steady state and tail (after the last forward). Prints samples/s
of both, (b)/(a) end to end and in steady state (goal >= 0.95), and the engine's busy share
and ms of forward per sample in each phase (a pipeline that slows the engine shows there).
The model is a random Llama large enough that its forward dominates the engine's own HTTP
and file overhead; its size is printed.

    python bench/pipeline.py --samples 640 --workers 1,2,4 [--repeat 2] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
from safetensors import safe_open

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harvest.cli.demo import build_tiny_model  # noqa: E402
from harvest.formats.dump import parse_chunk_name  # noqa: E402
from harvest.health import wait_healthy  # noqa: E402
from harvest.ids import rid_for, sample_id  # noqa: E402
from harvest.sample import Sample, split_jobs  # noqa: E402
from tests.support.benchengine import start_pinned_engine  # noqa: E402


def make_rows(n: int, mean_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab) for _ in range(rng.randint(mean_tokens // 2, mean_tokens * 3 // 2))] for _ in range(n)
    ]


def batches(rows: list[list[int]], max_samples: int, max_tokens: int) -> list[list[list[int]]]:
    """The producer's batching rule (harvest.sample.split_jobs), so both sides send the same work."""
    jobs = split_jobs([Sample.build(r) for r in rows], max_samples, max_tokens)
    return [[s.input_ids.tolist() for s in job] for job in jobs]


def wait_engine(url: str, proc: subprocess.Popen) -> None:
    def running() -> None:
        if proc.poll() is not None:
            raise SystemExit("engine exited")

    if not wait_healthy(url, 60, check=running, interval=0.1, probe_timeout=2):
        raise SystemExit("engine did not start")


def direct(url: str, dump_dir: str, work: list[list[list[int]]], threads: int, attempt: int) -> float:
    """Seconds for W threads to push every batch through the engine and read every dump."""
    todo = list(reversed(work))
    lock = threading.Lock()
    client = httpx.Client(timeout=600)

    def run() -> None:
        while True:
            with lock:
                if not todo:
                    return
                batch = todo.pop()
            rids = [rid_for(sample_id(np.array(ids, np.int32), np.ones(len(ids), np.uint8)), attempt) for ids in batch]
            r = client.post(
                f"{url}/generate",
                json={
                    "input_ids": batch,
                    "rid": rids,
                    "extra_key": rids,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                },
            )
            r.raise_for_status()
            want = {rid: len(ids) for rid, ids in zip(rids, batch, strict=False)}
            while want:
                for name in os.listdir(dump_dir):
                    p = parse_chunk_name(name)
                    if p is None or p[0] not in want:
                        continue
                    path = os.path.join(dump_dir, name)
                    with safe_open(path, "pt") as f:
                        f.get_tensor("hidden_states")
                        f.get_tensor("input_ids")
                    os.unlink(path)
                    want[p[0]] -= p[2] - p[1]
                    if want[p[0]] == 0:
                        del want[p[0]]
                if want:
                    time.sleep(0.005)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


class EngineWatch(threading.Thread):
    """Polls the engine's request counter and busy seconds (5 Hz, one kept-alive connection:
    a new httpx client per poll cost a fifth of a core) while a phase runs, to split its wall
    time into start-up (no request yet), steady state and tail (last request answered)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, timeout=10)
        self.stop, self.points = threading.Event(), []
        self.t0, self.base = time.perf_counter(), self.info()

    def info(self) -> dict:
        return self.http.get("/get_server_info").json()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            i = self.info()
            self.points.append(
                (
                    time.perf_counter() - self.t0,
                    i["requests"] - self.base["requests"],
                    i["busy_seconds"] - self.base["busy_seconds"],
                )
            )

    def finish(self) -> dict:
        self.stop.set()
        self.join()
        end = time.perf_counter() - self.t0
        i = self.info()
        self.http.close()
        total_req, busy = i["requests"] - self.base["requests"], i["busy_seconds"] - self.base["busy_seconds"]
        first = next((t for t, r, _ in self.points if r > 0), 0.0)
        # the first request is counted when it finishes: back off by its own busy time
        first = max(0.0, first - next((b for _, r, b in self.points if r > 0), 0.0))
        last = next((t for t, r, _ in self.points if r >= total_req), end)
        return {"busy": busy, "startup": first, "tail": end - last, "steady": last - first}


def pipeline(
    url: str, dump_dir: str, model: str, data: str, out: str, workers: int, run: str, profile: str | None = None
) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "run",
            data,
            "--model",
            model,
            "--out",
            out,
            "--run",
            run,
            "--engine-url",
            url,
            "--dump-dir",
            dump_dir,
            "--workers",
            str(workers),
            "--no-progress",
            "--work-dir",
            out + "-work",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    spies = attach_profilers(p.pid, profile, run) if profile else []
    stdout, stderr = p.communicate()
    dt = time.perf_counter() - t0
    for s in spies:
        s.wait()
    if p.returncode != 0:
        raise SystemExit(f"harvest run failed ({p.returncode}):\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return dt


def attach_profilers(run_pid: int, folder: str, tag: str) -> list[subprocess.Popen]:
    """py-spy on the first worker and the collector of a `harvest run`, once they are up."""
    import shutil

    if not shutil.which("py-spy"):
        print("py-spy not installed: no profile", flush=True)
        return []
    os.makedirs(folder, exist_ok=True)
    found: dict[str, int] = {}
    for _ in range(300):
        ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(run_pid)], capture_output=True, text=True).stdout
        for line in ps.splitlines():
            pid, args = line.strip().split(" ", 1)
            for role in ("worker", "collect"):
                if f"harvest.cli {role} " in args:
                    found.setdefault(role, int(pid))
        if len(found) == 2:
            break
        time.sleep(0.1)
    return [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "--format",
                "raw",
                "--rate",
                "50",
                "--pid",
                str(pid),
                "-o",
                os.path.join(folder, f"{tag}-{role}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for role, pid in found.items()
    ]


# Innermost frames that are a thread waiting (py-spy's idle detection misses them on this VM).
WAITING = (
    "Condition.wait",
    "_read_from_socket",
    "SyncStream.read",
    "sleep",
    "select",
    "Event.wait",
    "Thread.join",
    "Collector.run",
    "_worker (concurrent",
    "Overlap.wait",
    "_wait_for_tstate_lock",
    "poll",
    "accept",
)


def profile_summary(path: str, n: int = 6) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """A py-spy raw (collapsed) profile as shares of all samples: waiting (innermost frame is a
    wait), importing (a module import on the stack) and working; and the top working frames."""
    from collections import Counter

    c, shares, total = Counter(), Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            k, leaf = int(count), stack.split(";")[-1]
            total += k
            if not leaf.strip() or any(w in leaf for w in WAITING):
                shares["waiting"] += k
            elif "_find_and_load" in stack:
                shares["importing"] += k
            else:
                shares["working"] += k
                c[leaf] += k
    if not total:
        return {}, []
    return (
        {p: shares[p] / total for p in ("waiting", "importing", "working")},
        [(v / total, frame) for frame, v in c.most_common(n)],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--tokens", type=int, default=256, help="mean prompt length")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (the scaling curve)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-batch-samples", type=int, default=32)
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument(
        "--engine-cores",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="cores the engine is pinned to (its torch threads); everything else (the direct client, "
        "the pipeline, Redis) is pinned to the other cores, as on a GPU node where the forward "
        "does not run on the host CPU. Default: half the cores (1 of 2 here)",
    )
    ap.add_argument("--no-pin", action="store_true", help="share all cores; the engine gets --engine-cores threads")
    ap.add_argument("--repeat", type=int, default=1, help="alternate direct and pipeline runs this many times; medians")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the first worker and the collector of each pipeline run")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="harvest-bench-")
    model = build_tiny_model(
        os.path.join(os.path.expanduser("~/.cache/harvest"), f"bench-model-{args.layers}x{args.hidden}"),
        layers=args.layers,
        hidden=args.hidden,
    )
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    import torch
    from safetensors.torch import load_file

    params = sum(
        t.numel()
        for name in os.listdir(model)
        if name.endswith(".safetensors")
        for t in load_file(os.path.join(model, name)).values()
    )
    del torch
    print(
        f"model: Llama {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {params / 1e6:.1f}M params; "
        f"{args.samples} samples of ~{args.tokens} tokens",
        flush=True,
    )
    bench_engine = start_pinned_engine(model, tmp, "pipeline", args.engine_cores, pin=not args.no_pin)
    engine, url, dump_dir = bench_engine.proc, bench_engine.url, bench_engine.dump_dir
    if not args.no_pin:
        print(
            f"engine pinned to cores {bench_engine.cores}, direct client and pipeline to {bench_engine.rest}",
            flush=True,
        )
    try:
        wait_engine(url, engine)
        results = []
        for i, w in enumerate(int(x) for x in args.workers.split(",")):
            rows = make_rows(args.samples, args.tokens, cfg["vocab_size"], seed=100 + i)  # fresh rows: no run reuse
            data = os.path.join(tmp, f"rows-{w}.jsonl")
            with open(data, "w") as f:
                for r in rows:
                    f.write(json.dumps({"input_ids": r}) + "\n")
            work = batches(rows, args.max_batch_samples, args.max_batch_tokens)
            direct(url, dump_dir, work[:2], w, attempt=99)  # warm the engine's allocator
            n = args.samples
            reps = []
            for rep in range(args.repeat):
                watch = EngineWatch(url)
                watch.start()
                a = direct(url, dump_dir, work, w, attempt=100 + rep)
                da = watch.finish()
                watch = EngineWatch(url)
                watch.start()
                b = pipeline(
                    url,
                    dump_dir,
                    model,
                    data,
                    os.path.join(tmp, f"out-{w}-{rep}"),
                    w,
                    f"bench{w}r{rep}",
                    args.profile if rep == 0 else None,
                )
                pb = watch.finish()
                steady = n / pb["steady"] if pb["steady"] > 0 else float("nan")
                reps.append((n / a, n / b, steady))
                print(
                    f"workers {w} run {rep + 1}: direct {n / a:.2f} samples/s (engine {1000 * da['busy'] / n:.1f} ms/sample, "
                    f"busy {da['busy'] / a:.0%}); pipeline {n / b:.2f} samples/s end to end (ratio {a / b:.3f}): "
                    f"start-up {pb['startup']:.1f} s, tail {pb['tail']:.1f} s, steady {steady:.2f} samples/s "
                    f"(ratio {steady * a / n:.3f}; engine {1000 * pb['busy'] / n:.1f} ms/sample, "
                    f"busy {pb['busy'] / max(pb['steady'], 1e-9):.0%})",
                    flush=True,
                )
            results.append((w, *(statistics.median(x[k] for x in reps) for k in range(3))))
        if args.profile:
            for name in sorted(os.listdir(args.profile)):
                parts, top = profile_summary(os.path.join(args.profile, name))
                print(
                    f"\nprofile {name}: "
                    + ", ".join(f"{p} {v:.0%}" for p, v in parts.items())
                    + "; top working frames (share of all samples):"
                )
                for share, frame in top:
                    print(f"  {share:6.1%}  {frame}")
        print(
            f"\nmedians of {args.repeat} run(s) each\nworkers  direct_sps  pipeline_sps  ratio  steady_sps  steady_ratio"
        )
        for w, da, pb, st in results:
            print(f"{w:7d}  {da:10.2f}  {pb:12.2f}  {pb / da:5.3f}  {st:10.2f}  {st / da:12.3f}")
    finally:
        engine.terminate()
        engine.wait()
        shutil.rmtree(dump_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
