"""The collector crash harness: a collector in a forked child, killed (SIGKILL) at a named point
or after a delay, and the invariants every kill must leave true."""

import multiprocessing
import os
import signal
from collections import Counter

import boto3
import redis
import torch

from harvest.collector.faults import CRASH_ENV
from harvest.collector.packers import Packers
from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS
from harvest.node.spooldir import list_spooled, spool_identity
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.payload import payload_row
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.synth import make_config, spool_samples

FORK = multiprocessing.get_context("fork")
NODE = "n1"


def _collect(redis_url, cfg, spool, crash, shard_bytes, part_bytes, pack_workers):
    if crash:
        os.environ[CRASH_ENV] = crash
    else:
        os.environ.pop(CRASH_ENV, None)
    c = Packers(
        redis.Redis.from_url(redis_url),
        cfg,
        spool,
        pack_workers,
        node=NODE,
        shard_bytes=shard_bytes,
        part_bytes=part_bytes,
        retry_delay=0.05,
    )
    c.resume()
    c.drain()
    os._exit(0)


def _run(redis_url, cfg, spool, shard_bytes, part_bytes=None, crash=None, kill_after=None, pack_workers=1) -> int:
    p = FORK.Process(target=_collect, args=(redis_url, cfg, spool, crash, shard_bytes, part_bytes, pack_workers))
    p.start()
    if kill_after is not None:
        p.join(kill_after)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    p.join(120)
    assert p.exitcode is not None, "collector hung"
    return p.exitcode


class Trial:
    def __init__(self, conn, redis_url, tmp_path, out_url, lengths, shard_bytes, hidden=16, run="r", owned=False):
        """`owned`: the samples spooled as a worker marks them, owned by the spool with their payload
        rows kept (so a collector can send one back to the queue); else with neither."""
        self.conn, self.redis_url = conn, redis_url
        self.cfg = publish_run(conn, make_config(out_url, run=run, hidden=hidden))
        self.spool = str(tmp_path / f"spool-{run}")
        self.samples = spool_samples(self.spool, self.cfg, lengths, seed0=hash(run) % 1000)
        self.order = [sid for sid, _, _ in list_spooled(self.spool)]
        self.ledger = Ledger(conn, run)
        ids = [s.id for s in self.samples]
        self.ledger.add_queued(ids)
        if owned:
            rows = [payload_row(run, Sample.build(s.input_ids.numpy(), s.loss_mask.numpy())) for s in self.samples]
            self.ledger.mark_spooled(ids, spool_identity(self.spool), rows)
        else:
            self.ledger.mark_spooled(ids)
        self.shard_bytes = shard_bytes
        self.loc = Location.from_url(out_url).child(run)

    def run(self, **kw) -> int:
        return _run(self.redis_url, self.cfg, self.spool, self.shard_bytes, **kw)

    def committed(self) -> dict[str, list[str]]:
        return {
            n.removesuffix(".json"): self.loc.read_json(f"{INDEX}/{n}")["samples"]
            for n in self.loc.list(INDEX, ".json")
        }

    def check_invariants(self) -> None:
        """True after any kill: nothing doubled, nothing lost, done only when committed."""
        committed = self.committed()
        count = Counter(s for ids in committed.values() for s in ids)
        assert all(n == 1 for n in count.values()), f"sample in two shards: {count}"
        spooled = {sid for sid, _, _ in list_spooled(self.spool)}
        states = dict(zip(self.order, self.ledger.states(self.order), strict=False))
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
        assert list(self.conn.scan_iter(match=self.ledger.keys.packing_pattern)) == []  # every packer's record
        left = [os.path.relpath(os.path.join(d, f), self.spool) for d, _, fs in os.walk(self.spool) for f in fs]
        assert left == [".spool-id"]  # spool files all gone, and no temporary shard ever on the node for S3
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
