"""Samples/s of `harvest run` through an SGLang CPU server and a vLLM CPU server vs the
reference engine, same data (each engine where its venv is built).

Each engine is started once (start-up is timed and printed, not counted in the runs), then the
same dataset goes through the whole pipeline (private Redis, workers, collector, file://
output, fp32) against each in turn, `--repeat` times, alternating so that load from elsewhere
on the machine falls on all. Prints samples/s per run and the median ratios against the
reference engine. SGLang needs scripts/sglang_venv.sh, vLLM scripts/vllm_venv.sh; an engine
whose venv is missing is skipped, saying so.

    python bench/engines_vs_reference.py --samples 400 --workers 2 --repeat 2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harvest.cli.demo import build_tiny_model, demo_rows, write_jsonl  # noqa: E402
from harvest.cli.redisproc import free_port  # noqa: E402
from harvest.config import eagle3_layers  # noqa: E402
from harvest.engines import sglang_launch, vllm_launch  # noqa: E402
from harvest.health import wait_healthy  # noqa: E402


def _start(argv: list[str], env: dict[str, str], log: str, url: str) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(
            argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=REPO, start_new_session=True
        )

    def running() -> None:
        if p.poll() is not None:
            raise RuntimeError(f"{argv[:3]} exited {p.returncode}; see {log}")

    wait_healthy(url, None, check=running, interval=0.5, probe_timeout=2)  # no deadline: True or it raises
    return p, time.monotonic() - t0


def _run(work: str, tag: str, dataset: str, model: str, url: str, dump: str, workers: int, engine: str) -> float:
    args = [
        sys.executable,
        "-m",
        "harvest.cli",
        "run",
        dataset,
        "--model",
        model,
        "--out",
        f"file://{work}/out-{tag}",
        "--run",
        tag,
        "--dtype",
        "fp32",
        "--workers",
        str(workers),
        "--engine-url",
        url,
        "--dump-dir",
        dump,
        "--work-dir",
        f"{work}/work-{tag}",
        "--no-progress",
        "--engine",
        engine,
    ]
    res = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    m = re.search(r"samples: (\d+) done, (\d+) failed.*seconds: ([0-9.]+)", res.stdout, re.S)
    if res.returncode != 0 or not m or int(m.group(2)):
        raise RuntimeError(f"run {tag} failed:\n{res.stdout}\n{res.stderr[-2000:]}")
    return int(m.group(1)) / float(m.group(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="vLLM --enforce-eager")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="harvest-bench-sglang-")
    model = build_tiny_model(os.path.join(work, "model"))
    dataset = write_jsonl(os.path.join(work, "data.jsonl"), demo_rows(a.samples, seed=9))
    points = eagle3_layers(8)
    engines: dict[str, tuple[list[str], dict[str, str], str, str]] = {}  # name -> argv, env, url, dump dir
    port, dump = free_port(), os.path.join(work, "dump-reference")
    engines["reference"] = (
        [sys.executable, "-m", "harvest.cli", "engine", "--model", model, "--dump-dir", dump, "--port", str(port)],
        {},
        f"http://127.0.0.1:{port}",
        dump,
    )
    launchers = {  # name -> launcher module, its own launch options, PYTHONPATH for this checkout
        "sglang": (sglang_launch, {"device": "cpu"}, sglang_launch.cpu_pythonpath(REPO)),
        "vllm": (vllm_launch, {"enforce_eager": a.eager}, REPO),
    }
    for name, (launch, extra, path) in launchers.items():
        try:
            python = launch.venv_python()
        except FileNotFoundError as e:
            print(f"{name} skipped: {e}")
            continue
        port, dump = free_port(), os.path.join(work, f"dump-{name}")
        env, argv = launch.launch_spec(
            model, points, 8, dump_dir=dump, port=port, python=python, dtype="float32", **extra
        )
        env["PYTHONPATH"] = path
        engines[name] = (argv, env, f"http://127.0.0.1:{port}", dump)
    procs = []
    try:
        for name, (argv, env, url, dump) in engines.items():
            os.makedirs(dump, mode=0o700, exist_ok=True)
            p, seconds = _start(argv, env, os.path.join(work, f"{name}.log"), url)
            procs.append(p)
            print(f"start-up: {name} {seconds:.1f}s", flush=True)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for i in range(a.repeat):
            for name, (_, _, url, dump) in engines.items():
                rates[name].append(_run(work, f"{name}{i}", dataset, model, url, dump, a.workers, name))
            print(f"run {i + 1}: " + ", ".join(f"{n} {r[-1]:.1f} samples/s" for n, r in rates.items()), flush=True)
        base = rates["reference"]
        for name in engines:
            if name != "reference":
                ratio = statistics.median(x / b for x, b in zip(rates[name], base, strict=False))
                print(f"median {name}/reference: {ratio:.2f} ({a.samples} rows, {a.workers} workers)")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
                p.wait(60)


if __name__ == "__main__":
    main()
