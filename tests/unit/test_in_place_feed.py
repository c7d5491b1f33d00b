"""The in-place feeds on a synthetic run (tests/unit/test_integrity.py's, one shard per group): what
speculators' `harvest` backend and SpecForge's pointer files hand out equals the full export's files
bit for bit, a bad row is missing (named once) rather than wrong, pointers carry their tokens alone
and follow a run that grew, and what they refuse they refuse loudly. The trainers' own loaders
over a real run: tests/system/test_trainers_in_place.py."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

import harvest.read.specforge as specforge
import harvest.read.specforge_feed as feed
from harvest.read.export import _atomic
from harvest.read.final_norm import FinalNorm
from harvest.read.reader import RunReader
from harvest.read.speculators import MANIFEST, export_speculators, hs_file
from harvest.read.trainers import ExportError
from tests.support.need import need_module
from tests.support.synth import HIDDEN
from tests.unit.test_integrity import flip, make_run, pack

NORM = FinalNorm(0.5 + torch.arange(HIDDEN, dtype=torch.float32) / HIDDEN, 1e-6)


@pytest.mark.parametrize("codec", ["none", "blosc2-zstd"])
def test_speculators_rows_read_in_place_are_the_export_files(tmp_path, codec):
    need_module("hs_connectors", "hs-connectors 0.9.0", "install it with scripts/trainer_pkgs.sh")
    from harvest.read.speculators_backend import open_transfer

    _, loc, samples, _ = make_run(tmp_path, [[0, 1, 2], [3, 4, 5]], codec=codec)
    reader = RunReader(loc.root)
    full, small = str(tmp_path / "full"), str(tmp_path / "small")
    assert export_speculators(reader, full, None, NORM, _atomic, progress=False)[:2] == (6, 0)
    assert export_speculators(reader, small, None, NORM, _atomic, progress=False, in_place=True)[:2] == (6, 0)
    assert not os.path.exists(os.path.join(small, "hidden_states"))
    doc = json.load(open(os.path.join(small, MANIFEST)))
    assert doc["in_place"] is True and doc["run_url"] == loc.url() and doc["dtype"] is None
    assert doc["samples"] == json.load(open(os.path.join(full, MANIFEST)))["samples"]
    transfer = pickle.loads(pickle.dumps(open_transfer(small)))  # as speculators' spawned workers get it
    for row in range(6):
        got, want = transfer.get_cached(row), load_file(hs_file(full, row))
        assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype for k in got)
        assert all(torch.equal(got[k], want[k]) for k in got), row
    assert transfer.get_cached(6) is None and transfer.get_cached(-1) is None
    # A DEST keeps its form: no hidden-state files written into an in-place export, nor the reverse.
    with pytest.raises(ExportError, match="in place; to export it with hidden-state files"):
        export_speculators(reader, small, None, NORM, _atomic, progress=False)
    with pytest.raises(ExportError, match="with hidden-state files; to export it in place"):
        export_speculators(reader, full, None, NORM, _atomic, progress=False, in_place=True)


def test_a_corrupt_row_is_missing_for_speculators_named_once(tmp_path, caplog):
    need_module("hs_connectors", "hs-connectors 0.9.0", "install it with scripts/trainer_pkgs.sh")
    from harvest.read.speculators_backend import open_transfer

    _, loc, samples, shards = make_run(tmp_path, [[0, 1, 2], [3, 4, 5]])
    dest = str(tmp_path / "small")
    export_speculators(RunReader(loc.root), dest, None, NORM, _atomic, progress=False, in_place=True)
    rows = json.load(open(os.path.join(dest, MANIFEST)))["samples"]
    victim = samples[4].id
    flip(loc, shards[1], victim, "hidden_states")
    transfer = open_transfer(dest)
    with caplog.at_level(logging.ERROR, logger="harvest.read"):
        got = [transfer.get_cached(r) for r in range(6)] + [transfer.get_cached(rows.index(victim))]
    assert [g is None for g in got] == [sid == victim for sid in rows] + [True]
    named = [r.getMessage() for r in caplog.records if victim in r.getMessage()]
    assert len(named) == 1 and "is corrupt: tensor hidden_states" in named[0] and "reconcile --verify" in named[0]


def test_the_backend_refuses_what_it_does_not_do_and_registers_once(tmp_path):
    need_module("hs_connectors", "hs-connectors 0.9.0", "install it with scripts/trainer_pkgs.sh")
    import argparse

    from hs_connectors import HiddenStatesBackend

    from harvest.read.speculators_backend import HarvestBackend, HarvestBackendError, register

    assert register() is HarvestBackend and register() is HarvestBackend
    assert HiddenStatesBackend.registry["harvest"] is HarvestBackend
    _, loc, _, _ = make_run(tmp_path, [[0, 1]])
    dest = str(tmp_path / "small")
    export_speculators(RunReader(loc.root), dest, None, NORM, _atomic, progress=False, in_place=True)
    transfer = HarvestBackend.from_train_args(argparse.Namespace(), dest)  # no --harvest-run: the manifest's URL
    assert transfer.run_url == loc.url() and transfer.get_cached(0) is not None
    with pytest.raises(HarvestBackendError, match="generates nothing: train with --on-missing raise"):
        transfer.get_generated({"handle": "x"})
    with pytest.raises(HarvestBackendError, match="extract hidden states with `harvest run`"):
        HarvestBackend.build_kv_transfer_config(argparse.Namespace())
    with pytest.raises(HarvestBackendError, match="holds no harvest-export.json"):
        HarvestBackend.from_train_args(argparse.Namespace(harvest_run=None), str(tmp_path / "out"))


def _load(path: str):
    return torch.load(path, weights_only=False, mmap=True)  # as SpecForge's load_feature_file loads a .ckpt


def test_pointer_files_are_the_export_files_and_carry_their_tokens_alone(tmp_path):
    _, loc, samples, shards = make_run(tmp_path, [[0, 1, 2], [3, 4, 5]])
    reader = RunReader(loc.root)
    for shard in shards:
        for sid in reader.shard_samples(shard):
            full, ptr = (
                specforge.sample_file(str(tmp_path / "full"), shard, sid),
                specforge.sample_file(str(tmp_path / "ptr"), shard, sid),
            )
            for p in (full, ptr):
                os.makedirs(os.path.dirname(p), exist_ok=True)
            specforge.write_sample(reader.get(sid, torch.bfloat16), reader, full, _atomic)
            feed.write_pointer(reader, sid, torch.bfloat16, ptr, _atomic)
            want, got = _load(full), _load(ptr)
            assert isinstance(got, feed.HarvestFeatures) and sorted(got) == sorted(want)
            assert "hidden_state" in got and "nope" not in got and got.get("nope") is None
            assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), sid
            assert os.path.getsize(ptr) < os.path.getsize(full)
    with pytest.raises(pickle.UnpicklingError, match="HarvestFeatures|_restore"):  # never read wrong: refused
        torch.load(ptr, weights_only=True)

    # The tokens come from the pointer alone: with the run gone they are still there; the hidden
    # states are not, and say why.
    shutil.move(str(loc.root), str(tmp_path / "elsewhere"))
    feed._readers.clear()
    got = _load(ptr)
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
    with pytest.raises(Exception, match="run.json"):
        got["hidden_state"]  # noqa: B018


def test_a_pointer_follows_a_run_that_grew_and_refuses_a_newer_format_or_a_sample_gone(tmp_path):
    cfg, loc, samples, shards = make_run(tmp_path, [[0, 1]])
    reader = RunReader(loc.root)
    first = str(tmp_path / "a.ckpt")
    feed.write_pointer(reader, samples[0].id, torch.bfloat16, first, _atomic)
    assert _load(first)["hidden_state"].shape == (1, samples[0].num_tokens, HIDDEN)  # this process's reader opened
    later = pack(loc, cfg, str(tmp_path / "spool"), [samples[3]])  # committed after that reader was opened
    grown = RunReader(loc.root)
    second = str(tmp_path / "b.ckpt")
    feed.write_pointer(grown, samples[3].id, torch.bfloat16, second, _atomic)
    assert torch.equal(
        _load(second)["aux_hidden_state"][0],
        grown.get(samples[3].id, torch.bfloat16)["hidden_states"][:, :3].reshape(samples[3].num_tokens, -1),
    )
    assert later in grown.shard_ids()

    with pytest.raises(feed.PointerError, match="format 2 .*upgrade harvest"):
        feed._restore(feed.FORMAT + 1, loc.url(), samples[0].id, torch.zeros(1), torch.zeros(1), "bfloat16")
    gone = feed.HarvestFeatures(
        loc.url(), "0" * 32, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), "bfloat16"
    )
    with pytest.raises(feed.PointerError, match="is not committed in"):
        gone["hidden_state"]  # noqa: B018
