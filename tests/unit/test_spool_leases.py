"""Spool leases on real Redis and a local output: a lost spool's samples go back to the queue
exactly once, and a spool that comes back after that commits none of them."""

import dataclasses
import json
import os
import time

import pytest

from harvest.collector.collector import Collector
from harvest.collector.records import Voided, tend_revoked
from harvest.formats.index import INDEX, index_file
from harvest.formats.shard import SHARDS, shard_file
from harvest.node.spooldir import list_spooled, rotate_spool_identity, spool_identity
from harvest.ops.reclaim import reclaim_lost_spools, reclaim_spool
from harvest.sample import Sample
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.packing import PackingRecord, PackingRecords
from harvest.state.payload import decode_batch, payload_row
from harvest.state.runstore import publish_run
from harvest.state.spools import SpoolLeases
from harvest.storage import Location, retry
from tests.support.synth import make_config, spool_samples


def _spool(conn, cfg, tmp_path, name, lengths, seed0):
    """A spool dir with samples written and marked spooled, as a worker leaves them."""
    d = str(tmp_path / name)
    spooled = spool_samples(d, cfg, lengths, seed0=seed0)
    owner = spool_identity(d)
    ledger = Ledger(conn, cfg.run)
    ids = [s.id for s in spooled]
    ledger.add_queued(ids)
    rows = [payload_row(cfg.run, Sample.build(s.input_ids.numpy(), s.loss_mask.numpy())) for s in spooled]
    assert ledger.mark_spooled(ids, owner=owner, rows=rows) == ids
    return d, owner, ids, spooled


def _setup(conn, tmp_path, grace=0.5):
    cfg = publish_run(conn, dataclasses.replace(make_config(f"file://{tmp_path / 'out'}"), spool_grace_s=grace))
    a = _spool(conn, cfg, tmp_path, "spool-a", [12, 7, 30, 5, 9], 0)
    b = _spool(conn, cfg, tmp_path, "spool-b", [4, 16, 8], 100)
    return cfg, a, b


def _packing(conn, cfg, spool_dir):
    """A collector of `spool_dir` with its first shard recorded and packed, not yet uploaded."""
    c = Collector(conn, cfg, spool_dir, node="node-a")
    plan = c.plan(c.choose(force=True))
    c.record(plan)
    assert c.claim(plan)
    return Location.from_url(cfg.out_url).child(cfg.run), c, plan, c.pack(plan)


def _queued_jobs(conn, run) -> list[list[str]]:
    return [[s.id for s in decode_batch(job.args[0])[1]] for job in run_queue(conn, run).get_jobs()]


def test_reclaim_puts_exactly_the_silent_spools_samples_back_with_their_jobs(conn, tmp_path):
    cfg, (_, a, a_ids, a_samples), (_, b, b_ids, _) = _setup(conn, tmp_path)
    leases, ledger = SpoolLeases(conn, cfg.run), Ledger(conn, cfg.run)
    assert leases.renew(a, "node-a") and leases.renew(b, "node-b")
    time.sleep(0.6)
    assert leases.renew(b, "node-b")  # b's processes beat on; a's node went silent
    reps = reclaim_lost_spools(conn, cfg)
    assert [(r.spool, r.node, sorted(r.samples), r.lost, r.decided) for r in reps] == [
        (a, "node-a", sorted(a_ids), [], [])
    ]
    assert ledger.states(a_ids) == ["q"] * 5 and ledger.states(b_ids) == ["s"] * 3
    assert ledger.counts() == {"queued": 5, "spooled": 3, "done": 0, "failed": 0, "total": 8}
    assert ledger.spool_owners(a_ids) == [None] * 5 and ledger.spool_owners(b_ids) == [b] * 3
    assert ledger.spooled_payloads(a_ids) == [None] * 5
    assert conn.hgetall(ledger.keys.spool_counts) == {b.encode(): b"3"}
    assert sorted(i for job in _queued_jobs(conn, cfg.run) for i in job) == sorted(a_ids)
    jobs = run_queue(conn, cfg.run).get_jobs()
    got = {s.id: s for job in jobs for s in decode_batch(job.args[0])[1]}
    for s in a_samples:  # the kept rows give back the very tokens and mask
        assert got[s.id].input_ids.tolist() == s.input_ids.tolist()
        assert got[s.id].loss_mask.tolist() == s.loss_mask.tolist()
    assert ledger.stats()["spools_reclaimed"] == 1 and ledger.stats()["samples_reclaimed"] == 5
    # a second pass finds nothing more to do, and enqueues nothing
    assert [r.samples for r in reclaim_lost_spools(conn, cfg)] == []
    assert len(run_queue(conn, cfg.run).get_jobs()) == len(jobs)


