"""kill -9 of the collector anywhere in the commit sequence, then a restart: every sample ends
in exactly one committed shard, no shard lacks its index, the ledger is exact.

The collector runs in a forked child (so no interpreter start per trial) and is killed either
by its own fault hook (HARVEST_COLLECTOR_CRASH_AT=point[:n], a real SIGKILL at a named
point) or by the test with SIGKILL after a random delay. Trials are seeded, so reproducible.
"""

import json
import multiprocessing
import os
import random
import signal
from collections import Counter

import boto3
import pytest
import redis
import torch

from collector.collector import Collector
from collector.faults import CRASH_ENV, CRASH_POINTS
from harvest.formats.index import INDEX, index_file
from harvest.formats.shard import SHARDS, shard_file
from harvest.formats.spool import list_spooled
from harvest.ids import shard_id_for
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.synth import make_config, spool_samples

FORK = multiprocessing.get_context("fork")
NODE = "n1"


def _collect(redis_url, cfg, spool, crash, shard_bytes, part_bytes):
    if crash:
        os.environ[CRASH_ENV] = crash
    else:
        os.environ.pop(CRASH_ENV, None)
    c = Collector(redis.Redis.from_url(redis_url), cfg, spool, node=NODE, shard_bytes=shard_bytes,
                  part_bytes=part_bytes, retry_delay=0.05)
    c.resume()
    while c.step(force=True):
        pass
    os._exit(0)


def _run(redis_url, cfg, spool, shard_bytes, part_bytes=None, crash=None, kill_after=None) -> int:
    p = FORK.Process(target=_collect, args=(redis_url, cfg, spool, crash, shard_bytes, part_bytes))
    p.start()
    if kill_after is not None:
        p.join(kill_after)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    p.join(120)
    assert p.exitcode is not None, "collector hung"
    return p.exitcode


class Trial:
    def __init__(self, conn, redis_url, tmp_path, out_url, lengths, shard_bytes, hidden=16, run="r"):
        self.conn, self.redis_url = conn, redis_url
        self.cfg = publish_run(conn, make_config(out_url, run=run, hidden=hidden))
        self.spool = str(tmp_path / f"spool-{run}")
        self.samples = spool_samples(self.spool, self.cfg, lengths, seed0=hash(run) % 1000)
        self.order = [sid for sid, _, _ in list_spooled(self.spool)]
        self.ledger = Ledger(conn, run)
        ids = [s.id for s in self.samples]
        self.ledger.add_queued(ids)
        self.ledger.mark_spooled(ids)
        self.shard_bytes = shard_bytes
        self.loc = Location.from_url(out_url).child(run)

    def run(self, **kw) -> int:
        return _run(self.redis_url, self.cfg, self.spool, self.shard_bytes, **kw)

    def committed(self) -> dict[str, list[str]]:
        return {n.removesuffix(".json"): self.loc.read_json(f"{INDEX}/{n}")["samples"] for n in self.loc.list(INDEX, ".json")}

    def check_invariants(self) -> None:
        """True after any kill: nothing doubled, nothing lost, done only when committed."""
        committed = self.committed()
        count = Counter(s for ids in committed.values() for s in ids)
        assert all(n == 1 for n in count.values()), f"sample in two shards: {count}"
        spooled = {sid for sid, _, _ in list_spooled(self.spool)}
        states = dict(zip(self.order, self.ledger.states(self.order)))
        for sid in self.order:
            assert sid in count or sid in spooled, f"sample {sid} lost"
            assert states[sid] in ("s", "d")
            if states[sid] == "d":
                assert sid in count

    def check_complete(self) -> None:
        committed = self.committed()
        assert sorted(s for ids in committed.values() for s in ids) == sorted(self.order)
        assert self.loc.list(SHARDS) == sorted(f"{sid}.safetensors" for sid in committed)  # no shard without index
        n = len(self.order)
        assert self.ledger.counts() == {"queued": 0, "spooled": 0, "done": n, "failed": 0, "total": n}
        assert self.conn.get(self.ledger.keys.packing(NODE)) is None
        left = [os.path.relpath(os.path.join(d, f), self.spool) for d, _, fs in os.walk(self.spool) for f in fs]
        assert left == [".spool-id"]  # spool files and temporary shards (.pack/) all gone
        if self.loc.is_local:
            assert [f for f in os.listdir(self.loc.path(SHARDS)) if f.startswith(".")] == []
        else:
            bucket, _, _ = self.loc.fs.split_path(self.loc.root)
            s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
            assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        reader = RunReader(self.loc.url())
        for s in self.samples:
            got = reader.get(s.id)
            assert torch.equal(got["input_ids"], s.input_ids) and torch.equal(got["loss_mask"], s.loss_mask)
            assert torch.equal(got["hidden_states"], s.hidden_states)


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
    sid = shard_id_for(first)
    assert t.run(crash=point, part_bytes=5 << 20) == -signal.SIGKILL
    t.check_invariants()
    states = dict(zip(t.order, t.ledger.states(t.order)))
    spooled = [s for s, _, _ in list_spooled(t.spool)]
    assert json.loads(t.conn.get(t.ledger.keys.packing(NODE))) == {"shard_id": sid, "sample_ids": first}
    shard_there, index_there = t.loc.exists(shard_file(sid)), t.loc.exists(index_file(sid))
    before_upload = point in ("recorded", "packing", "packed", "uploading")
    assert shard_there == (not before_upload)
    assert index_there == (point in ("indexed", "marked", "unlinking"))
    assert [states[s] for s in first] == (["d"] * 3 if point in ("marked", "unlinking") else ["s"] * 3)
    assert spooled == (t.order[1:] if point == "unlinking" else t.order)
    assert [states[s] for s in t.order[3:]] == ["s", "s"]
    if kind == "file" and point in ("packing", "packed", "uploading"):
        tmp = os.path.join(t.loc.path(SHARDS), f".tmp-{NODE}-{sid}.safetensors")
        assert os.path.exists(tmp) and t.loc.list(SHARDS) == []
    if big:
        bucket = t.loc.root.split("/")[0]
        s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
        assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == [f"out/r/{shard_file(sid)}"]
    assert t.run() == 0
    t.check_complete()
    assert sid in t.committed()  # the recorded shard was finished, not repacked differently


def test_randomized_kills_then_restart(conn, redis_server, tmp_path, request):
    """20 seeded trials: random spool, shard size, backend, and 1-3 kills each (at a random
    named point and occurrence, or by the test after a random delay), then a clean restart."""
    kills = Counter()
    for trial in range(20):
        rng = random.Random(1000 + trial)
        kind = "s3" if trial % 3 == 0 else "file"
        out = _out(kind, tmp_path / f"t{trial}", request) if kind == "s3" else f"file://{tmp_path / f't{trial}' / 'out'}"
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(4, 12))]
        row = 4 * 16 * 2
        t = Trial(conn, redis_server.url, tmp_path, out, lengths, shard_bytes=rng.randint(60, 200) * row, run=f"t{trial}")
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
