"""`harvest export` from a run on S3 (moto's server) into SpecForge and speculators files: exact
tensors, the layouts those trainers read, idempotent re-runs (also of a run that grew), and the
refusals (a layer set the trainers cannot train on, a checkpoint that is not there). That the
trainers' own code reads these files and computes the right targets is tests/system/test_trainers.py."""

import dataclasses
import json
import os
from collections import Counter

import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from harvest.cli.demo import build_tiny_model
from harvest.collector.collector import Collector
from harvest.read.reader import RunReader
from harvest.read.specforge import sample_file
from harvest.read.speculators import MANIFEST, hs_file
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.cli import harvest_cli
from tests.support.synth import HIDDEN, make_config, spool_samples


def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.stat(p).st_mtime_ns
    return out


def _commit(conn, tmp_path, cfg, lengths, seed0=0):
    samples = spool_samples(str(tmp_path / "spool"), cfg, lengths, seed0)
    Ledger(conn, cfg.run).add_queued([s.id for s in samples])
    Ledger(conn, cfg.run).mark_spooled([s.id for s in samples])  # as the worker does after writing them
    c = Collector(conn, cfg, str(tmp_path / "spool"), node="n1", shard_bytes=4000)
    while c.step(force=True):
        pass
    return {s.id: s for s in samples}


