"""`harvest export` (the real CLI, in a subprocess) over a run whose storage went bad: a flipped byte
fails that one sample, every other sample is exported, the sample and its shard are named and the
export exits 1; a sample committed by two shards is exported once. And on S3 (moto's server), the
reader names the object's URL and the fix with the output's URL."""

from __future__ import annotations

import os
import re

import pytest
import torch

from harvest.cli.demo import build_tiny_model
from harvest.formats.index import index_file
from harvest.formats.runfile import RUN_FILE
from harvest.formats.shard import shard_file
from harvest.ops.verify import verify_run
from harvest.read.reader import RunReader
from harvest.read.shard_reader import CorruptSample
from harvest.read.specforge import sample_file
from harvest.read.speculators import MANIFEST, TOKEN_FREQ, hs_file
from harvest.storage import Location
from tests.support.cli import harvest_cli
from tests.support.synth import HIDDEN, make_config, spool_samples
from tests.unit.test_integrity import flip, make_run, pack


def _export(run_url: str, fmt: str, dest, *extra: str):
    return harvest_cli("export", "--run-url", run_url, "--format", fmt, str(dest), "--no-progress", *extra)


def _error_lines(
    loc: Location, shard_id: str, sample_id: str, tensor: str, begin: int, end: int, expected: int, found: int
) -> str:
    return (
        f"harvest: not exported: sample {sample_id} of shard {shard_id} is corrupt (tensor {tensor}, bytes "
        f"[{begin}, {end}) of {loc.path(shard_file(shard_id))} have crc32 {found}, its index records {expected})\n"
        f"harvest: error: 1 corrupt sample not exported; run `harvest reconcile --verify --run r --out "
        f"{os.path.dirname(loc.root)}` to drop it from the index and extract it again, then export again\n"
    )


@pytest.mark.parametrize("tensor", ["hidden_states", "input_ids"])
def test_specforge_export_exports_every_other_sample_and_names_the_corrupt_one(tmp_path, tensor):
    _, loc, samples, (a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]])
    victim = samples[1]
    begin, end, expected, found = flip(loc, a, victim.id, tensor)
    sf = tmp_path / "sf"
    res = _export(loc.root, "specforge", sf)
    assert res.returncode == 1
    assert res.stdout == f"exported 4 samples to {sf} (0 already there)\n"
    assert res.stderr == _error_lines(loc, a, victim.id, tensor, begin, end, expected, found)
    where = {s.id: (a if n < 3 else b) for n, s in enumerate(samples[:5])}
    for s in samples[:5]:
        path = sample_file(str(sf), where[s.id], s.id)
        assert os.path.exists(path) == (s is not victim)
        if s is not victim:
            assert torch.equal(torch.load(path)["input_ids"], s.input_ids.long())

    # `harvest reconcile --verify` drops it from the index (reconcile then re-extracts it): the export is clean.
    assert [c.sample_id for c in verify_run(loc, exclude=True).corrupt] == [victim.id]
    res = _export(loc.root, "specforge", sf)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout == f"exported 0 samples to {sf} (4 already there)\n"


def test_an_export_names_each_sample_of_a_shard_that_is_gone(tmp_path):
    _, loc, samples, (_a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]])
    os.unlink(loc.path(shard_file(b)))
    sf = tmp_path / "sf"
    res = _export(loc.root, "specforge", sf)
    assert res.returncode == 1 and res.stdout == f"exported 3 samples to {sf} (0 already there)\n"
    assert res.stderr == "".join(
        f"harvest: not exported: sample {s.id} of shard {b} is corrupt (its shard cannot be read: the file "
        f"{loc.path(shard_file(b))} is missing)\n"
        for s in samples[3:5]
    ) + (
        f"harvest: error: 2 corrupt samples not exported; run `harvest reconcile --verify --run r --out "
        f"{os.path.dirname(loc.root)}` to drop them from the index and extract them again, then export again\n"
    )


