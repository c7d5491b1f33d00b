"""kill -9 of the collector anywhere in the commit sequence, then a restart: every sample ends
in exactly one committed shard, no shard lacks its index, the ledger is exact.

The collector runs in a forked child (so no interpreter start per trial) and is killed either
by its own fault hook (HARVEST_COLLECTOR_CRASH_AT=point[:n], a real SIGKILL at a named
point) or by the test with SIGKILL after a random delay. Trials are seeded, so reproducible.
"""

import json
import os
import random
import signal
from collections import Counter

import boto3
import pytest

from harvest.collector.faults import CRASH_POINTS
from harvest.formats.claims import CLAIMS, claim_file
from harvest.formats.index import index_file
from harvest.formats.shard import SHARDS, shard_file
from harvest.node.spooldir import list_spooled, spool_identity
from tests.support.crash import NODE, Trial


def _out(kind, tmp_path, request):
    if kind == "file":
        return f"file://{tmp_path / 'out'}"
    return f"{request.getfixturevalue('s3_bucket')}/out"


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_state_after_kill_at_each_point_then_restart_finishes(conn, redis_server, tmp_path, request, kind, point):
    big = kind == "s3" and point == "uploading"  # large enough for a multipart upload (5 MiB parts)
    hidden = 2048 if big else 16
    lengths = [300, 250, 200, 50, 80] if big else [20, 15, 10, 5, 8]
    t = Trial(conn, redis_server.url, tmp_path, _out(kind, tmp_path, request), lengths, shard_bytes=0, hidden=hidden)
    t.shard_bytes = sum(size for _, _, size in list_spooled(t.spool)[:3])  # shards of 3 and 2 samples
    first = t.order[:3]
    assert t.run(crash=point, part_bytes=5 << 20) == -signal.SIGKILL
    t.check_invariants()
    states = dict(zip(t.order, t.ledger.states(t.order), strict=False))
    spooled = [s for s, _, _ in list_spooled(t.spool)]
    raw = t.conn.get(t.ledger.keys.packing(NODE))
    if point in ("marked", "unlinking"):  # the record went in the call that marked the samples done
        assert raw is None
        (sid,) = t.committed()  # the first shard's index is the only one
    else:
        rec = json.loads(raw)
        sid = rec["shard_id"]  # named afresh when recorded; the restart keeps the name
        decided = point in ("fenced", "indexed")  # the record holds the index document
        assert rec.pop("index", None) is not None if decided else "index" not in rec
        assert rec == {"shard_id": sid, "sample_ids": first, "spool": spool_identity(t.spool)}
    shard_there, index_there = t.loc.exists(shard_file(sid)), t.loc.exists(index_file(sid))
    before_upload = point in ("recorded", "claimed", "packing", "header-sent", "uploading", "packed")
    assert shard_there == (not before_upload)
    assert index_there == (point in ("indexed", "marked", "unlinking"))
    assert [states[s] for s in first] == (["d"] * 3 if point in ("marked", "unlinking") else ["s"] * 3)
    assert spooled == (t.order[1:] if point == "unlinking" else t.order)
    assert [states[s] for s in t.order[3:]] == ["s", "s"]
    if kind == "file" and point in ("packing", "header-sent", "packed", "uploading"):
        tmp = os.path.join(t.loc.path(SHARDS), f".tmp-{NODE}-{sid}.safetensors")
        assert os.path.exists(tmp) and t.loc.list(SHARDS) == []
    if kind == "s3":  # streamed into a multipart upload: invisible until completed, aborted by the restart
        bucket = t.loc.root.split("/")[0]
        s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
        uploads = [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        assert uploads == (
            [f"out/r/{shard_file(sid)}"] if point in ("packing", "header-sent", "uploading", "packed") else []
        )
        assert (s3.list_objects_v2(Bucket=bucket, Prefix="out/r/shards/").get("KeyCount", 0) == 1) == shard_there
    claimed = point not in ("recorded",)  # the samples are claimed in storage before any byte is packed
    assert [t.loc.exists(claim_file(s)) for s in first] == [claimed] * 3
    assert t.run() == 0
    t.check_complete()
    assert sid in t.committed()  # the recorded shard was finished, not repacked differently
    # The commits' stats: exact, a decided shard's counted from its record's index as the restart
    # finishes it; but a kill after the first shard's move takes its stats along, in the killed
    # collector's tally, never written (harvest.state.tally)
    tokens = {s.id: n for s, n in zip(t.samples, lengths, strict=False)}
    nbytes = {shard: json.loads(t.loc.read_bytes(index_file(shard)))["bytes"] for shard in t.committed()}
    lost = first if point in ("marked", "unlinking") else []
    assert t.ledger.stats() == {
        "samples_done": 5 - len(lost),
        "tokens_done": sum(lengths) - sum(tokens[s] for s in lost),
        "shards": 2 - bool(lost),
        "bytes_done": sum(nbytes.values()) - (nbytes[sid] if lost else 0),
    }
    # every committed sample's claim names the shard whose index commits it, and nothing else is claimed
    holder = {s: shard for shard, ids in t.committed().items() for s in ids}
    assert {s: json.loads(t.loc.read_bytes(claim_file(s)))["shard"] for s in t.order} == holder
    assert len(t.loc.list(CLAIMS, ".json")) == len(t.order)


def test_randomized_kills_then_restart(conn, redis_server, tmp_path, request):
    """20 seeded trials: random spool, shard size, backend, and 1-3 kills each (at a random
    named point and occurrence, or by the test after a random delay), then a clean restart."""
    kills = Counter()
    for trial in range(20):
        rng = random.Random(1000 + trial)
        kind = "s3" if trial % 3 == 0 else "file"
        out = (
            _out(kind, tmp_path / f"t{trial}", request) if kind == "s3" else f"file://{tmp_path / f't{trial}' / 'out'}"
        )
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(4, 12))]
        row = 4 * 16 * 2
        t = Trial(
            conn, redis_server.url, tmp_path, out, lengths, shard_bytes=rng.randint(60, 200) * row, run=f"t{trial}"
        )
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.6:
                code = t.run(crash=f"{rng.choice(CRASH_POINTS)}:{rng.randint(1, 2)}")
                kills["hook" if code else "hook point not reached"] += 1
            else:
                code = t.run(kill_after=rng.uniform(0.0, 0.15))
                kills["timed" if code else "finished before the timed kill"] += 1
            assert code in (0, -signal.SIGKILL)
            t.check_invariants()
        assert t.run() == 0
        t.check_complete()
    assert kills["hook"] > 0 and kills["timed"] + kills["hook"] >= 20, kills  # the trials did kill
