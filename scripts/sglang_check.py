"""Check harvest against a real SGLang server on a GPU node, or on CPU (`--device cpu`).

Launches SGLang with the harvest plugin (the command `harvest sglang-args` prints), extracts a
generated dataset through the full pipeline (`harvest run --engine-url`), and compares every
stored sample with an independent transformers forward at every capture point. Chunked
prefill is set small so long samples arrive in several chunks, and the server also gets
plain (non-harvest) requests and a repeated prompt, which must not produce or disturb dumps.

    python scripts/sglang_check.py --model /models/Qwen2.5-0.5B-Instruct --samples 100
    python scripts/sglang_check.py --device cpu --model DIR --long-words 300   # SGLang's CPU engine

On GPU both sides run in bf16 with different kernels; on CPU the server runs from its venv
(scripts/sglang_venv.sh, with the test-only stand-in for SGLang's CPU kernels) and both sides in
fp32. The comparison is by relative error, max absolute difference and cosine similarity per
capture point, not exact equality; token ids must match exactly and every sample must be done.
Exit status 0 means every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

import httpx
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harvest.config import model_layers, parse_layers  # noqa: E402
from harvest.engines.sglang_launch import cpu_pythonpath, launch_spec, venv_python  # noqa: E402
from harvest.health import wait_healthy  # noqa: E402
from harvest.read.reader import RunReader  # noqa: E402

WORDS = "the a model token layer state hidden draft speculative decode prefill batch queue shard".split()


def dataset_rows(n: int, seed: int, long_words: int = 1500) -> list[dict]:
    """Chat rows of mixed length and turn count; every 10th is long (several prefill chunks)."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        turns = 1 + i % 3
        msgs = [{"role": "system", "content": text(8)}] if i % 2 else []
        for _ in range(turns):
            msgs.append({"role": "user", "content": text(rng.randint(5, 60))})
            msgs.append({"role": "assistant", "content": text(long_words if i % 10 == 0 else rng.randint(5, 120))})
        rows.append({"messages": msgs})
    return rows


def wait_started(url: str, proc: subprocess.Popen, timeout: float) -> None:
    def running() -> None:
        if proc.poll() is not None:
            raise SystemExit(f"SGLang exited with {proc.returncode} before it was healthy (see its log)")

    if not wait_healthy(url, timeout, check=running, interval=3, probe_timeout=5):
        raise SystemExit(f"SGLang not healthy after {timeout:.0f}s")


def side_traffic(url: str, dump_dir: str) -> list[str]:
    """Plain requests (no hv- rid) must leave no dump file; the plugin must ignore decode steps."""
    problems = []
    before = set(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else set()
    r = httpx.post(
        f"{url}/generate", json={"text": "hello there", "sampling_params": {"max_new_tokens": 16}}, timeout=120
    )
    r.raise_for_status()
    time.sleep(1)
    after = set(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else set()
    if after - before:
        problems.append(f"a plain request left dump files: {sorted(after - before)[:5]}")
    return problems


def compare(model_dir: str, run_url: str, points: list[int], device: str) -> tuple[list[str], dict]:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    reader = RunReader(run_url)
    worst = {p: {"rel": 0.0, "abs": 0.0, "cos": 1.0} for p in points}
    problems = []
    for sid in reader.sample_ids:
        s = reader.get(sid)
        ids = s["input_ids"].to(torch.int64)
        with torch.no_grad():
            out = model(ids.unsqueeze(0).to(device), output_hidden_states=True)
        for k, p in enumerate(points):
            ref = out.hidden_states[p][0].float().cpu()
            got = s["hidden_states"][:, k].float()
            rel = float((got - ref).norm(dim=-1).max() / ref.norm(dim=-1).clamp_min(1e-6).min())
            cos = float(torch.nn.functional.cosine_similarity(got, ref, dim=-1).min())
            worst[p]["rel"] = max(worst[p]["rel"], rel)
            worst[p]["abs"] = max(worst[p]["abs"], float((got - ref).abs().max()))
            worst[p]["cos"] = min(worst[p]["cos"], cos)
            if cos < 0.99:
                problems.append(f"sample {sid} point {p}: min cosine {cos:.4f} against transformers")
    return problems, {"samples": len(reader), "worst": worst}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local HF model directory (small, e.g. 0.5B-1B)")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--layers", default="eagle3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--work", default="/tmp/harvest-sglang-check")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: SGLang's CPU engine from HARVEST_SGLANG_VENV (scripts/sglang_venv.sh), fp32",
    )
    ap.add_argument("--long-words", type=int, default=1500, help="words per assistant turn of every 10th sample")
    args = ap.parse_args()

    if args.device == "cpu":
        python = venv_python()
        sgl_version = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    else:
        from importlib.metadata import version

        python, sgl_version = sys.executable, version("sglang")
    n_layers = model_layers(args.model)
    points = parse_layers(args.layers, n_layers)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    dump_dir = "/dev/shm/harvest-sglang-check"
    shutil.rmtree(dump_dir, ignore_errors=True)
    data = os.path.join(args.work, "data.jsonl")
    with open(data, "w") as f:
        for row in dataset_rows(args.samples, seed=0, long_words=args.long_words):
            f.write(json.dumps(row) + "\n")

    env, argv = launch_spec(
        args.model,
        points,
        n_layers,
        dump_dir=dump_dir,
        tp_size=args.tp,
        port=args.port,
        chunked_prefill_size=args.chunked_prefill_size,
        sglang_version=sgl_version,
        device=args.device,
        python=python,
        dtype="float32" if args.device == "cpu" else "auto",
    )
    if args.device == "cpu":  # this checkout's plugin and kernel stand-in, whichever checkout built the venv
        env["PYTHONPATH"] = cpu_pythonpath(REPO)
    url = f"http://127.0.0.1:{args.port}"
    print(f"sglang {sgl_version}, {n_layers} layers, capture points {points}", flush=True)
    log = open(os.path.join(args.work, "sglang.log"), "w")
    server = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    report: dict = {"sglang": sgl_version, "model": args.model, "capture_points": points}
    try:
        t0 = time.monotonic()
        wait_started(url, server, args.startup_timeout)
        report["startup_s"] = round(time.monotonic() - t0, 1)
        problems = side_traffic(url, dump_dir)
        out = os.path.join(args.work, "out")
        t0 = time.monotonic()
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "harvest.cli",
                "run",
                data,
                "--model",
                args.model,
                "--out",
                out,
                "--run",
                "check",
                "--engine-url",
                url,
                "--dump-dir",
                dump_dir,
                "--dtype",
                "fp32" if args.device == "cpu" else "bf16",
                "--layers",
                ",".join(map(str, points)),
                "--workers",
                "2",
                "--work-dir",
                os.path.join(args.work, "state"),
                "--no-progress",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        report["run_s"] = round(time.monotonic() - t0, 1)
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", flush=True)
        if run.returncode != 0:
            problems.append(f"harvest run exited {run.returncode}")
        cmp_problems, stats = compare(args.model, os.path.join(out, "check"), points, args.device)
        problems += cmp_problems
        report.update(stats)
        if stats["samples"] != args.samples:
            problems.append(f"{stats['samples']} samples stored, {args.samples} expected")
        leftovers = [n for n in os.listdir(dump_dir) if not n.startswith(".")] if os.path.isdir(dump_dir) else []
        if leftovers:
            problems.append(f"{len(leftovers)} unclaimed dump files left: {leftovers[:5]}")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    report["problems"] = problems
    print(json.dumps(report, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
