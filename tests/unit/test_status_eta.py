"""The ETA: from the commit rate once samples are committed, from the spool rate before the
first commit (a partial shard waits for the collector's --max-wait), unknown when nothing moves;
`harvest status` and `harvest metrics` give the same number."""

from __future__ import annotations

import time

import pytest

from harvest.config import RunConfig
from harvest.ops.metrics import RedisCollector
from harvest.ops.status import compute_status, eta, render
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run


def test_eta_rules():
    assert eta(0, 0.0, 0.0) == (0.0, "done")
    assert eta(100, 2.0, 50.0) == (50.0, "committed")
    assert eta(100, 0.0, 4.0) == (25.0, "spooled")
    assert eta(100, 0.0, 0.0) == (None, "")


def _eta_metric(conn, run):
    fams = {f.name: f for f in RedisCollector(conn, [run]).collect()}
    return [s.value for s in fams["harvest_eta_seconds"].samples]


@pytest.fixture
def run(conn, tmp_path) -> str:
    publish_run(conn, RunConfig(run="eta1", model="m", capture_points=[1, 2], hidden_size=4, out_url=str(tmp_path)))
    conn.hset("harvest:eta1:counts", mapping={"q": 90, "s": 30})
    return "eta1"


def test_status_eta_from_the_spool_rate_before_the_first_commit(conn, run):
    now = time.time()
    st = compute_status(conn, run, now=now)
    assert (st.eta_seconds, st.eta_basis) == (None, "")
    assert "ETA      unknown (nothing spooled or committed in the last minute)" in render(st)
    assert _eta_metric(conn, run) == []

    Ledger(conn, run).add_stats(samples_spooled=30)
    st = compute_status(conn, run, now=now)
    assert st.eta_basis == "spooled" and st.eta_seconds == pytest.approx(120 / (30 / st.window_seconds))
    assert (
        "(from the spool rate: nothing committed yet; a partial shard commits once its oldest sample is "
        "the collector's --max-wait old)" in render(st)
    )
    assert _eta_metric(conn, run) == [pytest.approx(st.eta_seconds, rel=0.2)]  # its own clock, a moment later

    Ledger(conn, run).add_stats(samples_done=12)
    st = compute_status(conn, run, now=now)
    assert st.eta_basis == "committed" and st.eta_seconds == pytest.approx(120 / (12 / st.window_seconds))
    assert "from the spool rate" not in render(st)
