"""A full Redis is a pause, not a crash: `harvest run`'s private Redis is set to `maxmemory` 1 byte
(policy noeviction) half way through the run, so it refuses every write that may grow memory with
OOM. Every worker and the collector waits (one line naming the cause and the fix, no traceback, no
exit, no restart), and once `maxmemory` is raised the run finishes by itself, every sample
committed exactly once (counted from the index files), none failed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import redis

from harvest.ids import sample_id
from harvest.state.keys import Keys
from tests.support.chaos import make_rows
from tests.support.cli import REPO, kill_group
from tests.support.ops import wait_until
from tests.system.test_redis_outage import _busy, _committed, _private_redis  # its harness

LINE = ("refuses writes (OOM: Redis is out of memory (used memory over maxmemory, policy noeviction)): waiting up to "
        "300 s for it to take them again; fix: raise its maxmemory (redis-cli CONFIG SET maxmemory ...) or free memory "
        "on it; keep the policy noeviction, harvest's keys must not be evicted")


def test_harvest_run_waits_out_a_full_redis_and_finishes(tiny_model, tmp_path):
    from transformers import AutoConfig

    rows = make_rows(24, AutoConfig.from_pretrained(tiny_model).vocab_size, random.Random(7))
    expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)) for r in rows}
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    work, out = tmp_path / "work", tmp_path / "out"
    stdout, stderr = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    p = subprocess.Popen(
        [sys.executable, "-m", "harvest.cli", "run", str(data), "--model", tiny_model, "--out", str(out), "--run",
         "full", "--dtype", "fp32", "--batch-samples", "2", "--max-wait", "1", "--chunked-prefill-size", "32",
         "--no-progress", "--work-dir", str(work), "--dump-dir", str(tmp_path / "dumps")],
        cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _, port = wait_until(lambda: _private_redis(p), 60, "harvest run's redis-server")
        conn = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        url = f"redis://127.0.0.1:{port}/0"
        logs = {n: work / "logs" / f"{n}.log" for n in ("worker-1", "worker-2", "collector")}

        def mid_run() -> dict | None:
            assert p.poll() is None, open(tmp_path / "stderr").read()
            c = {k.decode(): int(v) for k, v in conn.hgetall(Keys("full").counts).items()}
            return c if c.get("s", 0) + c.get("d", 0) >= 2 and c.get("q", 0) > 0 and _busy(conn) else None

        at_full = wait_until(mid_run, 120, "the run half way with a job in flight", poll=0.01)
        conn.config_set("maxmemory", 1)
        try:
            wait_until(lambda: all(f"Redis at {url} {LINE}" in path.read_text(errors="replace") for path in
                                   logs.values()), 60, "every worker and the collector waiting for writes")
            assert p.poll() is None
        finally:
            conn.config_set("maxmemory", 0)
        rc = p.wait(150)
    finally:
        kill_group(p)  # the run and whatever it started
        p.wait()
    stdout.seek(0), stderr.seek(0)
    text, err = stdout.read(), stderr.read()
    assert rc == 0, text + err
    assert at_full["q"] > 0  # Redis filled up mid-run
    n = len(expected)
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in text, text + err
    assert "restarted:" not in text, text  # no child exited
    assert _committed(str(out / "full")) == Counter({sid: 1 for sid in expected})
    for name, path in logs.items():
        log = path.read_text(errors="replace")
        assert log.count(f"Redis at {url} refuses writes") == 1, (name, log[-3000:])  # one line, not one a call
        assert f"Redis at {url} takes writes again after " in log, (name, log[-3000:])
        assert "Traceback" not in log and "OutOfMemoryError" not in log, (name, log[-3000:])
        assert "worker-error" not in log, (name, log[-3000:])
