"""A spool file damaged on the node between its worker and the collector (a flipped byte of a
hidden state, a flipped bit of a token id, a truncation) is never committed and never stops the
collector: the shard holding it is voided before the commit fence, the file is set aside as
`.bad-<name>`, its sample goes back to the queue (or fails as `spool-damaged` once its retries are
spent), and the shard's other samples are committed, with the crc32s their workers recorded. On a
local output and on S3 (moto); the collector runs in this process, so its log lines are read as an
operator sees them, and is killed (SIGKILL, tests/support/crash.py) for the resumed cases."""

import json
import logging
import os
import signal
import zlib

import boto3
import pytest
import torch

from harvest.collector.collector import Collector
from harvest.collector.integrity import DAMAGED_RETRIES
from harvest.collector.packers import Packers
from harvest.formats.claims import claim_file
from harvest.formats.index import index_file
from harvest.formats.shard import SHARDS
from harvest.formats.stformat import read_file_header
from harvest.node.spooldir import set_aside_path, spool_identity, spool_path, write_sample
from harvest.ops.verify import verify_run
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.jobs import fetch_job, run_queue
from harvest.state.payload import decode_batch, payload_row
from tests.support.crash import NODE, Trial

LENGTHS = [20, 15, 10, 5, 8]


def _out(kind, tmp_path, request):
    if kind == "file":
        return f"file://{tmp_path / 'out'}"
    return f"{request.getfixturevalue('s3_bucket')}/out"


def _trial(conn, redis_server, tmp_path, request, kind):
    t = Trial(conn, redis_server.url, tmp_path, _out(kind, tmp_path, request), LENGTHS, shard_bytes=1 << 30, owned=True)
    return t, t.samples[1]


def _sums(t) -> dict[str, dict[str, int]]:
    """The crc32s each spool file records (its worker's), by sample."""
    return {s.id: json.loads(read_file_header(spool_path(t.spool, s.id))[1]["crc32"]) for s in t.samples}


def _damage(path: str, how: str) -> str:
    """Damage a spool file as a disk might; returns what the collector is to say of it."""
    spans, meta = read_file_header(path)
    if how == "truncated":
        span = spans["hidden_states"]
        cut = (span.begin + span.end) // 2
        os.truncate(path, cut)
        return f"{path}: {cut} bytes, its header names {max(s.end for s in spans.values())} (spool file truncated)"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    span = spans[how]
    data[(span.begin + span.end) // 2] ^= 0x40 if how == "hidden_states" else 0x01  # a hidden state's byte; a token bit
    with open(path, "wb") as f:
        f.write(data)
    recorded, found = json.loads(meta["crc32"])[how], zlib.crc32(data[span.begin : span.end])
    return f"{path}: {how} has crc32 {found} as copied, its worker recorded {recorded} (spool file damaged on the node)"


def _collect(t) -> None:
    """A collector's start and drain (`harvest collect --burst`), in this process: it must not raise."""
    p = Packers(t.conn, t.cfg, t.spool, 1, node=NODE, shard_bytes=t.shard_bytes, retry_delay=0.05)
    p.resume()
    p.drain()


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "harvest.collector" and r.levelno >= logging.ERROR]


