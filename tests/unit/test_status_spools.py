"""`harvest status` says what becomes of each spool, truthfully: a silent spool that holds nothing
(its node finished or stopped, as every spool of a finished `harvest run`) has nothing to reclaim;
one holding samples is reclaimed once its grace has passed, by a live worker's janitor."""

from __future__ import annotations

import dataclasses

from harvest.ops.status import compute_status, render
from harvest.state.keys import Keys
from harvest.state.runstore import publish_run
from harvest.state.spools import SpoolLeases, redis_time
from tests.support.synth import make_config


def test_each_spool_state_says_what_will_happen_to_it(conn, tmp_path):
    cfg = publish_run(conn, dataclasses.replace(make_config(str(tmp_path / "out"), run="sp"), spool_grace_s=120))
    keys, leases = Keys("sp"), SpoolLeases(conn, "sp")
    now = redis_time(conn)
    ages = {"finished": 300, "young": 30, "overdue": 200, "live": 0, "gone": 400}
    samples = {"finished": 0, "young": 4, "overdue": 2, "live": 1, "gone": 0}
    for spool, age in ages.items():
        assert leases.renew(spool, f"node-{spool}")
        conn.zadd(keys.spool_leases, {spool: now - age})
        conn.hset(keys.spool_counts, spool, samples[spool])
    conn.sadd(keys.revoked_spools, "gone")
    st = compute_status(conn, cfg.run)
    states = {s.spool: s.state for s in st.spools}
    assert states.pop("young") in ("silent (reclaimed in 1m30s)", "silent (reclaimed in 1m29s)")  # a moment later
    assert states == {
        "finished": "stopped (nothing spooled)",
        "overdue": "silent past its grace (reclaimed at the next janitor pass of a live worker)",
        "live": "alive",
        "gone": "reclaimed",
    }
    assert "    finished  node node-finished  stopped (nothing spooled), seen 5m00s ago, 0 spooled" in render(st)
    assert "reclaimed in 0s" not in render(st)
