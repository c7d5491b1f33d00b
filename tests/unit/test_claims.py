"""Exactly once by storage: per-sample claims (harvest.formats.claims) between collectors of two
ledgers on one output, abandoned claims taken over, conditional creates and deletes on a local
folder and on a real S3 protocol server (moto), and the ledger reconciled both ways."""

import json
import os

import pytest
import redis

from harvest.collector.collector import Collector
from harvest.formats.claims import STALE_S, Claim, claim_file
from harvest.formats.index import INDEX, index_file
from harvest.formats.shard import SHARDS
from harvest.node.spooldir import list_spooled
from harvest.ops.reconcile import reconcile
from harvest.ops.recovery import Recovery, server_id
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from harvest.state.runstore import publish_run
from harvest.storage import Location
from tests.support.synth import make_config, spool_samples

LENGTHS = [12, 7, 30, 5, 9, 14]


@pytest.fixture
def conn2(redis_server) -> redis.Redis:
    """A second ledger of the same run: another Redis database (as another runner's private Redis)."""
    c = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    c.flushdb()
    yield c
    c.flushdb()


def _node(conn, tmp_path, name, shard_bytes=1 << 30):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", shard_bytes=shard_bytes))
    spool = str(tmp_path / name)
    ids = [s.id for s in spool_samples(spool, cfg, LENGTHS)]  # the same samples on both: the same dataset
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued(ids)
    ledger.mark_spooled(ids)
    return cfg, spool, ids, ledger, Collector(conn, cfg, spool, node=name, shard_bytes=shard_bytes)


def _indexed(out: Location) -> dict[str, list[str]]:
    return {n: out.read_json(f"{INDEX}/{n}")["samples"] for n in out.list(INDEX, ".json")}


def test_a_second_ledger_marks_committed_samples_done_and_packs_nothing(conn, conn2, tmp_path):
    cfg, _, ids, ledger_a, a = _node(conn, tmp_path, "a")
    _, spool_b, _, ledger_b, b = _node(conn2, tmp_path, "b")
    out = a.out
    assert a.claimer.ledger_id != b.claimer.ledger_id
    assert a.step(force=True) == len(ids)
    assert b.step(force=True) == 0  # every claim names a's indexed shard
    assert ledger_b.states(ids) == ["d"] * len(ids) and list_spooled(spool_b) == []
    (shard,) = _indexed(out)
    assert _indexed(out) == {shard: ids}
    assert out.list(SHARDS) == [shard.replace(".json", ".safetensors")]  # b left no object behind
    claims = {s: json.loads(out.read_bytes(claim_file(s))) for s in ids}
    assert claims == {s: {"ledger": a.claimer.ledger_id, "shard": shard.removesuffix(".json")} for s in ids}


def test_samples_another_ledger_is_committing_wait_then_count_as_done(conn, conn2, tmp_path):
    _, _, ids, _, a = _node(conn, tmp_path, "a")
    _, spool_b, _, ledger_b, b = _node(conn2, tmp_path, "b")
    plan = a.plan(a.choose(force=True))
    a.record(plan)
    assert a.claim(plan)  # a has claimed, not yet packed
    assert b.step(force=True) == 0
    assert set(b._busy) == set(ids) and ledger_b.states(ids) == ["s"] * len(ids)
    assert len(list_spooled(spool_b)) == len(ids) and b.out.list(SHARDS) == []  # nothing packed, nothing voided of a's
    assert b.step(force=True) == 0  # still busy: not even chosen again
    a.publish(plan, a.pack(plan))
    a.finish(plan)
    b._busy.clear()  # BUSY_S later
    assert b.step(force=True) == 0 and ledger_b.states(ids) == ["d"] * len(ids)
    assert list(_indexed(a.out).values()) == [plan.sample_ids]


