"""Dump files nobody will claim (by the ledger and the heartbeats) are removed at once, not after 15 minutes."""

from __future__ import annotations

import os
import time

import torch

from harvest.formats.dump import Chunk, write_chunk
from harvest.ids import rid_for
from harvest.node.dumpdir import CLAIM_PREFIX, claim_dir
from harvest.ops.janitor import CONFIRM_UNNAMED_S, UnnamedDumps, clean_dump_dir
from harvest.state.heartbeat import WorkerBeat
from harvest.state.keys import worker_key
from harvest.state.ledger import Ledger


def _file(d, sid: str, attempt: int) -> str:
    return os.path.basename(
        write_chunk(str(d), Chunk(rid_for(sid, attempt), 0, 2, torch.arange(2), torch.zeros(2, 1, 4)), [1], "m")
    )


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_done_failed_and_ended_attempts_dumps_go_running_ones_stay(conn, tmp_path):
    ledger = Ledger(conn, "r")
    done, failed, ended, dead, running, unknown = (f"{i:032x}" for i in range(1, 7))
    ledger.add_queued([done, failed, ended, dead, running])
    ledger.mark_done([done])
    ledger.mark_failed({failed: ("nonfinite", "x")})
    live = WorkerBeat(conn, "r", "w-live", "node", "http://engine")
    live.start()
    os.makedirs(claim_dir(str(tmp_path), "w-live"))
    os.makedirs(claim_dir(str(tmp_path), "w-dead"))  # a worker whose heartbeat expired
    live.job_started("job-2", 1, 22)  # running attempt 22; its attempt 21 ended
    names = {
        k: _file(tmp_path, sid, n)
        for k, sid, n in (
            ("done", done, 22),
            ("failed", failed, 22),
            ("ended", ended, 21),
            ("dead", dead, 7),
            ("running", running, 22),
            ("unknown", unknown, 9),
        )
    }
    later = time.time() + 5  # past the 2 s grace, far from the 15 min limit
    clock = _Clock()
    unnamed = UnnamedDumps(clock)

    def clean(**kw):
        return clean_dump_dir(conn, str(tmp_path), now=later, run="r", unnamed=unnamed, **kw)

    # a new Redis holds reaping: a heartbeat missing proves nothing, so only the ledger's d and f count
    assert clean(keep_claim_dirs=True) == ([], 2)
    claim_dirs = [f"{CLAIM_PREFIX}w-live", f"{CLAIM_PREFIX}w-dead"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [names[k] for k in ("ended", "dead", "running", "unknown")] + claim_dirs
    )
    # a heartbeat that names no attempt (no harvest worker writes one so): its node's attempts are unknown
    conn.hset(worker_key("w-old"), "name", "w-old")
    os.makedirs(claim_dir(str(tmp_path), "w-old"))
    assert clean() == ([], 0)
    clock.t += CONFIRM_UNNAMED_S
    assert clean() == ([], 0)
    conn.delete(worker_key("w-old"))
    os.rmdir(claim_dir(str(tmp_path), "w-old"))
    # unnamed in one read proves nothing (a heartbeat rolled back names an earlier attempt until its next
    # beat); unnamed in two reads a beat apart does
    assert clean() == ([], 0)
    clock.t += CONFIRM_UNNAMED_S - 0.5
    assert clean() == ([], 0)
    clock.t += 0.5
    assert clean() == ([], 2)  # (a claim dir goes after 15 s)
    assert sorted(os.listdir(tmp_path)) == sorted([names["running"], names["unknown"], *claim_dirs])
    # a rollback takes the running attempt's name back for a while: the next beat names it again in time
    conn.hset(worker_key("w-live"), "attempt", "21")
    assert clean() == ([], 0)
    live.beat()
    clock.t += CONFIRM_UNNAMED_S
    assert clean() == ([], 0)
    clock.t += CONFIRM_UNNAMED_S
    assert clean() == ([], 0) and names["running"] in os.listdir(tmp_path)
    live.job_ended()  # the attempt ends: what the engine writes for it later is nobody's
    assert clean() == ([], 0)
    assert clean(keep_claim_dirs=True) == ([], 0)  # a new Redis holds reaping: what the reads saw is forgotten
    clock.t += CONFIRM_UNNAMED_S
    assert clean() == ([], 0)  # unnamed again, but once since the hold
    clock.t += CONFIRM_UNNAMED_S
    assert clean() == ([], 1)
    assert sorted(os.listdir(tmp_path)) == sorted([names["unknown"], *claim_dirs])
    live.stop()
    # without the run (a node-level pass), only age counts; without a memory, the ledger's d and f alone
    _file(tmp_path, done, 1)
    _file(tmp_path, ended, 1)
    assert clean_dump_dir(conn, str(tmp_path), now=later) == ([], 0)
    assert clean_dump_dir(conn, str(tmp_path), now=later, run="r") == ([], 1)