def test_a_revoked_spool_owns_nothing_again(conn, tmp_path):
    cfg, (_, a, a_ids, _), _ = _setup(conn, tmp_path)
    ledger, leases = Ledger(conn, cfg.run), SpoolLeases(conn, cfg.run)
    key = ledger.keys.packing("node-a")
    conn.set(key, "recorded")
    assert ledger.fence_commit(a, a_ids[:2], key, "{}", "recorded")  # the fence passes while the spool owns them
    assert conn.get(key) == b"{}"
    conn.set(key, "another")
    assert not ledger.fence_commit(a, a_ids[:2], key, "{}", "recorded")  # not the record it wrote: refused
    assert conn.get(key) == b"another"
    conn.delete(key)
    reclaim_spool(conn, cfg, a)
    assert not leases.renew(a, "node-a")
    assert not ledger.fence_commit(a, a_ids[:2], key, "{}", "") and conn.get(key) is None
    raw, owned, _ = PackingRecords(conn, cfg.run).put_owned(key, PackingRecord("s1", a_ids[:2], a), "lid")
    assert not owned and json.loads(conn.get(key)) == json.loads(raw)  # written, and refused in the same call
    assert ledger.mark_spooled(a_ids, owner=a) == []  # still queued: the retried job spools them anew
    assert ledger.states(a_ids) == ["q"] * 5


def test_every_process_of_a_revoked_spool_takes_the_same_new_id(tmp_path):
    d = str(tmp_path / "spool")
    old = spool_identity(d)
    new = rotate_spool_identity(d, old)
    assert new != old and rotate_spool_identity(d, old) == new == spool_identity(d)
    assert rotate_spool_identity(d, "someone-elses") == new


def test_a_decided_commit_is_finished_by_another_node(conn, tmp_path):
    cfg, (a_dir, a, a_ids, _), _ = _setup(conn, tmp_path)
    c = Collector(conn, cfg, a_dir, node="node-a")
    plan = c.plan(c.choose(force=True))
    c.record(plan)
    assert c.claim(plan)
    c.publish(plan, c.pack(plan))  # fenced and indexed ...
    out = Location.from_url(cfg.out_url).child(cfg.run)
    out.delete(index_file(plan.shard_id))  # ... but the node was lost before its index landed
    rep = reclaim_spool(conn, cfg, a)
    assert sorted(rep.decided) == sorted(plan.sample_ids) and rep.samples == []
    moved = tend_revoked(conn, cfg.run, out, lambda fn, what: retry(fn, what), own_keys=frozenset({"other"}))
    assert moved == len(plan.sample_ids)
    assert out.exists(index_file(plan.shard_id)) and conn.get(c.packing_key) is None
    assert set(Ledger(conn, cfg.run).states(plan.sample_ids)) == {"d"}


def test_a_spool_back_after_its_reclaim_indexes_nothing_and_removes_its_shard(conn, tmp_path):
    cfg, (a_dir, a, a_ids, _), _ = _setup(conn, tmp_path)
    out, c, plan, packed = _packing(conn, cfg, a_dir)
    reclaim_spool(conn, cfg, a)  # the node was silent past the grace while it packed
    with pytest.raises(Voided):
        c.publish(plan, packed)
    assert out.exists(shard_file(plan.shard_id))  # uploaded before the fence refused it
    c.void(plan, "test")
    assert out.list(SHARDS) == [] and out.list(INDEX) == [] and conn.get(c.packing_key) is None
    assert c.spool_id != a and spool_identity(a_dir) == c.spool_id
    assert Ledger(conn, cfg.run).states(a_ids) == ["q"] * 5
    assert c.step(force=True) == 0  # queued samples' files wait for their new attempt