def test_a_claim_of_this_ledger_that_no_record_names_is_taken_over(conn, tmp_path, caplog):
    _, _, ids, ledger, c = _node(conn, tmp_path, "a")
    out = c.out
    stale = Claim("0" * 32, c.claimer.ledger_id).to_bytes()  # a collector died with its record lost (a rollback)
    assert out.create_exclusive(claim_file(ids[0]), stale)
    assert c.step(force=True) == len(ids)
    (shard,) = _indexed(out)
    assert json.loads(out.read_bytes(claim_file(ids[0])))["shard"] == shard.removesuffix(".json")
    assert f"sample {ids[0]}: took over its claim by shard {'0' * 32}" in caplog.text


def test_a_ledger_id_redis_lost_comes_back_with_a_record_and_one_taken_meanwhile_voids_the_shard(
    conn, tmp_path, caplog
):
    _, _, ids, ledger, c = _node(conn, tmp_path, "a")
    known = c.claimer.ledger_id
    conn.delete(ledger.keys.ledger_id)  # a Redis that lost it (a rollback past its creation)
    c.record(c.plan(c.choose(force=True)), viewed=True)
    assert conn.get(ledger.keys.ledger_id).decode() == known and c._refused == ""  # given back
    assert c.records.clear_if_same(c.packing_key, c._record_json)
    conn.set(ledger.keys.ledger_id, "f" * 16)  # lost again, and a new process took a new id first
    assert c.step(force=True) == 0  # the shard named under the old id is given up before anything is packed
    assert f"the ledger's id is {'f' * 16} now, not {known}: nothing packed" in caplog.text
    assert c.claimer.ledger_id == "f" * 16 and c.out.list(SHARDS) == [] and ledger.states(ids) == ["s"] * len(ids)
    assert c.step(force=True) == len(ids)  # chosen again, named and claimed under the id in force
    assert {json.loads(c.out.read_bytes(claim_file(s)))["ledger"] for s in ids} == {"f" * 16}


def test_a_claim_of_another_ledger_is_busy_until_stale_by_the_store_clock(conn, tmp_path):
    _, spool, ids, ledger, c = _node(conn, tmp_path, "a")
    out = c.out
    assert out.create_exclusive(claim_file(ids[0]), Claim("0" * 32, "another").to_bytes())
    assert c.step(force=True) == 0 and list(c._busy) == [ids[0]] and out.list(INDEX) == []
    assert [out.exists(claim_file(s)) for s in ids] == [True] + [False] * (len(ids) - 1)  # its own released
    c._busy.clear()
    old = os.path.getmtime(out.path(claim_file(ids[0]))) - STALE_S - 60
    os.utime(out.path(claim_file(ids[0])), (old, old))
    assert c.step(force=True) == len(ids) and ledger.states(ids) == ["d"] * len(ids)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_create_exclusive_and_delete_if(tmp_path, kind, request):
    url = f"file://{tmp_path / 'o'}" if kind == "file" else request.getfixturevalue("s3_bucket") + "/o"
    loc = Location.from_url(url)
    assert loc.create_exclusive("claims/x.json", b"one")
    assert not loc.create_exclusive("claims/x.json", b"two") and loc.read_bytes("claims/x.json") == b"one"
    assert not loc.delete_if("claims/x.json", b"two") and loc.read_bytes("claims/x.json") == b"one"
    assert loc.delete_if("claims/x.json", b"one") and not loc.exists("claims/x.json")
    assert not loc.delete_if("claims/x.json", b"one")
    assert loc.create_exclusive("claims/x.json", b"three") and loc.list("claims") == ["x.json"]


