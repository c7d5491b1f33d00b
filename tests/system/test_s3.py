"""The output on a real S3 protocol server (moto's): whole-object uploads, range reads,
retries, the stop on a persistent error, and reconcile from the index files."""

import json
import os

import boto3
import pytest
import torch

from harvest.collector.collector import Collector
from harvest.collector.packers import Packers
from harvest.formats.index import INDEX, index_file
from harvest.formats.shard import SHARDS, shard_file
from harvest.node.spooldir import list_spooled, spool_identity
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.cli import harvest_cli
from tests.support.synth import make_config, spool_samples


def _setup(conn, tmp_path, out_url, lengths, **kw):
    cfg = publish_run(conn, make_config(out_url, **kw))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, lengths)
    ids = [s.id for s in samples]
    Ledger(conn, cfg.run).add_queued(ids)
    Ledger(conn, cfg.run).mark_spooled(ids)
    return cfg, spool, samples


def _s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def test_commit_to_s3_then_read_samples_by_byte_ranges(conn, tmp_path, s3_bucket):
    lengths = [7, 300, 1, 64, 150, 33, 90, 12]
    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", lengths, dtype="fp16")
    c = Collector(conn, cfg, spool, node="n1", shard_bytes=60_000)
    while c.step(force=True):
        pass
    loc = Location.from_url(f"{s3_bucket}/out/r")
    shards, indexes = loc.list(SHARDS), loc.list(INDEX)
    assert len(shards) >= 2 and [s.removesuffix(".safetensors") for s in shards] == [
        i.removesuffix(".json") for i in indexes
    ]
    for name in indexes:
        doc = loc.read_json(f"{INDEX}/{name}")
        assert loc.size(doc["shard"]) == doc["bytes"]
    assert Ledger(conn, "r").counts()["done"] == len(lengths) and list_spooled(spool) == []

    reader = RunReader(f"{s3_bucket}/out/r")
    fetched = []
    real_cat = reader.loc.fs.cat_file

    def spy(path, start=None, end=None, **kw):
        fetched.append((path, start, end))
        return real_cat(path, start=start, end=end, **kw)

    reader.loc.fs.cat_file = spy
    docs = [loc.read_json(f"{INDEX}/{n}") for n in indexes]
    doc = max(docs, key=lambda d: len(d["samples"]))
    assert len(doc["samples"]) >= 3
    # its smallest sample: a third of the shard's tokens at most, so the shard is not read whole for it
    # (harvest.read.coalesce.read_whole: a small shard mostly wanted is one GET)
    i = min(range(len(doc["samples"])), key=lambda j: doc["tokens"][j])
    want = next(s for s in samples if s.id == doc["samples"][i])
    got = reader.get(want.id)
    assert torch.equal(got["hidden_states"], want.hidden_states) and torch.equal(got["input_ids"], want.input_ids)
    shard_reads = [(s, e) for p, s, e in fetched if p.endswith(doc["shard"])]
    spans = reader._shard(doc["shard_id"]).tensors
    a, b = doc["offsets"][i], doc["offsets"][i + 1]
    rows = spans["hidden_states"].begin + a * 128, spans["hidden_states"].begin + b * 128
    # one header read, the small per-token tensors whole in one read (they lie side by side, after the
    # hidden states), and exactly this sample's rows: ranged GETs only
    # the header, padded to a 4 KiB block, and a little more
    assert shard_reads[0] == (0, -(-(1024 + 40 * len(doc["samples"])) // 4096) * 4096)
    small = ("input_ids", "loss_mask", "offsets")
    assert sorted(shard_reads[1:]) == sorted(
        [(min(spans[n].begin for n in small), max(spans[n].end for n in small)), rows]
    )
    fetched.clear()
    j = 0 if i else 1
    reader.get(doc["samples"][j])  # the same shard again: its rows, perhaps with its neighbours' (read ahead)
    hs = spans["hidden_states"]
    got_ranges = [(s, e) for p, s, e in fetched]
    assert got_ranges and all(hs.begin <= s < e <= hs.end for s, e in got_ranges), got_ranges  # rows only
    lo, hi = hs.begin + doc["offsets"][j] * 128, hs.begin + doc["offsets"][j + 1] * 128
    assert any(s <= lo and hi <= e for s, e in got_ranges), got_ranges
    for s in samples:  # every sample, exact, in the stored dtype and upcast on request
        got = reader.get(s.id)
        assert got["hidden_states"].dtype == torch.float16 and torch.equal(got["hidden_states"], s.hidden_states)
        assert torch.equal(reader.get(s.id, torch.float32)["hidden_states"], s.hidden_states.float())


def test_upload_failing_midway_leaves_no_object_and_no_pending_parts(tmp_path, s3_bucket, s3_endpoint):
    """harvest.multipart against moto: part 2 of 3 is refused for good (injected in front of the
    real server); the upload is aborted, nothing is visible, no part is left billed."""
    from harvest.multipart import MultipartWriter
    from harvest.storage import StorageError

    body = os.urandom(12 << 20)
    loc = Location.from_url(f"{s3_bucket}/out")
    real_call = loc.fs.call_s3

    def refuse_part_2(method, *a, **kw):
        if method == "upload_part" and kw["PartNumber"] == 2:
            raise PermissionError("access denied for part 2")
        return real_call(method, *a, **kw)

    loc.fs.call_s3 = refuse_part_2
    try:
        w = MultipartWriter(loc, "shards/x.safetensors", "upload of x", part_bytes=5 << 20, retry_delay=0.01)
        with pytest.raises(StorageError, match="^upload of x failed: PermissionError: access denied for part 2$"):
            w.write(memoryview(body)[: 6 << 20])
            w.write(memoryview(body)[6 << 20 :])
            w.finish()
    finally:
        del loc.fs.call_s3
    bucket = s3_bucket.removeprefix("s3://")
    assert _s3(s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert _s3(s3_endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    # and the same bytes without the failure: invisible until completed, then whole
    stored = []
    w = MultipartWriter(loc, "shards/x.safetensors", "upload of x", part_bytes=5 << 20, on_part=stored.append)
    w.write(body)
    upload = w.finish()
    assert sorted(stored) == [1, 2, 3] and not loc.exists("shards/x.safetensors")
    upload.complete("completing x")
    assert loc.read_bytes("shards/x.safetensors") == body


def test_unfinished_multipart_upload_of_a_killed_collector_is_aborted_on_resume(conn, tmp_path, s3_bucket, s3_endpoint):
    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", [3, 4])
    c = Collector(conn, cfg, spool, node="n1")
    ids = [sid for sid, _, _ in list_spooled(spool)]
    from harvest.ids import new_shard_id

    sid = new_shard_id()  # the name its record holds
    bucket = s3_bucket.removeprefix("s3://")
    key = f"out/r/{shard_file(sid)}"
    _s3(s3_endpoint).create_multipart_upload(Bucket=bucket, Key=key)  # what a SIGKILL mid-upload leaves
    conn.set(c.packing_key, json.dumps({"shard_id": sid, "sample_ids": ids, "spool": c.spool_id}))
    c.resume()
    assert _s3(s3_endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert Location.from_url(f"{s3_bucket}/out/r").read_json(index_file(sid))["samples"] == ids


def test_transient_upload_errors_are_retried(conn, tmp_path, s3_bucket):
    """Two connection resets while a part is sent (injected in front of the real moto server):
    the part is sent again and the shard commits once."""
    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", [5, 6])
    c = Collector(conn, cfg, spool, node="n1", retry_delay=0.01)
    real_call, calls = c.out.fs.call_s3, []

    def flaky_call(method, *a, **kw):
        if method == "upload_part":
            calls.append(kw["PartNumber"])
            if len(calls) <= 2:
                raise ConnectionResetError("connection reset by peer")
        return real_call(method, *a, **kw)

    c.out.fs.call_s3 = flaky_call
    try:
        assert c.step(force=True) == 2
    finally:
        del c.out.fs.call_s3
    assert calls == [1, 1, 1] and Ledger(conn, "r").counts()["done"] == 2
    reader = RunReader(c.out.url())
    assert all(torch.equal(reader.get(s.id)["hidden_states"], s.hidden_states) for s in samples)


def test_collect_cli_stops_on_missing_bucket_then_finishes_the_recorded_shard(
    conn, redis_server, tmp_path, s3_bucket, s3_endpoint
):
    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", [3, 5, 8])
    bucket = s3_bucket.removeprefix("s3://")
    s3 = _s3(s3_endpoint)
    s3.delete_object(Bucket=bucket, Key="out/r/run.json")
    s3.delete_bucket(Bucket=bucket)
    args = [
        "collect",
        "--run",
        "r",
        "--redis",
        redis_server.url,
        "--spool-dir",
        spool,
        "--burst",
        "--node",
        "n1",
        "--pack-workers",
        "1",
        "--s3-endpoint",
        s3_endpoint,
    ]
    res = harvest_cli(*args, env={"HARVEST_S3_ENDPOINT": "http://127.0.0.1:1"})  # the flag wins over the environment
    ids = [sid for sid, _, _ in list_spooled(spool)]
    from harvest.state.ledger import Ledger

    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines()[-1].startswith(  # after the collector's start line
        # the samples are claimed in storage before the shard is packed: the first claim finds no bucket
        f"harvest: error: collector stopped: claiming {bucket}/out/r/claims/{ids[0]}.json failed: FileNotFoundError: "
    ), res.stderr
    assert res.stderr.rstrip().endswith(
        f"The spool in {spool} is intact and the shard in progress is recorded in Redis; "
        "fix the storage and start the collector again (`harvest collect`, or the same `harvest run`) to finish it."
    )
    assert len(list_spooled(spool)) == 3 and Ledger(conn, "r").counts()["spooled"] == 3
    rec = json.loads(conn.get(Ledger(conn, "r").keys.packing("n1")))
    sid = rec["shard_id"]  # a fresh name, which the restart keeps
    assert rec == {"shard_id": sid, "sample_ids": ids, "spool": spool_identity(spool)}

    s3.create_bucket(Bucket=bucket)
    res = harvest_cli(*args)
    assert res.returncode == 0, res.stderr
    assert Location.from_url(f"{s3_bucket}/out/r").read_json(index_file(sid))["samples"] == ids
    assert Ledger(conn, "r").counts()["done"] == 3 and list_spooled(spool) == []


def test_reconcile_rebuilds_the_done_set_from_s3_index_files(conn, redis_server, tmp_path, s3_bucket):
    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", [4, 9, 2, 7], shard_bytes=1)
    c = Collector(conn, cfg, spool, node="n1")
    while c.step(force=True):
        pass
    loc = Location.from_url(f"{s3_bucket}/out/r")
    loc.write_atomic(f"{SHARDS}/{'e' * 32}.safetensors", b"uncommitted: no index file")
    conn.flushall()  # Redis lost
    res = harvest_cli("reconcile", "--run", "r", "--redis", redis_server.url)
    assert res.returncode == 2 and "run 'r' is not in Redis" in res.stderr
    res = harvest_cli("reconcile", "--run", "r", "--redis", redis_server.url, "--out", f"{s3_bucket}/out")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "marked 4 samples done from storage\n"
    ledger = Ledger(conn, "r")
    assert ledger.counts() == {"queued": 0, "spooled": 0, "done": 4, "failed": 0, "total": 4}
    assert ledger.states([s.id for s in samples]) == ["d"] * 4
    res = harvest_cli("reconcile", "--run", "r", "--redis", redis_server.url)
    assert res.returncode == 0 and res.stdout == "marked 0 samples done from storage\n"


def test_harvest_run_writes_fp8_to_s3_and_the_dataset_reads_it(tmp_path, tiny_model, s3_bucket, s3_endpoint):
    from harvest.cli.demo import demo_rows, write_jsonl
    from harvest.read.dataset import HiddenStateDataset

    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(8))
    out = f"{s3_bucket}/out"
    res = harvest_cli(
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        out,
        "--run",
        "s3run",
        "--dtype",
        "fp8_e4m3",
        "--no-progress",
        "--work-dir",
        str(tmp_path / "work"),
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--s3-endpoint",
        s3_endpoint,
        env={"HARVEST_S3_ENDPOINT": ""},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    reader = RunReader(f"{out}/s3run")
    assert reader.config.storage_dtype == "fp8_e4m3" and len(reader) >= 6
    sid = reader.sample_ids[0]
    raw = reader.get(sid)
    assert (
        raw["hidden_states"].dtype == torch.float8_e4m3fn
        and raw["hidden_scale"].shape == raw["hidden_states"].shape[:2]
    )
    item = HiddenStateDataset(f"{out}/s3run")[0]
    t = raw["input_ids"].shape[0]
    assert item["hidden_state"].shape == (t, 64) and item["aux_hidden_state"].shape == (t, 3 * 64)
    assert item["hidden_state"].dtype == torch.bfloat16


def test_bucket_lost_mid_run_stops_the_run_loop_with_spool_and_record_intact(conn, tmp_path, s3_bucket, s3_endpoint):
    """A real persistent error (the bucket is deleted after start-up) stops `run` with a
    StorageError naming the first storage write of the shard (its first sample's claim); nothing was written to the node's disk but the spool."""
    from harvest.storage import StorageError

    cfg, spool, samples = _setup(conn, tmp_path, f"{s3_bucket}/out", [12, 12, 12, 12])
    bucket = s3_bucket.removeprefix("s3://")

    class LosesItsBucket(Collector):
        def resume(self) -> None:
            super().resume()
            s3 = _s3(s3_endpoint)
            for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []):  # run.json
                s3.delete_object(Bucket=bucket, Key=o["Key"])
            s3.delete_bucket(Bucket=bucket)

    packers = Packers(conn, cfg, spool, 1, node="n1", max_wait=0, retry_delay=0.01)
    packers.first = packers.packers[0] = LosesItsBucket(conn, cfg, spool, node="n1", max_wait=0, retry_delay=0.01)
    order = [sid for sid, _, _ in list_spooled(spool)]
    # the shard's samples are claimed in storage before it is packed: the first claim meets the lost bucket
    with pytest.raises(
        StorageError,
        match=rf"^claiming {bucket}/out/r/claims/{order[0]}\.json failed: "
        "FileNotFoundError: The specified bucket does not exist$",
    ):
        packers.run(should_stop=lambda: False, poll=0.05)
    rec = json.loads(conn.get(Ledger(conn, "r").keys.packing("n1")))
    assert rec["sample_ids"] == order
    assert Ledger(conn, "r").states(order) == ["s"] * 4
    assert [sid for sid, _, _ in list_spooled(spool)] == order
    assert sorted(os.listdir(spool)) == [".spool-id"] + [f"{sid}.safetensors" for sid in sorted(order)]