def test_export_specforge_from_s3(conn, tmp_path, s3_bucket):
    cfg = publish_run(conn, make_config(f"{s3_bucket}/out"))
    samples = _commit(conn, tmp_path, cfg, [6, 1, 20, 9, 14])
    run_url = f"{s3_bucket}/out/r"
    reader = RunReader(run_url)
    where = {sid: shard for shard in reader.shard_ids() for sid in reader.shard_samples(shard)}
    assert len(reader.shard_ids()) >= 2

    sf = tmp_path / "sf"
    res = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(sf))
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"exported 5 samples to {sf} (0 already there)\n"
    # progress as plain lines (stderr is no terminal here), no notes
    assert "export specforge: 5 samples of 5 (100%), " in res.stderr and "\r" not in res.stderr
    assert "harvest:" not in res.stderr
    for sid, s in samples.items():
        d = torch.load(sample_file(str(sf), where[sid], sid))
        hs = s.hidden_states
        assert sorted(d) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        assert torch.equal(d["input_ids"], s.input_ids.long()) and torch.equal(d["loss_mask"], s.loss_mask.long())
        assert d["hidden_state"].dtype == torch.bfloat16  # what SpecForge's TargetHead computes in
        assert d["hidden_state"].shape == (1, s.num_tokens, 16) and torch.equal(d["hidden_state"][0], hs[:, 3])
        assert d["aux_hidden_state"].shape == (1, s.num_tokens, 48)
        assert torch.equal(d["aux_hidden_state"][0], torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], -1))

    # Re-run after an interruption: complete files are kept, only the missing one is written.
    before = _files(sf)
    victim = sample_file(str(sf), where[next(iter(samples))], next(iter(samples)))
    os.unlink(victim)
    res = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(sf), "--no-progress")
    assert res.stdout == f"exported 1 samples to {sf} (4 already there)\n"
    after = _files(sf)
    rel = os.path.relpath(victim, sf)
    assert {k: v for k, v in after.items() if k != rel} == {k: v for k, v in before.items() if k != rel}
    assert rel in after and not [k for k in after if os.path.basename(k).startswith(".tmp-")]

    # Another dtype on request, with the warning that SpecForge will not read it.
    res = harvest_cli(
        "export",
        "--run-url",
        run_url,
        "--format",
        "specforge",
        str(tmp_path / "sf32"),
        "--dtype",
        "fp32",
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == (
        "harvest: warning: SpecForge reads bf16 only (its TargetHead is bf16 and casts nothing): "
        "these float32 files fail at training time\n"
    )
    sid = next(iter(samples))
    assert torch.load(sample_file(str(tmp_path / "sf32"), where[sid], sid))["hidden_state"].dtype == torch.float32


def test_export_speculators_from_s3_and_a_run_that_grew(conn, tmp_path, s3_bucket):
    model = build_tiny_model(str(tmp_path / "model16"), hidden=HIDDEN)  # the run's checkpoint: its final norm
    w = load_file(os.path.join(model, "model.safetensors"))["model.norm.weight"]
    assert not torch.allclose(w, torch.ones_like(w))
    cfg = publish_run(conn, make_config(f"{s3_bucket}/out"))
    samples = _commit(conn, tmp_path, cfg, [6, 1, 20, 9, 14])
    run_url = f"{s3_bucket}/out/r"
    sp = tmp_path / "sp"

    res = harvest_cli("export", "--run-url", run_url, "--format", "speculators", str(sp), "--no-progress")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "harvest: error: cannot read synthetic/config.json (No such file or directory): the run's "
        "checkpoint holds the final norm (pass --model with its path here)\n"
    )
    assert not sp.exists()

    res = harvest_cli(
        "export", "--run-url", run_url, "--format", "speculators", str(sp), "--model", model, "--no-progress"
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout == f"exported 5 samples to {sp} (0 already there)\n"

    def check(expected):
        rows = json.loads((sp / MANIFEST).read_text())["samples"]
        assert sorted(rows) == sorted(expected)
        ds = load_from_disk(str(sp))
        assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == len(rows)
        freq = Counter()
        for row, sid in enumerate(rows):
            s = expected[sid]
            assert torch.equal(ds[row]["input_ids"], s.input_ids.long()) and ds[row]["seq_len"] == s.num_tokens
            assert torch.equal(ds[row]["loss_mask"], s.loss_mask.long())
            d = load_file(hs_file(str(sp), row))
            assert sorted(d) == ["hidden_states", "token_ids"]
            assert torch.equal(d["token_ids"], s.input_ids.long())  # else speculators drops the sample
            hs = s.hidden_states
            assert d["hidden_states"].shape == (s.num_tokens, 4, 16) and d["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(d["hidden_states"][:, :3], hs[:, :3])
            assert torch.equal(d["hidden_states"][:, 3], (hs[:, 3].float() / w).to(torch.bfloat16))  # before the norm
            freq.update(s.input_ids[s.loss_mask.bool()].tolist())
        assert torch.load(sp / "token_freq.pt") == dict(freq)
        return rows

    rows = check(samples)
    before = _files(sp)

    # The run grows; a re-run keeps every row (and its file) and appends the new samples. The
    # trainer's vocab cache, derived from the old token counts, goes.
    (sp / "d2t-32.npy").write_bytes(b"stale")
    (sp / "t2d-32.npy").write_bytes(b"stale")
    more = _commit(conn, tmp_path, cfg, [3, 11], seed0=100)
    res = harvest_cli(
        "export", "--run-url", run_url, "--format", "speculators", str(sp), "--model", model, "--no-progress"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"exported 2 samples to {sp} (5 already there)\n"
    assert check({**samples, **more})[:5] == rows
    after = _files(sp)
    assert {k: after[k] for k in before if k.startswith("hidden_states/")} == {
        k: v for k, v in before.items() if k.startswith("hidden_states/")
    }
    assert "d2t-32.npy" not in after and "t2d-32.npy" not in after
    assert not [k for k in after if ".tmp-" in k]

    # Not an export of this run: refused, nothing touched.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    res = harvest_cli(
        "export", "--run-url", run_url, "--format", "speculators", str(other), "--model", model, "--no-progress"
    )
    assert res.returncode == 2
    assert (
        res.stderr == f"harvest: error: {other} is not empty and holds no harvest export: choose an empty or new DEST\n"
    )
    assert os.listdir(other) == ["notes.txt"]


def test_export_refuses_a_layer_set_the_trainers_cannot_train_on(conn, tmp_path):
    out = tmp_path / "out"
    cfg = publish_run(conn, dataclasses.replace(make_config(f"file://{out}"), capture_points=[2, 4, 5]))
    _commit(conn, tmp_path, cfg, [6, 9])
    for fmt, trainer in (("specforge", "SpecForge 0.2.0"), ("speculators", "speculators 0.9.0")):
        res = harvest_cli("export", "--run-url", str(out / "r"), "--format", fmt, str(tmp_path / fmt), "--no-progress")
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr == (
            f"harvest: error: run 'r' captured layers [2, 4, 5] of a 8-layer model; {trainer} trains EAGLE-3 on three "
            "aux layers and the final state (index 8): re-run with --layers eagle3, --layers <draft config.json>, "
            "or --layers a,b,c,8\n"
        )
        assert not (tmp_path / fmt).exists()


def test_export_names_the_trainer_flag_a_non_default_layer_set_needs(conn, tmp_path):
    out = tmp_path / "out"
    cfg = publish_run(conn, dataclasses.replace(make_config(f"file://{out}"), capture_points=[1, 3, 6, 8]))
    _commit(conn, tmp_path, cfg, [6])
    res = harvest_cli(
        "export", "--run-url", str(out / "r"), "--format", "specforge", str(tmp_path / "sf"), "--no-progress"
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == (
        "harvest: train a draft whose config has eagle_config.eagle_aux_hidden_state_layer_ids "
        "[0, 2, 5] (SGLang's ids of this run's aux layers [1, 3, 6]), or set "
        "model.aux_hidden_state_layer_ids [0, 2, 5]\n"
    )
    model = build_tiny_model(str(tmp_path / "model16"), hidden=HIDDEN)
    res = harvest_cli(
        "export",
        "--run-url",
        str(out / "r"),
        "--format",
        "speculators",
        str(tmp_path / "sp"),
        "--model",
        model,
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == "harvest: train with --target-layer-ids 1 3 6 (this run's aux layers; the default is 2 4 5)\n"
