"""The collector's run loop to object storage (moto's S3 server): shard N uploads on a thread
while shard N+1 is packed, and a kill during that overlap loses and doubles nothing.

The overlap is made certain, not left to timing: a subclass holds each upload until the next
shard's temp file is packed (or the spool has nothing more to pack). That is the only seam;
Redis, S3 and the files are real.
"""

import json
import multiprocessing
import os
import signal
import threading

import redis

from collector.collector import Collector
from collector.faults import CRASH_ENV
from harvest.formats.shard import shard_file
from harvest.formats.spool import list_spooled
from tests.support.crash import NODE, Trial

FORK = multiprocessing.get_context("fork")
LENGTHS = [12] * 8  # equal sizes: shards of exactly 2 samples


class Gated(Collector):
    """Each upload waits until the collector's own thread has packed the next shard ahead."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.packed_ahead = threading.Event()
        self.events: list[tuple[str, str, str | None]] = []  # (what, shard id, recorded shard id then)

    def _recorded(self) -> str | None:
        raw = self.conn.get(self.packing_key)
        return json.loads(raw)["shard_id"] if raw else None

    def pack(self, plan):
        out = super().pack(plan)
        self.events.append(("packed", plan.shard_id, self._recorded()))
        if self._recorded() not in (None, plan.shard_id):
            self.packed_ahead.set()
        return out

    def publish(self, plan, tmp, sha):
        more = len(list_spooled(self.spool_dir)) > len(plan.entries)
        if more:
            assert self.packed_ahead.wait(30), "the next shard was never packed during this upload"
        self.packed_ahead.clear()
        self.events.append(("upload", plan.shard_id, self._recorded()))
        super().publish(plan, tmp, sha)


def _trial(conn, redis_server, tmp_path, s3_bucket) -> Trial:
    t = Trial(conn, redis_server.url, tmp_path, f"{s3_bucket}/out", LENGTHS, shard_bytes=0)
    t.shard_bytes = sum(size for _, _, size in list_spooled(t.spool)[:2])  # shards of 2 samples
    return t


def _collector(t: Trial, cls=Gated) -> Collector:
    return cls(redis.Redis.from_url(t.redis_url), t.cfg, t.spool, node=NODE, shard_bytes=t.shard_bytes,
               max_wait=3600, retry_delay=0.05)


def test_next_shard_is_packed_while_the_last_uploads(conn, redis_server, tmp_path, s3_bucket):
    t = _trial(conn, redis_server, tmp_path, s3_bucket)
    c = _collector(t)
    c.run(should_stop=lambda: t.ledger.counts()["spooled"] == 0, poll=0.05)
    t.check_complete()
    shards = [sid for what, sid, _ in c.events if what == "upload"]
    assert len(shards) == 4 == len(set(shards)) and sorted(shards) == sorted(t.committed())
    # every shard after the first was packed while the one before it was recorded (uploading),
    # and was itself recorded only when it went up
    packed = [(sid, rec) for what, sid, rec in c.events if what == "packed"]
    assert packed[0] == (shards[0], shards[0])
    assert packed[1:] == [(shards[i], shards[i - 1]) for i in range(1, 4)]
    assert [(sid, rec) for what, sid, rec in c.events if what == "upload"] == [(s, s) for s in shards]


def _run_killed_while_ahead(redis_url, t: Trial) -> None:
    os.environ[CRASH_ENV] = "packed:2"  # the second pack: the shard packed ahead, unrecorded
    c = Gated(redis.Redis.from_url(redis_url), t.cfg, t.spool, node=NODE, shard_bytes=t.shard_bytes,
              max_wait=3600, retry_delay=0.05)
    c.run(should_stop=lambda: False, poll=0.05)
    os._exit(0)


def test_kill_while_packing_ahead_then_restart(conn, redis_server, tmp_path, s3_bucket):
    t = _trial(conn, redis_server, tmp_path, s3_bucket)
    first = t.order[:2]
    p = FORK.Process(target=_run_killed_while_ahead, args=(redis_server.url, t))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    t.check_invariants()
    # killed with shard 1 recorded but held before its upload, shard 2 packed ahead in its temp file
    rec = json.loads(conn.get(t.ledger.keys.packing(NODE)))
    assert rec["sample_ids"] == first
    assert not t.loc.exists(shard_file(rec["shard_id"])) and t.committed() == {}
    temps = sorted(os.listdir(os.path.join(t.spool, ".pack")))
    assert len(temps) == 2 and all(n.startswith(f".tmp-{NODE}-") for n in temps)
    assert t.ledger.states(t.order) == ["s"] * len(t.order)
    # a plain restart finishes shard 1 as recorded and packs the rest again
    c = _collector(t, cls=Collector)
    c.run(should_stop=lambda: t.ledger.counts()["spooled"] == 0, poll=0.05)
    t.check_complete()
    assert rec["shard_id"] in t.committed() and t.committed()[rec["shard_id"]] == first


def test_storage_error_on_the_upload_thread_stops_the_run_loop_with_the_record_intact(conn, redis_server, tmp_path,
                                                                                      s3_bucket, s3_endpoint):
    """A real persistent error (the bucket is deleted after start-up) raised on the upload thread
    surfaces from `run` as StorageError; the shard packed ahead is dropped, nothing is lost."""
    import boto3
    import pytest

    from harvest.storage import StorageError

    t = _trial(conn, redis_server, tmp_path, s3_bucket)
    bucket = s3_bucket.removeprefix("s3://")

    class LosesItsBucket(Collector):
        def resume(self) -> None:
            super().resume()
            s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
            for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):  # run.json
                s3.delete_object(Bucket=bucket, Key=o["Key"])
            s3.delete_bucket(Bucket=bucket)

    c = _collector(t, cls=LosesItsBucket)
    with pytest.raises(StorageError, match=rf"^upload of {bucket}/out/r/shards/[0-9a-f]{{32}}\.safetensors failed: "
                                           "FileNotFoundError: The specified bucket does not exist$"):
        c.run(should_stop=lambda: False, poll=0.05)
    rec = json.loads(conn.get(t.ledger.keys.packing(NODE)))
    assert rec["sample_ids"] == t.order[:2]
    assert t.ledger.states(t.order) == ["s"] * len(t.order)
    assert [sid for sid, _, _ in list_spooled(t.spool)] == t.order
    assert os.listdir(os.path.join(t.spool, ".pack")) == []  # neither the failed shard nor the one packed ahead
