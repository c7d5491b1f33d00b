"""A sample spooled on two nodes is committed once: by the collector of the spool that the
ledger accepted it from (harvest.state.ledger.mark_spooled records the owner)."""

from __future__ import annotations

import os

from harvest.collector.collector import Collector
from harvest.node.spooldir import list_spooled, spool_identity
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.synth import make_config, spool_samples


def test_worker_died_before_marking_then_the_retry_spooled_elsewhere(conn, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    spool_a, spool_b = str(tmp_path / "a"), str(tmp_path / "b")
    ledger = Ledger(conn, cfg.run)
    # Node A's worker wrote X and Y and died before mark_spooled; the janitor gave the job
    # back and node B's worker spooled both and marked them. Z is A's own, fully marked.
    x, y = spool_samples(spool_a, cfg, [5, 6])
    spool_samples(spool_b, cfg, [5, 6])
    (z,) = spool_samples(spool_a, cfg, [7], seed0=10)
    ledger.add_queued([x.id, y.id, z.id])
    assert ledger.mark_spooled([x.id, y.id], owner=spool_identity(spool_b)) == [x.id, y.id]
    assert ledger.mark_spooled([z.id], owner=spool_identity(spool_a)) == [z.id]
    assert ledger.mark_spooled([x.id], owner=spool_identity(spool_a)) == []  # a late duplicate changes nothing
    assert ledger.spool_owners([x.id, y.id, z.id]) == [spool_identity(spool_b)] * 2 + [spool_identity(spool_a)]

    a = Collector(conn, cfg, spool_a, node="a", max_wait=0)
    assert a.step(force=True) == 1  # Z only; A's copies of X and Y are not its to commit
    assert list_spooled(spool_a) == []
    b = Collector(conn, cfg, spool_b, node="b", max_wait=0)
    assert b.step(force=True) == 2
    reader = RunReader(f"file://{tmp_path / 'out'}/{cfg.run}")
    assert sorted(reader.sample_ids) == sorted([x.id, y.id, z.id])
    assert ledger.counts()["done"] == 3 and ledger.spool_owners([x.id, y.id, z.id]) == [None] * 3


def test_a_file_whose_sample_is_still_queued_waits(conn, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    spool = str(tmp_path / "s")
    (x,) = spool_samples(spool, cfg, [4])
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued([x.id])
    c = Collector(conn, cfg, spool, node="n", max_wait=0)
    assert c.step(force=True) == 0 and [s for s, _, _ in list_spooled(spool)] == [x.id]
    ledger.mark_spooled([x.id], owner=spool_identity(spool))
    assert c.step(force=True) == 1


def test_spool_identity_is_shared_and_stable(tmp_path):
    d = str(tmp_path / "spool")
    first = spool_identity(d)
    assert spool_identity(d) == first and len(first) == 32
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert spool_identity(str(tmp_path / "other")) != first


def test_temp_id_file_of_a_killed_process_is_removed(tmp_path):
    import subprocess

    d = str(tmp_path / "spool")
    spool_identity(d)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone now
    (tmp_path / "spool" / f".spool-id.{dead.pid}.0a0b0c0d").write_text("0" * 32)
    (tmp_path / "spool" / f".spool-id.{os.getpid()}.0a0b0c0d").write_text("0" * 32)  # alive: kept
    spool_identity(d)
    assert sorted(os.listdir(d)) == [".spool-id", f".spool-id.{os.getpid()}.0a0b0c0d"]
