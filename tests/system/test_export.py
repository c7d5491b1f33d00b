"""`harvest export` from a run on S3 (moto's server) into SpecForge and speculators files:
exact tensors, the layouts those trainers read, and an idempotent re-run."""

import os

import torch
from safetensors.torch import load_file

from collector.collector import Collector
from harvest.read.export import sample_file
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.cli import harvest_cli
from tests.support.synth import make_config, spool_samples


def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.stat(p).st_mtime_ns
    return out


def _committed_run(conn, tmp_path, out_url):
    cfg = publish_run(conn, make_config(out_url))
    samples = spool_samples(str(tmp_path / "spool"), cfg, [6, 1, 20, 9, 14])
    Ledger(conn, "r").add_queued([s.id for s in samples])
    Ledger(conn, "r").mark_spooled([s.id for s in samples])  # as the worker does after writing them
    c = Collector(conn, cfg, str(tmp_path / "spool"), node="n1", shard_bytes=4000)
    while c.step(force=True):
        pass
    return {s.id: s for s in samples}


def test_export_specforge_and_speculators_from_s3(conn, tmp_path, s3_bucket):
    samples = _committed_run(conn, tmp_path, f"{s3_bucket}/out")
    run_url = f"{s3_bucket}/out/r"
    reader = RunReader(run_url)
    where = {sid: shard for shard in reader.shard_ids() for sid in reader.shard_samples(shard)}
    assert len(reader.shard_ids()) >= 2

    sf = tmp_path / "sf"
    res = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(sf))
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"exported 5 samples to {sf} (0 already there)\n"
    assert "export specforge: 100%" in res.stderr  # the progress bar
    for sid, s in samples.items():
        d = torch.load(sample_file(str(sf), "specforge", where[sid], sid))
        hs = s.hidden_states
        assert sorted(d) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        assert torch.equal(d["input_ids"], s.input_ids.long()) and torch.equal(d["loss_mask"], s.loss_mask.long())
        assert d["hidden_state"].shape == (1, s.num_tokens, 16) and torch.equal(d["hidden_state"][0], hs[:, 3])
        assert d["aux_hidden_state"].shape == (1, s.num_tokens, 48)
        assert torch.equal(d["aux_hidden_state"][0], torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], -1))

    sp = tmp_path / "sp"
    res = harvest_cli("export", "--run-url", run_url, "--format", "speculators", str(sp), "--dtype", "fp32", "--no-progress")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    for sid, s in samples.items():
        d = load_file(sample_file(str(sp), "speculators", where[sid], sid))
        assert sorted(d) == ["hidden_states", "loss_mask", "token_ids"]
        assert torch.equal(d["token_ids"], s.input_ids.long()) and torch.equal(d["loss_mask"], s.loss_mask.long())
        assert d["hidden_states"].shape == (s.num_tokens, 4, 16)
        assert torch.equal(d["hidden_states"], s.hidden_states.float())

    # Re-run after an interruption: complete files are kept, only the missing one is written.
    before = _files(sf)
    victim = sample_file(str(sf), "specforge", where[next(iter(samples))], next(iter(samples)))
    os.unlink(victim)
    res = harvest_cli("export", "--run-url", run_url, "--format", "specforge", str(sf), "--no-progress")
    assert res.stdout == f"exported 1 samples to {sf} (4 already there)\n"
    after = _files(sf)
    rel = os.path.relpath(victim, sf)
    assert {k: v for k, v in after.items() if k != rel} == {k: v for k, v in before.items() if k != rel}
    assert rel in after and not [k for k in after if os.path.basename(k).startswith(".tmp-")]
