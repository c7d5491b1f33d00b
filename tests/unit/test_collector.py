"""The collector on real Redis and a local (file://) output: packing by size and age, the
commit sequence, bad spool files, retries and the stop on persistent storage errors."""

import json
import os
import shutil

import pytest
import torch

from harvest.collector.collector import Collector
from harvest.collector.packers import Packers
from harvest.formats.index import INDEX
from harvest.formats.shard import SHARDS
from harvest.node.spooldir import list_spooled
from harvest.read.reader import RunReader
from harvest.state import scripts
from harvest.state import tally as tally_module
from harvest.state.heartbeat import CollectorBeat, read_collectors
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.storage import StorageError, retry
from tests.support.need import need
from tests.support.synth import make_config, spool_samples


def _setup(conn, tmp_path, lengths, **cfg_kw):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", **cfg_kw))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, lengths)
    ledger = Ledger(conn, cfg.run)
    ids = [s.id for s in samples]
    ledger.add_queued(ids)
    ledger.mark_spooled(ids)
    return cfg, spool, samples, ledger


def _greedy(sizes, target):
    groups, cur, total = [], [], 0
    for i, n in enumerate(sizes):
        if cur and total + n > target:
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    return groups + [cur]


def test_packs_by_target_bytes_and_commits_in_order(conn, tmp_path):
    lengths = [30, 5, 70, 12, 50, 1, 44, 9, 60, 25]
    cfg, spool, samples, ledger = _setup(conn, tmp_path, lengths)
    sizes = {sid: size for sid, _, size in list_spooled(spool)}
    order = [sid for sid, _, _ in list_spooled(spool)]  # oldest first
    target = 3 * max(sizes.values())
    c = Collector(conn, cfg, spool, node="n1", shard_bytes=target)
    while c.step(force=True):
        pass
    out = tmp_path / "out" / "r"
    indexes = [json.loads((out / INDEX / n).read_text()) for n in sorted(os.listdir(out / INDEX))]
    expected_groups = [[order[i] for i in g] for g in _greedy([sizes[s] for s in order], target)]
    assert sorted(d["samples"] for d in indexes) == sorted(expected_groups)
    assert sorted(os.listdir(out / SHARDS)) == sorted(f"{d['shard_id']}.safetensors" for d in indexes)
    for d in indexes:
        assert d["bytes"] == os.path.getsize(out / d["shard"])
    assert ledger.counts() == {"queued": 0, "spooled": 0, "done": 10, "failed": 0, "total": 10}
    assert ledger.stats() == {}  # counted in the tally, written at the node's beat (harvest.collector.packers)
    assert c.tally.flush()
    assert ledger.stats() == {
        "samples_done": 10,
        "tokens_done": sum(lengths),
        "shards": len(expected_groups),
        "bytes_done": sum(d["bytes"] for d in indexes),
    }
    assert os.listdir(spool) == [".spool-id"] and conn.get(c.packing_key) is None
    reader = RunReader(f"file://{out}")
    for s in samples:
        got = reader.get(s.id)
        assert torch.equal(got["input_ids"], s.input_ids) and torch.equal(got["loss_mask"], s.loss_mask)
        assert torch.equal(got["hidden_states"], s.hidden_states)


def test_partial_shard_waits_for_max_wait_while_work_is_queued(conn, tmp_path):
    cfg, spool, samples, ledger = _setup(conn, tmp_path, [4, 6])
    ledger.add_queued(["f" * 32])  # a sample still being extracted somewhere
    c = Collector(conn, cfg, spool, node="n1", max_wait=600)
    assert c.step() == 0 and len(list_spooled(spool)) == 2
    old = os.stat(list_spooled(spool)[0][1]).st_mtime - 601
    for _, path, _ in list_spooled(spool):
        os.utime(path, (old, old))
    assert c.step() == 2
    assert ledger.counts()["done"] == 2 and ledger.counts()["queued"] == 1


def test_a_spool_file_that_does_not_match_the_run_fails_its_sample_and_is_kept_aside(conn, tmp_path):
    cfg, spool, samples, ledger = _setup(conn, tmp_path, [4, 6, 8])
    bad = os.path.join(spool, f"{samples[1].id}.safetensors")
    shutil.copyfile(os.path.join(spool, f"{samples[0].id}.safetensors"), bad)  # another sample's file
    c = Collector(conn, cfg, spool, node="n1")
    assert c.step(force=True) == 2
    assert ledger.states([s.id for s in samples]) == ["d", "f", "d"]
    fail = ledger.failures()[samples[1].id]
    assert fail == {
        "reason": "bad-spool",
        "message": f"{bad}: holds sample {samples[0].id!r}, its name says {samples[1].id}",
    }
    assert sorted(os.listdir(spool)) == [f".bad-{samples[1].id}.safetensors", ".spool-id"]


