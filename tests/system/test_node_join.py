"""`harvest node` joins a run in a shared Redis: started before the run exists, it waits for it,
extracts with its own engines (two reference engines here, `--dp 2`), and exits 0 once the
producer finished its pass and nothing is queued or spooled, with every sample committed once."""

from __future__ import annotations

from collections import Counter

from harvest.cli.redisproc import RedisServer
from harvest.state.ledger import Ledger
from tests.support.noderun import shared_run

SAMPLES = 24


def test_a_node_joining_a_shared_run_commits_every_sample_once_and_exits_0(tiny_model, tmp_path):
    server = RedisServer(str(tmp_path / "redis")).start()
    run = shared_run(tmp_path, server.url, tiny_model, "joined", SAMPLES, 5)
    try:
        node = run.node("n1", "--dp", "2", "--workers", "1", "--join-wait", "120")
        run.produce()  # the node is waiting for the run meanwhile
        rc = node.wait(300)
        said = run.said("n1")
        assert rc == 0, said + run.log("n1")
        assert "harvest node: waiting up to 120s: run joined is not in Redis at" in said, said
        assert "harvest node: run joined is done: nothing queued or spooled, its producer finished its pass" in said
        assert run.committed() == Counter({sid: 1 for sid in run.expected})
        import redis

        c = Ledger(redis.Redis.from_url(server.url), "joined").counts()
        assert (c["done"], c["queued"], c["spooled"], c["failed"]) == (SAMPLES, 0, 0, 0)
        log = run.log("n1")
        for child in ("worker-1", "worker-2", "collector", "engine-1", "engine-2"):
            assert f"{child} stopped (exit status" in log, log
        assert log.index("worker-2 stopped") < log.index("collector stopped") < log.index("engine-1 stopped")
        # A node started on a run that is done exits 0 at once, starting nothing.
        again = run.node("n2", "--join-wait", "5")
        assert again.wait(120) == 0, run.said("n2")
        assert "run joined is done" in run.said("n2")
        assert not run.work("n2").exists()
    finally:
        run.kill()
        server.stop()
