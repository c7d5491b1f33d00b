"""Throughput buckets by Redis's clock: the stats of a node whose clock is 2 h off land in the
bucket of the server's TIME, through every writer (`add_stats`, a worker's `settle_job` and its
tally's flush, a collector's `mark_done`), and `harvest status` and `Ledger.rates` read them."""

from __future__ import annotations

import time

import pytest

from harvest.config import RunConfig
from harvest.ops.status import compute_status
from harvest.state.keys import RATE_BUCKET_S, Keys
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.state.spools import redis_time
from harvest.state.tally import Tally

RUN = "clk"
SHIFT_S = 7200


@pytest.fixture
def run(conn, tmp_path) -> str:
    publish_run(conn, RunConfig(run=RUN, model="m", capture_points=[1, 2], hidden_size=4, out_url=str(tmp_path)))
    return RUN


def _buckets(conn) -> dict[int, dict[str, int]]:
    prefix = Keys(RUN).rate(0)[:-1]
    return {
        int(k.decode()[len(prefix) :]): {f.decode(): int(v) for f, v in conn.hgetall(k).items()}
        for k in conn.scan_iter(match=prefix + "*")
    }


@pytest.mark.parametrize("shift", [SHIFT_S, -SHIFT_S])
def test_a_skewed_nodes_stats_land_in_the_servers_bucket_and_status_reads_them(conn, run, monkeypatch, shift):
    led = Ledger(conn, run)
    ids = [f"{i:032x}" for i in range(6)]
    led.add_queued(ids)
    before = int(redis_time(conn)) // RATE_BUCKET_S
    real = time.time
    with monkeypatch.context() as m:  # this process is the skewed node while it writes
        m.setattr(time, "time", lambda: real() + shift)
        led.add_stats(samples_spooled=2)
        led.settle_job(ids[:4], "spool-a", {}, {ids[4]: ("engine-error", "boom")})
        tally = Tally(conn, run)
        tally.add({"samples_spooled": 4})
        tally.observe("engine_seconds", 0.25)
        assert tally.flush() and not tally.flush()  # a second flush has nothing to send
        assert led.mark_done(ids[:3], tokens=[10, 20, 30], stats={"bytes_done": 1000}) == ids[:3]
        skewed = led.rates()  # a skewed reader too: the buckets are found by Redis's TIME
        skewed_status = compute_status(conn, run)  # `harvest status` on the skewed node
    after = int(redis_time(conn)) // RATE_BUCKET_S
    buckets = _buckets(conn)
    assert set(buckets) <= {before, after}, f"buckets {sorted(buckets)} not the server's {before}..{after}"
    total: dict[str, int] = {}
    for h in buckets.values():
        for f, v in h.items():
            total[f] = total.get(f, 0) + v
    assert total == {
        "samples_spooled": 6,
        "samples_failed": 1,
        "samples_done": 3,
        "tokens_done": 60,
        "bytes_done": 1000,
    }
    assert skewed[0] == total
    assert conn.hgetall(Keys(RUN).histogram("engine_seconds")) == {b"0.25": b"1", b"count": b"1", b"sum": b"0.25"}
    assert skewed_status.window_counts == total
    st = compute_status(conn, run)
    assert st.window_counts == total
    assert st.samples_per_s == pytest.approx(3 / st.window_seconds)
    assert st.tokens_per_s == pytest.approx(60 / st.window_seconds)
    assert st.eta_basis == "committed"


def test_every_bucket_expires(conn, run):
    led = Ledger(conn, run)
    led.add_stats(samples_spooled=1)
    led.mark_done([f"{1:032x}"], tokens=[5])
    for b in _buckets(conn):
        assert 0 < conn.ttl(Keys(RUN).rate(b)) <= 300
