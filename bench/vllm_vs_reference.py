"""Samples/s of `harvest run` through a vLLM CPU server vs through the reference engine, same data.

Both engines are started once (their start-up is timed and printed, not counted in the runs),
then the same dataset goes through the whole pipeline (private Redis, workers, collector,
file:// output, fp32) against each in turn, `--repeat` times, alternating so that load from
elsewhere on the machine falls on both. Prints samples/s per run and the median ratio.
Needs the vLLM venv (scripts/vllm_venv.sh).

    python bench/vllm_vs_reference.py --samples 1500 --workers 2 --repeat 2
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

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from engines.vllm_launch import launch_spec, venv_python  # noqa: E402
from harvest.cli.demo import build_tiny_model, demo_rows, write_jsonl  # noqa: E402
from harvest.cli.redisproc import free_port  # noqa: E402
from harvest.config import eagle3_layers  # noqa: E402


def _start(argv: list[str], env: dict[str, str], log: str, url: str) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=REPO)
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"{argv[:3]} exited {p.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return p, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _run(work: str, tag: str, dataset: str, model: str, url: str, dump: str, workers: int, vllm: bool) -> float:
    args = [sys.executable, "-m", "harvest.cli", "run", dataset, "--model", model, "--out", f"file://{work}/out-{tag}",
            "--run", tag, "--dtype", "fp32", "--workers", str(workers), "--engine-url", url, "--dump-dir", dump,
            "--work-dir", f"{work}/work-{tag}", "--no-progress"] + (["--engine", "vllm"] if vllm else [])
    res = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    m = re.search(r"samples: (\d+) done, (\d+) failed.*seconds: ([0-9.]+)", res.stdout, re.S)
    if res.returncode != 0 or not m or int(m.group(2)):
        raise RuntimeError(f"run {tag} failed:\n{res.stdout}\n{res.stderr[-2000:]}")
    return int(m.group(1)) / float(m.group(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="vLLM --enforce-eager")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="harvest-bench-vllm-")
    model = build_tiny_model(os.path.join(work, "model"))
    dataset = write_jsonl(os.path.join(work, "data.jsonl"), demo_rows(a.samples, seed=9))
    points = eagle3_layers(8)
    vport, rport = free_port(), free_port()
    vdump, rdump = os.path.join(work, "dump-vllm"), os.path.join(work, "dump-ref")
    env, argv = launch_spec(model, points, 8, dump_dir=vdump, port=vport, python=venv_python(), dtype="float32",
                            enforce_eager=a.eager)
    env["PYTHONPATH"] = REPO
    procs = []
    try:
        vp, vstart = _start(argv, env, os.path.join(work, "vllm.log"), f"http://127.0.0.1:{vport}")
        procs.append(vp)
        rp, rstart = _start([sys.executable, "-m", "harvest.cli", "engine", "--model", model, "--dump-dir", rdump,
                             "--port", str(rport)], {}, os.path.join(work, "ref.log"), f"http://127.0.0.1:{rport}")
        procs.append(rp)
        print(f"start-up: vLLM {vstart:.1f}s (eager={a.eager}), reference {rstart:.1f}s")
        ratios = []
        for i in range(a.repeat):
            ref = _run(work, f"ref{i}", dataset, model, f"http://127.0.0.1:{rport}", rdump, a.workers, False)
            vll = _run(work, f"vllm{i}", dataset, model, f"http://127.0.0.1:{vport}", vdump, a.workers, True)
            ratios.append(vll / ref)
            print(f"run {i + 1}: reference {ref:.1f} samples/s, vLLM {vll:.1f} samples/s, ratio {vll / ref:.2f}")
        print(f"median vLLM/reference: {statistics.median(ratios):.2f} ({a.samples} rows, {a.workers} workers)")
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)


if __name__ == "__main__":
    main()
