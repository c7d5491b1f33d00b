"""harvest against real SGLang 0.5.23 CPU servers of their own (tests/system/test_sglang_live.py has
the module's shared server): the radix cache on, and tensor parallel 2. Each test starts its server,
so this file runs on its own pytest-xdist worker, beside test_sglang_live.py's (tests/conftest.py).

Skipped, with the command that fixes it, where the SGLang venv is not built.
"""

from __future__ import annotations

import os
import re

import httpx
import numpy as np

from harvest.cli.demo import write_jsonl
from harvest.ids import rid_for, sample_id
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
    dump_files,
    model,  # noqa: F401 - a module fixture
    reference,  # noqa: F401 - a module fixture
    sglang_python_or_skip,
    wait_dumped,
)

SGLANG_PYTHON = sglang_python_or_skip()


def test_radix_cache_on_is_guarded(tmp_path, model, reference):
    """A server with the radix cache on. The cache is real (a repeated plain prompt is served from
    it), harvest's unique extra_key per request keeps every sample out of it (all stored, exact),
    and where an engine drops extra_key the samples it serves from the cache fail as
    prefix-cached while the others are stored."""
    dumps = tmp_path / "dumps"
    dumps.mkdir(mode=0o700)
    s = SGLangServer(SGLANG_PYTHON, model, POINTS, L, str(dumps), str(tmp_path / "server.log"),
                     chunked_prefill_size=CHUNK, radix_cache=True).start()
    proxy = None
    try:
        warmed = [{"input_ids": [10 + i, *[5 + (i * 11 + j * 3) % 500 for j in range(40)]]} for i in range(3)]
        fresh = [{"input_ids": [20 + i, *[5 + (i * 17 + j * 5) % 500 for j in range(50)]]} for i in range(3)]
        for r in warmed:  # plain requests fill the cache (no extra_key)
            httpx.post(f"{s.url}/generate", json={**r, "sampling_params": {"max_new_tokens": 1}}, timeout=60).raise_for_status()
        again = httpx.post(f"{s.url}/generate", json={**warmed[0], "sampling_params": {"max_new_tokens": 1}}, timeout=60)
        assert again.json()["meta_info"]["cached_tokens"] >= 40, again.text
        assert [n for n in os.listdir(dumps)] == []
        dataset = write_jsonl(str(tmp_path / "radix.jsonl"), [*warmed, *fresh])
        common = ["--model", model, "--dtype", "fp32", "--layers", ",".join(map(str, POINTS)), "--workers", "1",
                  "--no-progress", "--dump-dir", str(dumps)]
        res = harvest_cli("run", dataset, "--out", f"file://{tmp_path}/out", "--run", "isolated", "--engine-url", s.url,
                          "--work-dir", str(tmp_path / "w1"), *common, timeout=600)
        assert res.returncode == 0 and "samples: 6 done, 0 failed" in res.stdout, res.stdout + res.stderr
        expected = {sample_id(np.array(r["input_ids"]), np.ones(len(r["input_ids"]))): (r["input_ids"], [1] * len(r["input_ids"]))
                    for r in [*warmed, *fresh]}
        check_run(f"file://{tmp_path}/out/isolated", expected, reference)

        proxy = StripExtraKey(s.url)
        res = harvest_cli("run", dataset, "--out", f"file://{tmp_path}/out", "--run", "stripped", "--engine-url", proxy.url,
                          "--work-dir", str(tmp_path / "w2"), *common, timeout=600)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "samples: 3 done, 3 failed" in res.stdout and "failed because prefix-cached: 3" in res.stdout, res.stdout
        reader = RunReader(f"file://{tmp_path}/out/stripped")
        assert sorted(reader.sample_ids) == sorted(sample_id(np.array(r["input_ids"]), np.ones(len(r["input_ids"])))
                                                   for r in fresh)
        assert [n for n in os.listdir(dumps) if n.startswith("hv-")] == []  # the cached samples' partial dumps cleared
    finally:
        if proxy is not None:
            proxy.close()
        s.stop()


def test_tensor_parallel_2_only_rank_0_writes(tmp_path, model, reference):
    """TP 2 on SGLang's CPU engine (one core per rank: SGLANG_CPU_OMP_THREADS_BIND, as SGLang asks
    on a one-NUMA-node machine): both ranks run the plugin, only rank 0 writes, states right."""
    if (os.cpu_count() or 1) < 2:
        need("a second core", "TP 2 on SGLang's CPU engine needs a core per rank")
    dumps = tmp_path / "dumps"
    dumps.mkdir(mode=0o700)
    s = SGLangServer(SGLANG_PYTHON, model, POINTS, L, str(dumps), str(tmp_path / "server.log"), chunked_prefill_size=CHUNK,
                     tp_size=2, extra_env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}).start()
    try:
        prompts = {rid_for(f"{i + 100:032x}", 1): [5 + (i * 29 + j * 3) % 500 for j in range(30 + 60 * i)] for i in range(3)}
        r = httpx.post(f"{s.url}/generate", json={"rid": list(prompts), "input_ids": list(prompts.values()),
                                                  "extra_key": list(prompts), "sampling_params": {"max_new_tokens": 1}},
                       timeout=300)
        assert r.status_code == 200, r.text
        wait_dumped(str(dumps), prompts)  # the plugin's writer is asynchronous
        files = dump_files(str(dumps))
        assert sorted(files) == sorted(prompts)
        for rid, parts in files.items():
            assert parts[0][0] == 0 and parts[-1][1] == len(prompts[rid])
            for a, e, hs in parts:
                reference.check(hs, prompts[rid], POINTS, a, e)
        assert reference.worst_abs <= ABS_BOUND, reference.worst_abs
        log = s.log_tail(10**7)
        assert re.search(r"TP0\] harvest: this rank writes the dumps", log), log[-3000:]
        assert re.search(r"TP1\] harvest: not TP rank 0: this rank writes no dumps", log), log[-3000:]
        assert "TP1] harvest: this rank writes" not in log
    finally:
        s.stop()