def test_a_spool_file_without_checksums_fails_its_sample_as_bad_spool(conn, tmp_path):
    from harvest.formats.stformat import BLOCK, encode

    cfg, spool, samples, ledger = _setup(conn, tmp_path, [4, 6])
    s = samples[1]
    bad = os.path.join(spool, f"{s.id}.safetensors")
    with open(bad, "wb") as f:  # as a worker that records no crc32 writes it
        f.write(
            encode(
                {"hidden_states": s.hidden_states, "input_ids": s.input_ids, "loss_mask": s.loss_mask},
                {"sample_id": s.id, "run": cfg.run},
                BLOCK,
            )
        )
    assert Collector(conn, cfg, spool, node="n1").step(force=True) == 1
    assert ledger.states([x.id for x in samples]) == ["d", "f"]
    assert ledger.failures() == {
        s.id: {
            "reason": "bad-spool",
            "message": f"{bad}: records no crc32 of its tensors (written by a worker without them)",
        }
    }
    assert sorted(os.listdir(spool)) == [f".bad-{s.id}.safetensors", ".spool-id"]


def test_persistent_storage_error_stops_with_spool_and_record_intact(conn, tmp_path):
    cfg, spool, samples, ledger = _setup(conn, tmp_path, [3, 5])
    c = Collector(conn, cfg, spool, node="n1", retry_delay=0.01)
    shards = tmp_path / "out" / "r" / SHARDS
    os.rmdir(shards)
    shards.write_text("not a folder")  # every write below it fails with ENOTDIR
    with pytest.raises(
        StorageError, match=r"^packing .*/shards/\.tmp-n1-[0-9a-f]{32}\.safetensors failed: FileExistsError: "
    ):
        c.step(force=True)
    assert len(list_spooled(spool)) == 2
    assert ledger.counts()["spooled"] == 2
    rec = json.loads(conn.get(c.packing_key))
    assert rec["sample_ids"] == [sid for sid, _, _ in list_spooled(spool)]


def test_retry_backs_off_on_transient_errors_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert retry(flaky, "upload of x", base_delay=0.001) == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match=r"^upload of x failed after 2 attempts: TimeoutError: slow$"):
        retry(lambda: (_ for _ in ()).throw(TimeoutError("slow")), "upload of x", attempts=2, base_delay=0.001)
    with pytest.raises(StorageError, match=r"^writing y failed: PermissionError: denied$"):
        retry(lambda: (_ for _ in ()).throw(PermissionError("denied")), "writing y", base_delay=0.001)
    with pytest.raises(KeyError):  # not a storage error: passes through unchanged
        retry(lambda: {}["k"], "reading z")


def test_orphan_shards_are_swept_only_when_old_unrecorded_and_uncommitted(conn, tmp_path):
    cfg, spool, samples, ledger = _setup(conn, tmp_path, [3, 4])
    c = Collector(conn, cfg, spool, node="n1", orphan_age=3600)
    assert c.step(force=True) == 2
    shards = tmp_path / "out" / "r" / SHARDS
    committed = sorted(os.listdir(shards))
    old = os.stat(shards / committed[0]).st_mtime - 7200
    for name in ("a" * 32, "b" * 32, "c" * 32):
        (shards / f"{name}.safetensors").write_bytes(b"orphan")
    (shards / f".tmp-n2-{'d' * 32}.safetensors").write_bytes(b"a dead node's temp")
    for name in (f"{'a' * 32}.safetensors", f"{'b' * 32}.safetensors", f".tmp-n2-{'d' * 32}.safetensors", committed[0]):
        os.utime(shards / name, (old, old))  # b is old but recorded by another node's collector
    conn.set(ledger.keys.packing("n2"), json.dumps({"shard_id": "b" * 32, "sample_ids": [], "spool": "n2-spool"}))
    Collector(conn, cfg, spool, node="n1", orphan_age=3600).resume()
    assert sorted(os.listdir(shards)) == sorted(committed + [f"{'b' * 32}.safetensors", f"{'c' * 32}.safetensors"])


@pytest.mark.parametrize("output_on", ["spool's filesystem", "another filesystem"])
def test_local_shard_is_copied_by_the_kernel_only_on_the_spools_filesystem(conn, tmp_path, monkeypatch, output_on):
    """Same filesystem: copy_file_range (a clone where the filesystem can). Another one (a mounted
    output; /dev/shm here): one streamed read of each byte, the kernel never asked. Same shard."""
    if output_on == "another filesystem":
        if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
            need("/dev/shm on a filesystem of its own", "the test writes a shard to another filesystem")
        out = f"/dev/shm/harvest-test-{os.getpid()}-{os.urandom(4).hex()}"
    else:
        out = str(tmp_path / "out")
    cfg = publish_run(conn, make_config(f"file://{out}"))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [7, 40, 3])
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued([s.id for s in samples])
    ledger.mark_spooled([s.id for s in samples])
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a) or real(*a))
    try:
        assert Collector(conn, cfg, spool, node="n1").step(force=True) == 3
        assert bool(calls) is (output_on == "spool's filesystem")
        r = RunReader(f"{out}/{cfg.run}")
        for s in samples:
            got = r.get(s.id)
            assert torch.equal(got["hidden_states"].view(torch.int16), s.hidden_states.view(torch.int16))
    finally:
        if out.startswith("/dev/shm/"):
            import shutil

            shutil.rmtree(out, ignore_errors=True)


