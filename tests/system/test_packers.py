"""Several packers share one node's spool (harvest.collector.packers): disjoint slices of the samples,
one packing record each, and the crash rules of one collector hold for every one of them.

Real Redis, real files, real moto S3; kills are real SIGKILLs of a forked collector process
(tests/support/crash.py), at named points of the commit sequence."""

import json
import signal
from collections import Counter

import pytest

from harvest.collector.packers import Packers
from tests.support.crash import NODE, Trial

LENGTHS = [9, 14, 3, 22, 7, 11, 5, 18, 12, 6, 15, 8, 4, 10, 16, 13]


def _trial(conn, redis_server, tmp_path, out) -> Trial:
    t = Trial(conn, redis_server.url, tmp_path, out, LENGTHS, shard_bytes=0)
    t.shard_bytes = 3 * 4 * 16 * 2 * 12  # about 3 samples a shard
    return t


def _records(t: Trial) -> dict[str, dict]:
    return {k.decode(): json.loads(t.conn.get(k)) for k in t.conn.scan_iter(match=t.ledger.keys.packing_pattern)}


def test_two_packers_commit_disjoint_slices_each_sample_once(conn, redis_server, tmp_path):
    t = _trial(conn, redis_server, tmp_path, f"file://{tmp_path / 'out'}")
    p = Packers(conn, t.cfg, t.spool, 2, node=NODE, shard_bytes=t.shard_bytes)
    p.drain()
    t.check_complete()
    assert [c.shards_committed > 0 for c in p.packers] == [True, True]
    for samples in t.committed().values():  # each shard is one packer's: all its samples in one slice
        assert len({int(s[:8], 16) % 2 for s in samples}) == 1
    assert p.shards_committed == len(t.committed())


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("point", ["packing", "header-sent", "uploaded", "fenced", "marked"])
def test_kill_with_two_packers_mid_commit_then_restart_with_two_or_one(
    conn, redis_server, tmp_path, request, kind, point
):
    out = f"file://{tmp_path / 'out'}" if kind == "file" else f"{request.getfixturevalue('s3_bucket')}/out"
    t = _trial(conn, redis_server, tmp_path, out)
    assert t.run(crash=point, pack_workers=2) == -signal.SIGKILL
    t.check_invariants()
    recs = _records(t)
    least = 0 if point == "marked" else 1  # the killed packer's record went with its samples' done move
    assert least <= len(recs) <= 2 and set(recs) <= {t.ledger.keys.packing(NODE, 0), t.ledger.keys.packing(NODE, 1)}
    recorded = Counter(s for r in recs.values() for s in r["sample_ids"])
    assert all(n == 1 for n in recorded.values())  # no sample in two packers' records
    for key, rec in recs.items():  # a packer records only samples of its own slice
        packer = 0 if key == t.ledger.keys.packing(NODE) else int(key.rsplit(":", 1)[1])
        assert {int(s[:8], 16) % 2 for s in rec["sample_ids"]} == {packer}
    # a restart with fewer packers finishes the other packer's record too
    restart_with = 1 if point in ("uploaded", "marked") else 2
    assert t.run(pack_workers=restart_with) == 0
    t.check_complete()
    for rec in recs.values():  # the recorded shards were finished as recorded
        assert t.committed()[rec["shard_id"]] == rec["sample_ids"]