def _check(t, victim, sums, retry: int = 1) -> None:
    """The run after the collector met `victim`'s damaged file: the others committed with their
    workers' crc32s, the victim queued again (one job), its file aside, nothing damaged readable."""
    others = [s for s in t.order if s != victim.id]
    committed = t.committed()
    assert list(committed.values()) == [others]
    assert dict(zip(t.order, t.ledger.states(t.order), strict=False)) == {
        s: "q" if s == victim.id else "d" for s in t.order
    }
    aside = set_aside_path(spool_path(t.spool, victim.id))
    assert sorted(os.listdir(t.spool)) == sorted([".spool-id", os.path.basename(aside)])
    jobs = [fetch_job(t.conn, j) for j in run_queue(t.conn, t.cfg.run).job_ids]
    assert [[s.id for s in decode_batch(j.args[0])[1]] for j in jobs] == [[victim.id]] * retry  # one job a retry
    assert t.conn.hgetall(t.ledger.keys.spool_damaged) == {victim.id.encode(): str(retry).encode()}
    # the index's crc32s are the workers'
    (shard,) = committed
    index = json.loads(t.loc.read_bytes(index_file(shard)))
    assert index["crc32"] == [[sums[s][name] for name in index["crc32_tensors"]] for s in others]
    # nothing damaged is readable, and the reader and `reconcile --verify` agree
    reader = RunReader(t.loc.url())
    assert sorted(reader.sample_ids) == sorted(others) and victim.id not in reader
    for s in t.samples:
        if s.id != victim.id:
            got = reader.get(s.id)
            assert torch.equal(got["input_ids"], s.input_ids) and torch.equal(got["hidden_states"], s.hidden_states)
    rep = verify_run(t.loc)
    assert (rep.shards, rep.samples, rep.corrupt) == (1, len(others), [])
    # no shard without its index, no upload or temporary shard left, the victim's claim released
    assert t.loc.list(SHARDS) == [f"{shard}.safetensors"]
    assert not t.loc.exists(claim_file(victim.id))
    if t.loc.is_local:
        assert [f for f in os.listdir(t.loc.path(SHARDS)) if f.startswith(".")] == []
    else:
        bucket, _, _ = t.loc.fs.split_path(t.loc.root)
        s3 = boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"], region_name="us-east-1")
        assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def _queued_line(problem: str, path: str, retry: int = 1) -> str:
    return (
        f"{problem}: its sample goes back to the queue to be extracted again (retry {retry} of {DAMAGED_RETRIES}); "
        f"the file is set aside as {set_aside_path(path)}"
    )


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("damage", ["hidden_states", "input_ids", "truncated"])
def test_a_damaged_spool_file_is_set_aside_its_sample_queued_and_the_rest_committed(
    conn, redis_server, tmp_path, request, caplog, kind, damage
):
    t, victim = _trial(conn, redis_server, tmp_path, request, kind)
    sums = _sums(t)
    path = spool_path(t.spool, victim.id)
    problem = _damage(path, damage)
    with open(path, "rb") as f:
        damaged = f.read()
    caplog.set_level(logging.INFO, "harvest.collector")
    _collect(t)
    _check(t, victim, sums)
    assert _errors(caplog) == [_queued_line(problem, path)]
    voided = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
    if damage == "truncated":  # its header says so: refused as it is chosen, before any shard is recorded
        assert voided == []
    else:  # found as it is copied: the shard of all five is voided before the fence
        assert [m.split(" given up: ")[1] for m in voided] == [problem]
    with open(set_aside_path(path), "rb") as f:  # kept as found, for a person to look at
        assert f.read() == damaged


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("damage", ["hidden_states", "truncated"])
def test_a_resumed_shard_whose_spool_file_was_damaged_is_voided_not_committed(
    conn, redis_server, tmp_path, request, caplog, kind, damage
):
    """Killed with its shard recorded and claimed; the file damaged before the restart, which
    finishes the record: the shard is voided, not committed nor re-packed on every restart."""
    t, victim = _trial(conn, redis_server, tmp_path, request, kind)
    sums = _sums(t)
    assert t.run(crash="claimed") == -signal.SIGKILL
    assert t.loc.exists(claim_file(victim.id))
    path = spool_path(t.spool, victim.id)
    problem = _damage(path, damage)
    caplog.set_level(logging.INFO, "harvest.collector")
    _collect(t)
    _check(t, victim, sums)
    assert _errors(caplog) == [_queued_line(problem, path)]
    voided = [r.getMessage().split(" given up: ")[1] for r in caplog.records if " given up: " in r.getMessage()]
    assert voided == [problem]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_spool_file_truncated_while_its_shard_is_packed(
    conn, redis_server, tmp_path, request, caplog, monkeypatch, kind
):
    """Its header was sound when chosen; the copy meets its end: the shard is voided, not the collector stopped."""
    t, victim = _trial(conn, redis_server, tmp_path, request, kind)
    sums = _sums(t)
    path = spool_path(t.spool, victim.id)
    span = read_file_header(path)[0]["hidden_states"]
    claim, cut = Collector.claim, []

    def claim_then_truncate(self, plan):
        got = claim(self, plan)
        if not cut:
            cut.append(os.truncate(path, span.begin + 3))
        return got

    monkeypatch.setattr(Collector, "claim", claim_then_truncate)
    caplog.set_level(logging.INFO, "harvest.collector")
    _collect(t)
    _check(t, victim, sums)
    assert _errors(caplog) == [_queued_line(f"{path}: ends inside tensor hidden_states (spool file truncated)", path)]


def test_a_sample_damaged_each_time_fails_once_its_retries_are_spent(conn, redis_server, tmp_path, request, caplog):
    t, victim = _trial(conn, redis_server, tmp_path, request, "file")
    sums = _sums(t)
    path = spool_path(t.spool, victim.id)
    caplog.set_level(logging.INFO, "harvest.collector")
    owner = spool_identity(t.spool)
    row = payload_row(t.cfg.run, Sample.build(victim.input_ids.numpy(), victim.loss_mask.numpy()))
    for retry in range(1, DAMAGED_RETRIES + 2):
        if retry > 1:  # extracted again: its worker spools it anew
            write_sample(t.spool, victim, t.cfg.run)
            assert t.ledger.mark_spooled([victim.id], owner, [row]) == [victim.id]
        caplog.clear()
        problem = _damage(path, "hidden_states")
        _collect(t)
        if retry <= DAMAGED_RETRIES:
            _check(t, victim, sums, retry)
            assert _errors(caplog) == [_queued_line(problem, path, retry)]
    why = f"damaged each of the {DAMAGED_RETRIES + 1} times it was extracted: check the node's disk and memory"
    aside = set_aside_path(path)
    assert _errors(caplog) == [f"{problem}: failed (spool-damaged: {why}); the file is set aside as {aside}"]
    assert t.ledger.states([victim.id]) == ["f"]
    assert t.ledger.failures() == {victim.id: {"reason": "spool-damaged", "message": f"{problem}; {why}"}}
    assert t.ledger.failed_payloads([victim.id]) == [row]  # `harvest requeue --reason spool-damaged` can put it back
    assert t.conn.hgetall(t.ledger.keys.spool_damaged) == {}
    assert sorted(os.listdir(t.spool)) == sorted([".spool-id", os.path.basename(set_aside_path(path))])
    assert victim.id not in RunReader(t.loc.url())