def test_a_shard_whose_samples_a_repair_excluded_is_packed_again_under_a_new_name(conn, tmp_path):
    # `reconcile --verify` excluded a corrupt copy and sent its samples back; extracted again, the
    # same set in the same order gets a name of its own (every shard recorded is named afresh), so
    # the old index, which excludes them, is neither reused nor taken for their commit.
    from harvest.formats.index import encode_index, index_file, with_excluded

    cfg, spool, samples, ledger = _setup(conn, tmp_path, [4, 6])
    ids = [s.id for s in samples]
    c = Collector(conn, cfg, spool, node="n1")
    while c.step(force=True):
        pass
    loc = c.out
    (old,) = loc.list(INDEX, ".json")
    old_id = old.removesuffix(".json")
    doc = loc.read_json(f"{INDEX}/{old}")
    loc.write_atomic(index_file(old_id), encode_index(with_excluded(doc, {sid: "corrupt: test" for sid in ids})))
    assert RunReader(loc.url()).sample_ids == []
    ledger.requeue_done(ids)
    spool_samples(spool, cfg, [4, 6])  # extracted again: the same bytes, the same order
    ledger.mark_spooled(ids)
    while c.step(force=True):
        pass
    (new,) = set(loc.list(INDEX, ".json")) - {old}
    new_id = new.removesuffix(".json")
    assert loc.read_json(index_file(old_id))["excluded"] == {sid: "corrupt: test" for sid in ids}  # left as it was
    reader = RunReader(loc.url())
    assert sorted(reader.sample_ids) == sorted(ids) and {reader.shard_of(s) for s in ids} == {new_id}
    for s in samples:
        assert torch.equal(reader.get(s.id)["hidden_states"], s.hidden_states)
    assert ledger.counts() == {"queued": 0, "spooled": 0, "done": 2, "failed": 0, "total": 2}
    assert {json.loads(loc.read_bytes(f"claims/{s}.json"))["shard"] for s in ids} == {new_id}


def test_every_shard_recorded_gets_a_name_of_its_own(conn, tmp_path):
    # The same samples in the same order, planned twice (a re-pack after a void, another collector
    # taking them over): two names, neither the samples' digest, each 32 hex digits.
    from harvest.ids import check_id, shard_id_for

    cfg, spool, _, _ = _setup(conn, tmp_path, [4, 6])
    c = Collector(conn, cfg, spool, node="n1")
    chosen = c.choose(force=True)
    a, b = c.plan(chosen), c.plan(chosen)
    assert a.sample_ids == b.sample_ids == [e.id for e in chosen] and a.header == b.header
    assert len({a.shard_id, b.shard_id, shard_id_for(a.sample_ids)}) == 3
    assert all(len(x) == 32 and int(x, 16) >= 0 and check_id(x) for x in (a.shard_id, b.shard_id))
    assert c.plan(chosen, a.shard_id).shard_id == a.shard_id  # a resumed record keeps its name


def test_spool_files_of_samples_the_ledger_forgot_are_taken_up_and_committed(conn, tmp_path):
    # A rollback forgot a job's enqueue and its worker's settle: the files are on the spool, the
    # ledger knows nothing of them (harvest.collector.unknown). One queued file stays its worker's.
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [12, 7, 30])
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued([samples[2].id])  # its worker has yet to settle it
    c = Collector(conn, cfg, spool, node="n1")
    assert c.step(force=True) == 0  # this poll takes them up; the next packs them
    assert ledger.states([s.id for s in samples]) == ["s", "s", "q"]
    assert ledger.spool_owners([samples[0].id]) == [c.spool_id]
    kept = [json.loads(r) for r in ledger.spooled_payloads([s.id for s in samples[:2]])]
    assert [r["id"] for r in kept] == [s.id for s in samples[:2]]  # rows from the files, for a reclaim
    assert c.step(force=True) == 2
    assert ledger.counts() == {"queued": 1, "spooled": 0, "done": 2, "failed": 0, "total": 3}
    assert sorted(RunReader(f"file://{tmp_path / 'out'}/{cfg.run}").sample_ids) == sorted(s.id for s in samples[:2])
    assert [sid for sid, _, _ in list_spooled(spool)] == [samples[2].id]


