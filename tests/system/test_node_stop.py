"""SIGTERM, as SLURM and Kubernetes send it at preemption, stops a `harvest node` mid-run in order
within its stop grace: workers finish or hand back their jobs, the collector commits what is
spooled, and the node exits 75 (requeue) with nothing lost. A second start of the node on the
same work dir finishes the run, every sample committed once."""

from __future__ import annotations

import signal
import time
from collections import Counter

import redis

from harvest.cli.redisproc import RedisServer
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.noderun import shared_run
from tests.support.wait import wait_for

SAMPLES = 40
SLOW = {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "1"}  # a job a second at most


def test_sigterm_mid_run_exits_75_with_nothing_lost_and_a_second_start_finishes(tiny_model, tmp_path):
    server = RedisServer(str(tmp_path / "redis")).start()
    run = shared_run(tmp_path, server.url, tiny_model, "preempted", SAMPLES, 9)
    conn = redis.Redis.from_url(server.url)
    try:
        run.produce()
        node = run.node("n1", "--stop-grace", "30", env=SLOW)

        def mid_run() -> dict | None:
            assert node.poll() is None, run.said("n1")
            c = {k.decode(): int(v) for k, v in conn.hgetall(Keys("preempted").counts).items()}
            # A node's collector packs a partial shard once nothing is queued (or after a minute): spooled
            # samples, not committed ones, are what a stop mid-run finds.
            return c if c.get("s", 0) + c.get("d", 0) >= 4 and c.get("q", 0) >= 8 else None

        wait_for(mid_run, 240, "some samples spooled, many still queued", poll=0.05)
        sent = time.monotonic()
        node.send_signal(signal.SIGTERM)
        rc = node.wait(60)
        took = time.monotonic() - sent
        said, log = run.said("n1"), run.log("n1")
        assert rc == 75, said + log
        assert took < 30 + 5, took
        assert "harvest node: stopped by a signal; the spool in" in said, said
        assert (
            log.index("stopping within 30s (a signal)")
            < log.index("stopping worker-1, worker-2")
            < log.index("stopping collector")
            < log.index("stopping engine")
        ), log
        c = Ledger(conn, "preempted").counts()
        copies = run.committed()
        assert c["spooled"] == 0 and c["failed"] == 0, c  # the collector committed what was spooled
        assert c["done"] >= 4 and c["queued"] > 0 and c["done"] + c["queued"] == SAMPLES, c  # nothing lost
        assert set(copies.values()) == {1} and len(copies) == c["done"], copies

        again = run.node("n1", "--stop-grace", "30")  # the same node, requeued
        assert again.wait(300) == 0, run.said("n1") + run.log("n1")
        assert run.committed() == Counter({sid: 1 for sid in run.expected})
    finally:
        run.kill()
        conn.close()
        server.stop()