def test_speculators_export_writes_every_other_row_and_leaves_the_dataset_unwritten(tmp_path):
    """speculators' dataset lists every row and the trainer reads hs_{row} for each: with a row
    that has no file it is not written (nor token_freq.pt), every other row's file is."""
    model = build_tiny_model(str(tmp_path / "model16"), hidden=HIDDEN)
    _, loc, samples, (_a, b) = make_run(tmp_path, [[0, 1, 2], [3, 4]])
    victim = samples[3]
    begin, end, expected, found = flip(loc, b, victim.id, "hidden_states")
    sp = tmp_path / "sp"
    res = _export(loc.root, "speculators", sp, "--model", model)
    assert res.returncode == 1
    assert res.stdout == f"exported 4 samples to {sp} (0 already there)\n"
    assert res.stderr == _error_lines(loc, b, victim.id, "hidden_states", begin, end, expected, found)
    import json

    rows = json.loads((sp / MANIFEST).read_text())["samples"]
    assert sorted(rows) == sorted(s.id for s in samples[:5])
    assert [os.path.exists(hs_file(str(sp), r)) for r in range(5)] == [sid != victim.id for sid in rows]
    assert not (sp / TOKEN_FREQ).exists() and not (sp / "state.json").exists()


def test_a_sample_in_two_shards_is_exported_once(tmp_path):
    _, loc, samples, shards = make_run(tmp_path, [[0, 1, 2], [2, 3, 4]])
    kept = min(shards)
    sf = tmp_path / "sf"
    res = _export(loc.root, "specforge", sf)
    assert res.returncode == 0 and res.stdout == f"exported 5 samples to {sf} (0 already there)\n"
    assert re.fullmatch(
        r"\S+ \S+ harvest\.read WARNING "
        + re.escape(
            f"{loc.root}: 1 sample is committed by more than one shard (e.g. {samples[2].id}, read from shard {kept}, "
            f"also in {max(shards)}); each is read once, from the shard with the smallest id; `harvest reconcile "
            "--dedupe` removes the extra copies from the index"
        )
        + "\n",
        res.stderr,
    ), res.stderr
    files = sorted(os.path.relpath(os.path.join(d, n), sf) for d, _, names in os.walk(sf) for n in names)
    assert len(files) == 5 and [f for f in files if samples[2].id in f] == [f"{kept}/data_{samples[2].id}.ckpt"]


def test_a_corrupt_sample_on_s3_names_the_object_and_the_output_url(tmp_path, s3_bucket):
    cfg = make_config(f"{s3_bucket}/out")
    loc = Location.from_url(cfg.out_url).child(cfg.run)
    loc.write_atomic(RUN_FILE, cfg.to_json().encode())
    samples = spool_samples(str(tmp_path / "spool"), cfg, [5, 9, 3])
    shard = pack(loc, cfg, str(tmp_path / "spool"), samples)
    begin, end, expected, found = flip(loc, shard, samples[2].id, "hidden_states")
    reader = RunReader(f"{s3_bucket}/out/r")
    with pytest.raises(CorruptSample) as e:
        reader.get(samples[2].id)
    assert str(e.value) == (
        f"{s3_bucket}/out/r/{shard_file(shard)}: sample {samples[2].id} is corrupt: tensor hidden_states, bytes "
        f"[{begin}, {end}) of the shard have crc32 {found}, its index records {expected}; run `harvest reconcile "
        f"--verify --run r --out {s3_bucket}/out` to drop it from the index and extract it again"
    )
    assert torch.equal(reader.get(samples[0].id)["input_ids"], samples[0].input_ids)
    rep = verify_run(loc, exclude=True)
    assert [(c.shard_id, c.sample_id, c.tensor, c.begin, c.end) for c in rep.corrupt] == [
        (shard, samples[2].id, "hidden_states", begin, end)
    ]
    assert list(loc.read_json(index_file(shard))["excluded"]) == [samples[2].id]
    assert sorted(RunReader(f"{s3_bucket}/out/r").sample_ids) == sorted(s.id for s in samples[:2])