def test_a_shard_its_view_chose_is_recorded_asking_only_the_spools_revocation_and_the_fence_asks_each_sample(
    conn, tmp_path
):
    cfg, spool, samples, ledger = _setup(conn, tmp_path, [5, 6, 7])
    c = Collector(conn, cfg, spool, node="n1")
    chosen = c.choose(force=True)
    ids = [e.id for e in chosen]
    conn.hset(ledger.keys.state, ids[0], "s:another-spool")  # changed hands after the view (a hand edit)
    plan = c.plan(chosen)
    c.record(plan)  # as a restart resumes a record: each sample asked
    assert c._refused == f"spool {c.spool_id} does not own all of its samples (reclaimed, or lost keys)"
    c.record(plan, viewed=True)
    assert c._refused == ""  # its view found each sample its own: only a revocation since is asked
    assert c._commit(ids, entries=chosen) == 0  # packed, then refused by the commit fence, which asks each
    assert c.out.list(SHARDS) == [] and c.out.list(INDEX) == [] and len(list_spooled(spool)) == 3
    assert ledger.states(ids) == ["s"] * 3 and ledger.spool_owners(ids[:1]) == ["another-spool"]
    conn.sadd(ledger.keys.revoked_spools, c.spool_id)
    c.record(plan, viewed=True)
    assert c._refused.startswith(f"spool {c.spool_id} does not own")  # revoked since the view


def test_the_commits_stats_go_in_the_beats_round_trip_before_it_and_at_a_stop(conn, tmp_path, monkeypatch):
    """A node's packers count their commits' stats in one tally, sent in the round trip of the
    node's beat and before its write, so a beat showing the spool empty lands after the counts of
    the commits that emptied it; a stop writes the last of them (harvest.state.tally)."""
    cfg, spool, _, ledger = _setup(conn, tmp_path, [5, 7, 9])
    packers = Packers(conn, cfg, spool, node="n1")
    trips, real = [], tally_module.send_together

    def send_together(c, calls):  # each round trip the tally sends, and what is in it
        trips.append(["stats" if call.script is scripts.STATS.script else "beat" for call in calls])
        return real(c, calls)

    monkeypatch.setattr(tally_module, "send_together", send_together)
    packers.resume()
    assert packers.first.step(force=True) == 3 and ledger.stats() == {}
    (index,) = [
        json.loads((tmp_path / "out" / "r" / INDEX / n).read_text()) for n in os.listdir(tmp_path / "out" / "r" / INDEX)
    ]
    exact = {"samples_done": 3, "tokens_done": 21, "shards": 1, "bytes_done": index["bytes"]}
    assert CollectorBeat(conn, cfg.run, "n1", spool).maybe_beat(1, send=packers.beat_with_stats)
    assert trips == [["stats", "beat"]] and ledger.stats() == exact
    assert [c["spool_files"] for c in read_collectors(conn, cfg.run)[0]] == ["0"]
    conn.delete(ledger.keys.collector("n1"))
    assert CollectorBeat(conn, cfg.run, "n1", spool).maybe_beat(1, send=packers.beat_with_stats)
    assert trips[1:] == [["beat"]] and read_collectors(conn, cfg.run)[0][0]["spool_files"] == "0"  # nothing to add

    more = spool_samples(spool, cfg, [4, 6], seed0=10)
    ledger.add_queued([s.id for s in more])
    ledger.mark_spooled([s.id for s in more])
    packers.run(lambda: True)  # a stop: what is spooled committed, the last stats written
    assert ledger.stats()["samples_done"] == 5 and ledger.stats()["tokens_done"] == 31
    assert ledger.stats()["shards"] == 2 and ledger.counts()["done"] == 5


@pytest.mark.parametrize("where", ["resume", "loop"])
def test_a_collector_that_fails_writes_the_stats_of_what_it_committed(conn, tmp_path, monkeypatch, where):
    """A packer that raises after a commit (in the restart's resume, or in the loop) stops the
    collector having written that commit's stats: its record is gone, no restart counts it again."""
    cfg, spool, _, ledger = _setup(conn, tmp_path, [5, 7, 9])
    packers = Packers(conn, cfg, spool, node="n1")
    step, done = packers.first.step, []

    def commit_once_then_fail(*_, **__):
        if done:
            raise RuntimeError("disk on fire")
        done.append(step(force=True))
        return done[0]

    if where == "resume":  # the restart finishes a shard, then the next record fails
        monkeypatch.setattr(packers.first, "resume", lambda: (commit_once_then_fail(), commit_once_then_fail()))
    else:
        monkeypatch.setattr(packers.first, "step", commit_once_then_fail)
    with pytest.raises(RuntimeError, match="^disk on fire$"):
        packers.run(lambda: False)
    assert done == [3] and ledger.stats()["samples_done"] == 3 and ledger.stats()["tokens_done"] == 21