def test_reconcile_sends_samples_of_a_lost_index_back_to_the_queue_or_forgets_them(conn, tmp_path):
    cfg, _, ids, ledger, c = _node(conn, tmp_path, "a", shard_bytes=1)  # one sample a shard
    while c.step(force=True):
        pass
    out = c.out
    by_sample = {s[0]: n.removesuffix(".json") for n, s in _indexed(out).items()}
    out.delete(index_file(by_sample[ids[0]]))  # lost: its shard still holds the tokens
    out.delete(index_file(by_sample[ids[1]]))  # lost with its shard
    out.delete(f"{SHARDS}/{by_sample[ids[1]]}.safetensors")
    rep = reconcile(conn, cfg)
    assert (rep.committed, rep.marked_done, rep.requeued, rep.forgotten) == (len(ids) - 2, 0, [ids[0]], [ids[1]])
    assert ledger.states(ids[:3]) == ["q", None, "d"]
    assert ledger.counts() == {"queued": 1, "spooled": 0, "done": len(ids) - 2, "failed": 0, "total": len(ids) - 1}
    (job,) = run_queue(conn, cfg.run).get_jobs()
    _, samples = decode_batch(job.args[0])
    assert [s.id for s in samples] == [ids[0]]
    assert rep.line() == (
        "marked 0 samples done from storage; 1 done in the ledger but committed by no index went "
        "back to the queue; 1 done in the ledger whose tokens are in no shard were forgotten (run the "
        "producer again to enqueue them)"
    )
    again = reconcile(conn, cfg)
    assert (again.marked_done, again.requeued, again.forgotten) == (0, [], [])


def test_recovery_reconciles_once_per_redis_server(conn, tmp_path):
    cfg, _, ids, ledger, c = _node(conn, tmp_path, "a")
    assert c.step(force=True) == len(ids)
    rec = Recovery(conn, cfg)
    assert rec.check(force=True)  # the first look at this server: reconciled (nothing to change)
    assert conn.get(ledger.keys.ledger_epoch).decode() == server_id(conn)
    assert not rec.check(force=True) and not Recovery(conn, cfg).check(force=True)
    conn.hset(ledger.keys.state, mapping={s: "s" for s in ids})  # as an AOF cut back to before the commit
    conn.hset(ledger.keys.counts, mapping={"s": len(ids), "d": 0})
    conn.set(ledger.keys.ledger_epoch, "an-older-server")
    assert Recovery(conn, cfg).check()
    assert ledger.states(ids) == ["d"] * len(ids) and ledger.counts()["done"] == len(ids)


def test_after_a_redis_wipe_a_collector_takes_its_spool_files_up_and_commits_each_once(conn, tmp_path):
    cfg, spool, ids, ledger, c = _node(conn, tmp_path, "a")
    conn.flushdb()  # a Redis without persistence restarted: the ledger knows none of the spooled samples
    assert c.step(force=True) == 0  # taken up (harvest.collector.unknown): spooled by this spool, rows from the files
    assert ledger.states(ids) == ["s"] * len(ids) and ledger.spool_owners(ids) == [c.spool_id] * len(ids)
    assert c.step(force=True) == len(ids)
    assert sorted(s for v in _indexed(c.out).values() for s in v) == sorted(ids)  # each committed once
    assert list_spooled(spool) == []
    publish_run(conn, cfg)
    assert ledger.add_queued(ids) == []  # the producer's next run finds them done: nothing extracted twice


def test_the_orphan_sweep_puts_a_lost_index_samples_back_before_it_removes_their_shard(conn, tmp_path):
    cfg, _, ids, ledger, c = _node(conn, tmp_path, "a", shard_bytes=1)
    while c.step(force=True):
        pass
    out = c.out
    by_sample = {s[0]: n.removesuffix(".json") for n, s in _indexed(out).items()}
    out.delete(index_file(by_sample[ids[2]]))  # lost; the shard is now an orphan to the sweep
    Collector(conn, cfg, c.spool_dir, node="a", orphan_age=0.0).resume()
    assert not out.exists(f"{SHARDS}/{by_sample[ids[2]]}.safetensors")  # swept ...
    assert ledger.states(ids[2:4]) == ["q", "d"]  # ... after its sample went back to the queue
    (job,) = run_queue(conn, cfg.run).get_jobs()
    assert [s.id for s in decode_batch(job.args[0])[1]] == [ids[2]]
