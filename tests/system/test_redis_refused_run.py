"""A full Redis is a pause, not a crash: `harvest run`'s private Redis is set to `maxmemory` 1 byte
(policy noeviction) half way through the run, so it refuses every write that may grow memory with
OOM. Every worker and the collector waits (one line naming the cause and the fix, no traceback, no
exit, no restart), and once `maxmemory` is raised the run finishes by itself, every sample
committed exactly once (counted from the index files), none failed."""

from __future__ import annotations

from collections import Counter

import redis

from harvest.state.keys import Keys
from tests.support.localrun import start_run
from tests.support.ops import wait_until
from tests.system.test_redis_outage import _busy, _private_redis  # its harness

LINE = (
    "refuses writes (OOM: Redis is out of memory (used memory over maxmemory, policy noeviction)): waiting up to "
    "300 s for it to take them again; fix: raise its maxmemory (redis-cli CONFIG SET maxmemory ...) or free memory "
    "on it; keep the policy noeviction, harvest's keys must not be evicted"
)


def test_harvest_run_waits_out_a_full_redis_and_finishes(tiny_model, tmp_path):
    run = start_run(tiny_model, tmp_path, "full", 24, 7)
    p, work = run.proc, run.work
    try:
        _, port = wait_until(lambda: _private_redis(p), 60, "harvest run's redis-server")
        conn = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        url = f"redis://127.0.0.1:{port}/0"
        logs = {n: work / "logs" / f"{n}.log" for n in ("worker-1", "worker-2", "collector")}

        def mid_run() -> dict | None:
            assert p.poll() is None, run.stderr()
            c = {k.decode(): int(v) for k, v in conn.hgetall(Keys("full").counts).items()}
            return c if c.get("s", 0) + c.get("d", 0) >= 2 and c.get("q", 0) > 0 and _busy(conn) else None

        at_full = wait_until(mid_run, 120, "the run half way with a job in flight", poll=0.01)
        conn.config_set("maxmemory", 1)
        try:
            wait_until(
                lambda: all(f"Redis at {url} {LINE}" in path.read_text(errors="replace") for path in logs.values()),
                60,
                "every worker and the collector waiting for writes",
            )
            assert p.poll() is None
        finally:
            conn.config_set("maxmemory", 0)
        rc, text, err = run.finish(150)
    finally:
        run.kill()
    assert rc == 0, text + err
    assert at_full["q"] > 0  # Redis filled up mid-run
    n = len(run.expected)
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in text, text + err
    assert "restarted:" not in text, text  # no child exited
    assert run.committed() == Counter({sid: 1 for sid in run.expected})
    for name, path in logs.items():
        log = path.read_text(errors="replace")
        assert log.count(f"Redis at {url} refuses writes") == 1, (name, log[-3000:])  # one line, not one a call
        assert f"Redis at {url} takes writes again after " in log, (name, log[-3000:])
        assert "Traceback" not in log and "OutOfMemoryError" not in log, (name, log[-3000:])
        assert "worker-error" not in log, (name, log[-3000:])