def test_a_restarted_collector_voids_the_shard_of_its_reclaimed_spool(conn, tmp_path):
    cfg, (a_dir, a, a_ids, _), _ = _setup(conn, tmp_path)
    out, c, plan, packed = _packing(conn, cfg, a_dir)
    tmp = packed.tmp
    out.put_file(
        tmp, shard_file(plan.shard_id)
    )  # uploaded (a local output renames); the collector died before its fence
    assert out.exists(shard_file(plan.shard_id)) and not os.path.exists(tmp)
    assert PackingRecord.from_json(conn.get(c.packing_key)).spool == a
    reclaim_spool(conn, cfg, a)
    Collector(conn, cfg, a_dir, node="node-a").resume()  # the node's disk is back
    assert out.list(SHARDS) == [] and out.list(INDEX) == [] and conn.get(c.packing_key) is None
    assert [sid for sid, _, _ in list_spooled(a_dir)] != []  # queued samples' files wait for their new attempt
    assert Ledger(conn, cfg.run).counts()["done"] == 0


def test_the_fence_checks_the_spool_the_record_names_not_one_set_mid_commit(conn, tmp_path):
    """With several packers, packer 0 renews the lease for all and may hand a packer a new spool id
    while it is mid-commit (harvest.collector.packers); its fence must still check the recorded spool."""
    cfg, (a_dir, a, a_ids, _), _ = _setup(conn, tmp_path)
    out, c, plan, packed = _packing(conn, cfg, a_dir)
    c.spool_id = "f" * 32  # as `Packers._share_lease` would, between record and publish
    c.publish(plan, packed)  # spool `a` still owns every sample: committed, not voided
    assert out.exists(index_file(plan.shard_id))
    assert PackingRecord.from_json(conn.get(c.packing_key)).spool == a


def test_a_tend_pass_that_read_a_record_before_its_fence_finishes_it_never_voids_it(conn, tmp_path, monkeypatch):
    """The tend pass lists the records, node a's fence passes and then its spool is revoked (a node
    back from a freeze that fenced at once, revoked before it could renew), and only then does the
    pass see the revocation: it must act on the record as it is now (decided), not as first read."""
    cfg, (a_dir, a, a_ids, _), _ = _setup(conn, tmp_path)
    out, c, plan, packed = _packing(conn, cfg, a_dir)
    out.put_file(packed.tmp, shard_file(plan.shard_id))  # visible, not yet fenced
    decided = PackingRecord(plan.shard_id, plan.sample_ids, a, index=plan.index(packed.sums)).to_json()
    listed, calls = PackingRecords.items, []

    def listed_before_the_fence(self, *args, **kw):
        records = list(listed(self, *args, **kw))
        calls.append(1)
        if len(calls) > 1:  # the reclaim's own reading
            yield from records
            return
        assert [rec.index for _, rec, _ in records] == [None]
        assert c.ledger.fence_commit(a, plan.sample_ids, c.packing_key, decided, c._record_json)
        assert reclaim_spool(conn, cfg, a).decided == sorted(plan.sample_ids)
        yield from records

    monkeypatch.setattr(PackingRecords, "items", listed_before_the_fence)
    assert tend_revoked(conn, cfg.run, out, lambda fn, what: retry(fn, what), frozenset()) == len(plan.sample_ids)
    assert out.read_json(index_file(plan.shard_id))["samples"] == plan.sample_ids
    assert out.exists(shard_file(plan.shard_id)) and conn.get(c.packing_key) is None
    assert Ledger(conn, cfg.run).states(plan.sample_ids) == ["d"] * len(plan.sample_ids)
