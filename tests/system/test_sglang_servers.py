"""harvest against real SGLang 0.5.23 CPU servers of their own (tests/system/test_sglang_live.py has
the module's shared server): the radix cache on, and `harvest run --engine sglang --tp 2`. Each test starts its server,
so this file runs on its own pytest-xdist worker, beside test_sglang_live.py's (tests/conftest.py).

Skipped, with the command that fixes it, where the SGLang venv is not built.
"""

from __future__ import annotations

import os
import re

import httpx
import numpy as np

from harvest.cli.demo import write_jsonl
from harvest.ids import sample_id
from harvest.read.reader import RunReader
from tests.support.cli import harvest_cli
from tests.support.need import need
from tests.support.sglang_server import (
    ABS_BOUND,
    CHUNK,
    POINTS,
    L,
    SGLangServer,
    StripExtraKey,
    check_run,
    model,  # noqa: F401 - a module fixture
    reference,  # noqa: F401 - a module fixture
    sglang_python_or_skip,
)

SGLANG_PYTHON = sglang_python_or_skip()


def test_radix_cache_on_is_guarded(tmp_path, model, reference):
    """A server with the radix cache on. The cache is real (a repeated plain prompt is served from
    it), harvest's unique extra_key per request keeps every sample out of it (all stored, exact),
    and where an engine drops extra_key the samples it serves from the cache fail as
    prefix-cached while the others are stored."""
    dumps = tmp_path / "dumps"
    dumps.mkdir(mode=0o700)
    s = SGLangServer(
        SGLANG_PYTHON,
        model,
        POINTS,
        L,
        str(dumps),
        str(tmp_path / "server.log"),
        chunked_prefill_size=CHUNK,
        radix_cache=True,
    ).start()
    proxy = None
    try:
        warmed = [{"input_ids": [10 + i, *[5 + (i * 11 + j * 3) % 500 for j in range(40)]]} for i in range(3)]
        fresh = [{"input_ids": [20 + i, *[5 + (i * 17 + j * 5) % 500 for j in range(50)]]} for i in range(3)]
        for r in warmed:  # plain requests fill the cache (no extra_key)
            httpx.post(
                f"{s.url}/generate", json={**r, "sampling_params": {"max_new_tokens": 1}}, timeout=60
            ).raise_for_status()
        again = httpx.post(
            f"{s.url}/generate", json={**warmed[0], "sampling_params": {"max_new_tokens": 1}}, timeout=60
        )
        assert again.json()["meta_info"]["cached_tokens"] >= 40, again.text
        assert [n for n in os.listdir(dumps)] == []
        dataset = write_jsonl(str(tmp_path / "radix.jsonl"), [*warmed, *fresh])
        common = [
            "--model",
            model,
            "--dtype",
            "fp32",
            "--layers",
            ",".join(map(str, POINTS)),
            "--workers",
            "1",
            "--no-progress",
            "--dump-dir",
            str(dumps),
        ]
        res = harvest_cli(
            "run",
            dataset,
            "--out",
            f"file://{tmp_path}/out",
            "--run",
            "isolated",
            "--engine-url",
            s.url,
            "--work-dir",
            str(tmp_path / "w1"),
            *common,
            timeout=600,
        )
        assert res.returncode == 0 and "samples: 6 done, 0 failed" in res.stdout, res.stdout + res.stderr
        expected = {
            sample_id(np.array(r["input_ids"]), np.ones(len(r["input_ids"]))): (
                r["input_ids"],
                [1] * len(r["input_ids"]),
            )
            for r in [*warmed, *fresh]
        }
        check_run(f"file://{tmp_path}/out/isolated", expected, reference)

        proxy = StripExtraKey(s.url)
        res = harvest_cli(
            "run",
            dataset,
            "--out",
            f"file://{tmp_path}/out",
            "--run",
            "stripped",
            "--engine-url",
            proxy.url,
            "--work-dir",
            str(tmp_path / "w2"),
            *common,
            timeout=600,
        )
        assert res.returncode == 1, res.stdout + res.stderr
        assert "samples: 3 done, 3 failed" in res.stdout and "failed because prefix-cached: 3" in res.stdout, res.stdout
        reader = RunReader(f"file://{tmp_path}/out/stripped")
        assert sorted(reader.sample_ids) == sorted(
            sample_id(np.array(r["input_ids"]), np.ones(len(r["input_ids"]))) for r in fresh
        )
        assert [n for n in os.listdir(dumps) if n.startswith("hv-")] == []  # the cached samples' partial dumps cleared
    finally:
        if proxy is not None:
            proxy.close()
        s.stop()


def test_run_engine_sglang_tp_2_only_rank_0_writes(tmp_path, model, reference):
    """`harvest run --engine sglang --tp 2` on a machine without GPUs: the code path a GPU node runs
    (harvest.cli.engineplan, harvest.cli.node) on SGLang's CPU engine, a core per rank
    (SGLANG_CPU_OMP_THREADS_BIND, as SGLang asks on a one-NUMA-node machine): both ranks run the
    plugin, only rank 0 writes, every sample committed with the right states."""
    if len(os.sched_getaffinity(0)) < 2:
        need("a second core", "TP 2 on SGLang's CPU engine needs a core per rank")
    prompts = [[5 + (i * 31 + j * 7) % 500 for j in range(20 + 50 * i)] for i in range(4)]
    expected = {sample_id(np.array(p, np.int32), np.ones(len(p), np.uint8)): (p, [1] * len(p)) for p in prompts}
    dataset = write_jsonl(str(tmp_path / "tp2.jsonl"), [{"input_ids": p} for p in prompts])
    work = tmp_path / "work"
    res = harvest_cli(
        "run",
        dataset,
        "--model",
        model,
        "--out",
        f"file://{tmp_path}/out",
        "--run",
        "tp2",
        "--dtype",
        "fp32",
        "--layers",
        ",".join(map(str, POINTS)),
        "--engine",
        "sglang",
        "--tp",
        "2",
        "--chunked-prefill-size",
        str(CHUNK),
        "--workers",
        "1",
        "--no-progress",
        "--work-dir",
        str(work),
        "--dump-dir",
        str(tmp_path / "dumps"),
        timeout=600,
        env={"HARVEST_SGLANG_VENV": os.path.dirname(os.path.dirname(SGLANG_PYTHON))},
    )
    log = (work / "logs" / "engine.log").read_text(errors="replace")
    assert res.returncode == 0, res.stdout + res.stderr + log[-3000:]
    assert f"samples: {len(prompts)} done, 0 failed" in res.stdout, res.stdout
    assert "'tp_size': 2," in log and "TP1] init_threads_binding" in log, log[-3000:]
    assert re.search(r"TP0\] harvest: this rank writes the dumps", log), log[-3000:]
    assert re.search(r"TP1\] harvest: not TP rank 0: this rank writes no dumps", log), log[-3000:]
    assert "TP1] harvest: this rank writes" not in log
    check_run(f"file://{tmp_path}/out/tp2", expected, reference)
    assert reference.worst_abs <= ABS_BOUND, (reference.worst_abs, reference.worst_rel)
