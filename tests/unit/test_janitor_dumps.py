"""Dump files the ledger proves nobody will claim are removed at once, not after 15 minutes."""

from __future__ import annotations

import os
import time

import torch

from harvest.formats.dump import Chunk, write_chunk
from harvest.ids import rid_for
from harvest.ops.janitor import clean_dump_dir
from harvest.state.ledger import Ledger


def _file(d, sid: str, attempt: int) -> str:
    return os.path.basename(write_chunk(str(d), Chunk(rid_for(sid, attempt), 0, 2, torch.arange(2), torch.zeros(2, 1, 4)), [1], "m"))


def test_done_failed_and_superseded_dumps_go_current_ones_stay(conn, tmp_path):
    ledger = Ledger(conn, "r")
    done, failed, retried, current, unknown = (f"{i:032x}" for i in range(1, 6))
    ledger.add_queued([done, failed, retried, current])
    ledger.mark_done([done])
    ledger.mark_failed({failed: ("nonfinite", "x")})
    for sid, n in ((done, 1), (failed, 1), (retried, 2), (current, 1)):
        conn.hset(ledger.keys.attempts, sid, n)  # as the jobs that took them left it
    names = {k: _file(tmp_path, sid, 1) for k, sid in
             (("done", done), ("failed", failed), ("retried", retried), ("current", current), ("unknown", unknown))}
    later = time.time() + 5  # past the 2 s grace, far from the 15 min limit
    dirs, removed = clean_dump_dir(conn, str(tmp_path), now=later, run="r")
    assert (dirs, removed) == ([], 3)
    assert sorted(os.listdir(tmp_path)) == sorted([names["current"], names["unknown"]])
    # without the run (a node-level pass), only age counts
    _file(tmp_path, done, 1)
    assert clean_dump_dir(conn, str(tmp_path), now=later) == ([], 0)
