"""What cannot work is refused before anything starts, with one line naming the fix: `harvest node`
exits 78 (a configuration error: the scheduler fails the job rather than requeueing it),
`harvest run` 2. The engines are planned from real Python environments: venvs built here with a
stand-in `sglang` distribution of a chosen version, and an `nvidia-smi` on PATH that lists a
chosen number of GPUs (or fails, as on a machine without GPUs)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harvest.cli.demo import build_tiny_model, write_jsonl
from harvest.cli.engineplan import cpu_cores
from harvest.cli.redisproc import RedisServer
from tests.support.cli import harvest_cli

RANGE = "0.5.11 to 0.5.23"
PIP = "pip install 'sglang[all]>=0.5.11,<=0.5.23'"


def sglang_venv(root: Path, version: str | None) -> Path:
    """A finished harvest engine venv (its `.harvest-complete`) whose python imports a stand-in
    `sglang` distribution of `version` (None: no sglang at all)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    if version is not None:
        site = next((root / "lib").glob("python*/site-packages"))
        (site / "sglang").mkdir()
        (site / "sglang" / "__init__.py").write_text("")
        info = site / f"sglang-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    (root / ".harvest-complete").write_text("")
    return root


def gpus_on_path(root: Path, n: int | None) -> dict[str, str]:
    """PATH with an `nvidia-smi` listing `n` GPUs first (None: one that fails, as without a driver)."""
    root.mkdir(parents=True, exist_ok=True)
    smi = root / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(n or 0))
    smi.write_text("#!/bin/sh\n" + (lines if n is not None else "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{root}{os.pathsep}{os.environ['PATH']}"}


def node(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return harvest_cli(
        "node", "--run", "r", "--redis", "redis://127.0.0.1:1/0", "--join-wait", "0", *args, env=env, timeout=120
    )


def refused(res: subprocess.CompletedProcess, status: int, line: str) -> None:
    assert res.returncode == status, res.stdout + res.stderr
    assert res.stderr == f"harvest: error: {line}\n"


def test_a_bad_flag_exits_78(tmp_path):
    res = node("--tp", "0")
    assert res.returncode == 78, res.stderr
    assert "Error: Invalid value for '--tp': 0 is not in the range x>=1." in res.stderr


def test_sglang_missing_is_refused_naming_both_ways_to_install_it(tmp_path):
    if subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0:
        pytest.skip("SGLang is installed in this Python environment")
    env = {"HOME": str(tmp_path), "HARVEST_SGLANG_VENV": ""}  # no default venv under this HOME
    refused(
        node("--engine", "sglang", env=env),
        78,
        f"SGLang is not installed in this Python environment ({sys.executable}): {PIP}, or point "
        "HARVEST_SGLANG_VENV at a venv that has it (scripts/sglang_venv.sh builds one)",
    )
    bare = sglang_venv(tmp_path / "bare", None)
    refused(
        node("--engine", "sglang", env={"HARVEST_SGLANG_VENV": str(bare)}),
        78,
        f"SGLang is not installed for {bare}/bin/python: {PIP} there, or point HARVEST_SGLANG_VENV at a venv that "
        "has it (scripts/sglang_venv.sh builds one)",
    )


def test_an_sglang_outside_the_supported_range_is_refused(tmp_path, tiny_model):
    old = sglang_venv(tmp_path / "old", "0.4.6")
    line = f"SGLang 0.4.6 (in {old}/bin/python) is outside the supported range {RANGE}: {PIP}"
    refused(node("--engine", "sglang", env={"HARVEST_SGLANG_VENV": str(old)}), 78, line)
    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"input_ids": [5, 6, 7]}])
    res = harvest_cli(
        "run",
        data,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--engine",
        "sglang",
        "--work-dir",
        str(tmp_path / "work"),
        "--no-progress",
        env={"HARVEST_SGLANG_VENV": str(old)},
    )
    refused(res, 2, line)
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()  # nothing started, nothing written


def test_too_few_gpus_or_cores_for_tp_times_dp_are_refused(tmp_path):
    venv = {"HARVEST_SGLANG_VENV": str(sglang_venv(tmp_path / "ok", "0.5.23"))}
    two = gpus_on_path(tmp_path / "two", 2)
    refused(
        node("--engine", "sglang", "--tp", "2", "--dp", "2", env={**venv, **two}),
        78,
        "too few GPUs: --tp 2 x --dp 2 needs 4, this node has 2 (nvidia-smi -L, within CUDA_VISIBLE_DEVICES): "
        "lower --tp or --dp",
    )
    refused(
        node("--engine", "sglang", "--tp", "2", env={**venv, **two, "CUDA_VISIBLE_DEVICES": "1"}),
        78,
        "too few GPUs: --tp 2 x --dp 1 needs 2, this node has 1 (nvidia-smi -L, within CUDA_VISIBLE_DEVICES): "
        "lower --tp or --dp",
    )
    cores = cpu_cores()
    none = gpus_on_path(tmp_path / "none", None)
    refused(
        node("--engine", "sglang", "--tp", str(cores + 1), env={**venv, **none}),
        78,
        f"too few cores for the SGLang CPU engine (no GPU: nvidia-smi -L lists none): --tp {cores + 1} x --dp 1 "
        f"needs {cores + 1}, this node has {cores}: lower --tp or --dp",
    )


def test_the_reference_engine_takes_no_tp(tmp_path, tiny_model):
    refused(
        node("--engine", "reference", "--tp", "2"),
        78,
        "--tp 2: the reference engine runs in one CPU process; use --dp N for N of them, or --engine sglang/vllm "
        "for tensor parallelism",
    )


def test_a_model_that_is_not_the_runs_is_refused(tmp_path, tiny_model):
    server = RedisServer(str(tmp_path / "redis")).start()
    try:
        data = write_jsonl(str(tmp_path / "d.jsonl"), [{"input_ids": [5, 6, 7]}])
        res = harvest_cli(
            "produce", data, "--run", "r", "--redis", server.url, "--model", tiny_model, "--out", str(tmp_path / "out")
        )
        assert res.returncode == 0, res.stderr
        other = build_tiny_model(str(tmp_path / "other"), seed=1)
        res = harvest_cli(
            "node",
            "--run",
            "r",
            "--redis",
            server.url,
            "--model",
            other,
            "--join-wait",
            "5",
            "--work",
            str(tmp_path / "work"),
        )
        assert res.returncode == 78, res.stdout + res.stderr
        assert res.stderr.startswith("harvest: error: ") and "fingerprint" in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1 and not (tmp_path / "work").exists()
    finally:
        server.stop()


def test_tp_and_dp_give_each_server_its_own_gpus_in_order(tmp_path, monkeypatch):
    from harvest.cli.engineplan import plan_engines

    venv = sglang_venv(tmp_path / "ok", "0.5.23.post1")
    monkeypatch.setenv("HARVEST_SGLANG_VENV", str(venv))
    for k, v in gpus_on_path(tmp_path / "four", 4).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2,1,0")
    plan = plan_engines("sglang", tp=2, dp=2)
    assert (plan.device, plan.python, plan.version) == ("cuda", f"{venv}/bin/python", "0.5.23")
    assert plan.gpus == (("3", "2"), ("1", "0"))
    assert plan.env(1)["CUDA_VISIBLE_DEVICES"] == "1,0" and plan.env(0)["CUDA_VISIBLE_DEVICES"] == "3,2"
    for k, v in gpus_on_path(tmp_path / "none", None).items():  # no GPU: the CPU engine, with its kernel stand-in
        monkeypatch.setenv(k, v)
    plan = plan_engines("sglang", tp=1, dp=1)
    assert (plan.device, plan.gpus) == ("cpu", ()) and "CUDA_VISIBLE_DEVICES" not in plan.env(0)
    assert plan.env(0)["PYTHONPATH"].endswith("tests/support/sgl_kernel_standin")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # TP 2 on the CPU engine: each rank its own half of the cores, as SGLang asks
        half = len(cores) // 2
        plan = plan_engines("sglang", tp=2, dp=1)
        ranks = plan.env(0)["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
        assert len(ranks) == 2 and ranks[0].split("-")[0].split(",")[0] == str(cores[0])
        assert ranks[1].split("-")[0].split(",")[0] == str(cores[half])
