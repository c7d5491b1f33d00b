"""Each trainer reads a run in place, with its own loader code, and the feed writes nothing to disk.

The run of tests/system/test_trainers.py (a real `harvest run` of the tiny model with random
non-unit norms, capture points from a SpecForge draft config), exported `--in-place`: only the
small part is written, and the hidden states are read from the run's shards by byte range:

- speculators 0.9.0: its own entry point (`speculators.train.cli.main`, flags resolved by its own
  `TrainConfig`) with `--hidden-states-backend harvest`, reading the run from a real S3 protocol
  server (moto's); every row equals the export's `hs_{row}.safetensors` bit for bit, and the
  targets its trainer computes match the model's logits as the export test checks;
- SpecForge 0.2.0: its own offline pipeline (manifest reader, feature store, normalizer,
  collator, TargetHead) over pointer files, whose tensors equal the export's `.ckpt` bit for bit,
  and whose targets match the logits.

The bytes written while feeding are measured with /proc/self/io (`write_bytes`: what this
process sent to the disk) and are ~0 per hidden byte fed, against the full export's >= 1 measured
the same way. `harvest speculators-train` is checked to register the backend in a fresh process.
"""

import json
import os

import pytest
import torch

from harvest.read.reader import RunReader
from harvest.storage import Location
from tests.support.cli import harvest_cli
from tests.support.need import need_module
from tests.system.test_trainers import (  # noqa: F401 (fixtures)
    INSTALL,
    _agreement,
    _CpuTrainer,
    _indexed_checkpoint,
    _specforge_targets,
    hf,
    run,
)

# One xdist worker for the whole file: its tests share the module's `harvest run` (the `run` fixture),
# which a second worker would run again.
pytestmark = pytest.mark.xdist_group("test_trainers_in_place")


def io_counters() -> dict[str, int]:
    """This process's I/O counters: `write_bytes` counts the bytes of the pages it dirties, when it
    dirties them (so no sync is needed to see a write), on any disk filesystem."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def disk_written(since: dict[str, int]) -> int:
    return io_counters()["write_bytes"] - since["write_bytes"]


# Pages this process dirties besides the feed while it is measured: pytest's capture file of a
# trainer's log lines, a module's cache imported lazily (CI saw 28 KB, 7 pages). A copy of the hidden
# states would be all of `fed`: far above this.
INCIDENTAL_WRITES = 64 << 10


def wrote_no_copy(written: int, fed: int) -> bool:
    return written <= 0.01 * fed + INCIDENTAL_WRITES


def hidden_bytes(reader: RunReader, samples: list[str], dtype_size: int = 2) -> int:
    """Bytes of hidden states the samples hold ([T, K, H] each) in a dtype of `dtype_size`."""
    k, h = len(reader.capture_points), reader.config.hidden_size
    return sum(int(reader.tokens(s)[0].numel()) for s in samples) * k * h * dtype_size


@pytest.fixture
def s3_run(run, s3_bucket):
    """The run copied as is to a bucket of the S3 server: read from there, in place."""
    _, run_url = run
    loc = Location.from_url(f"{s3_bucket}/tr")
    loc.fs.put(run_url + "/", loc.root + "/", recursive=True)
    return loc.url()


class _FeedTrainer(_CpuTrainer):
    """_CpuTrainer's loss and targets on the first batch, then the rest of speculators' own train
    loader fed through, its disk writes measured."""

    def run_training(self):
        before = io_counters()
        batches = sum(1 for _ in self.seen["loader"])
        self.seen.update(batches=batches, written=disk_written(before))
        super().run_training()


def test_speculators_reads_the_run_in_place_from_s3(run, s3_run, hf, tiny_model, monkeypatch):
    need_module("speculators.train.cli", "speculators 0.9.0 / hs-connectors 0.9.0", INSTALL)
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from harvest.read.speculators_backend import open_transfer, register

    register()  # what `harvest speculators-train` does first (checked in a fresh process below)
    import speculators.train.cli as cli
    from speculators.train.config import TrainConfig

    tmp, run_url = run
    full, small = str(tmp / "spec-full"), str(tmp / "spec-in-place")
    assert harvest_cli("export", "--run-url", run_url, "--format", "speculators", full, "--no-progress").returncode == 0
    res = harvest_cli(
        "export",
        "--run-url",
        s3_run,
        "--format",
        "speculators",
        small,
        "--in-place",
        "--no-progress",
        "--model",
        tiny_model,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr == "harvest: train with --target-layer-ids 2 3 6 (this run's aux layers; the default is 2 4 5)\n"
    assert sorted(os.listdir(small)) == sorted(
        [
            "data-00000-of-00001.arrow",
            "dataset_info.json",
            "state.json",
            "token_freq.pt",
            "harvest-export.json",
            "harvest-final-norm.safetensors",
        ]
    )  # no hidden_states/
    manifest = json.load(open(os.path.join(small, "harvest-export.json")))
    assert manifest["run_url"] == s3_run and manifest["in_place"] is True
    assert manifest["samples"] == json.load(open(os.path.join(full, "harvest-export.json")))["samples"]
    assert torch.load(os.path.join(small, "token_freq.pt")) == torch.load(os.path.join(full, "token_freq.pt"))
    reader = RunReader(run_url)
    rows = manifest["samples"]
    assert len(rows) == len(reader)

    # Every row, read in place from S3 and from the local run, is the export's file bit for bit.
    for transfer in (open_transfer(small), open_transfer(small, run_url)):
        for i in range(len(rows)):
            got, want = transfer.get_cached(i), load_file(os.path.join(full, "hidden_states", f"hs_{i}.safetensors"))
            assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype for k in got), i
            assert all(torch.equal(got[k], want[k]) for k in got), i
        assert transfer.get_cached(len(rows)) is None  # past the rows: speculators' --on-missing decides

    monkeypatch.setattr(cli, "Trainer", _FeedTrainer)
    cfg = TrainConfig.resolve(
        [
            "--speculator-type",
            "eagle3",
            "--verifier-name-or-path",
            tiny_model,
            "--data-path",
            small,
            "--hidden-states-backend",
            "harvest",  # the run's URL from the manifest: s3://
            "--draft-vocab-size",
            "128",
            "--total-seq-len",
            "1024",
            "--epochs",
            "1",
            "--save-path",
            str(tmp / "ckpt-ip"),
            "--on-missing",
            "raise",
            "--num-workers",
            "0",
            "--target-layer-ids",
            "2",
            "3",
            "6",
            "--draft-attn-impl",
            "sdpa",
            "--loss-implementation",
            "eager",
        ]
    )
    cli.main(cfg)
    seen = _FeedTrainer.seen
    assert torch.isfinite(seen["loss"]) and seen["loss"].item() > 0
    assert seen["model"].target_layer_ids == [2, 3, 6] and seen["batches"] >= 1
    loader = seen["loader"]
    assert type(loader.dataset.transfer).__name__ == "HarvestTransfer" and loader.dataset.transfer.run_url == s3_run
    fed = hidden_bytes(
        reader,
        [rows[i] for i in range(loader.dataset.start_file_idx, loader.dataset.start_file_idx + len(loader.dataset))],
    )
    print(f"speculators in place: {fed} hidden bytes fed, {seen['written']} bytes written to disk")
    assert wrote_no_copy(seen["written"], fed), (seen["written"], fed)

    # The targets speculators' trainer computes from the in-place rows are the model's logits.
    t2d = seen["model"].t2d.bool()
    ds = load_from_disk(small)
    by_ids = {tuple(r["input_ids"].tolist()[1:]): r["input_ids"] for r in ds}
    batch, doc = seen["batch"], seen["batch"]["document_ids"][0]
    worst, agree, n = 0.0, 0, 0
    assert int(doc.max()) + 1 >= 5
    for d in range(int(doc.max())):  # the last document may be cut at --total-seq-len
        pos = (doc == d).nonzero().flatten()
        logits, states = hf(by_ids[tuple(batch["input_ids"][0, pos].tolist())])
        aux = torch.cat([states[2], states[3], states[6]], -1)[:-1]
        assert (batch["hidden_states"][0, pos].float() - aux).abs().max() <= 0.01 * aux.abs().max()
        rel, a, c = _agreement(seen["targets"][0, pos], logits[1:][:, t2d])
        worst, agree, n = max(worst, rel), agree + a, n + c
    print(f"speculators in place: worst |target - HF logits| / max {worst:.4f}, argmax {agree}/{n}")
    assert worst < 0.02, worst
    assert n > 200 and agree / n >= 0.99, (agree, n)

    # The export's files, written in this process and measured the same way, do reach the disk: the
    # measure sees writes (a feed that wrote its rows to disk would fail above).
    from harvest.read.export import export_run

    before = io_counters()
    export_run(run_url, "speculators", str(tmp / "spec-full-here"), progress=False, model=tiny_model)
    written = disk_written(before)
    assert written >= hidden_bytes(reader, rows), (written, hidden_bytes(reader, rows))


def test_harvest_speculators_train_registers_the_backend_in_speculators_own_process():
    need_module("speculators.train.cli", "speculators 0.9.0 / hs-connectors 0.9.0", INSTALL)
    res = harvest_cli("speculators-train", "--help", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--hidden-states-backend {file,fp8,mooncake,harvest}" in res.stdout
    assert "--harvest-run HARVEST_RUN" in res.stdout


def test_specforge_reads_the_run_in_place_through_pointer_files(run, s3_run, hf, tiny_model):
    need_module("specforge.runtime.data_plane.offline_reader", "SpecForge 0.2.0", INSTALL)
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore, load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader, list_feature_files
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    tmp, run_url = run
    full, small, small_s3 = str(tmp / "sf-full"), str(tmp / "sf-in-place"), str(tmp / "sf-in-place-s3")
    for url, dest, more in ((run_url, full, []), (run_url, small, ["--in-place"]), (s3_run, small_s3, ["--in-place"])):
        res = harvest_cli("export", "--run-url", url, "--format", "specforge", dest, "--no-progress", *more)
        assert res.returncode == 0, res.stderr
    reader = RunReader(run_url)
    files = {d: list_feature_files(d) for d in (full, small, small_s3)}
    assert (
        [os.path.relpath(p, full) for p in files[full]]
        == [os.path.relpath(p, small) for p in files[small]]
        == [os.path.relpath(p, small_s3) for p in files[small_s3]]
    )  # the same samples in SpecForge's order
    assert len(files[small]) == len(reader)
    size = sum(os.path.getsize(p) for p in files[small])
    assert size < 0.2 * sum(os.path.getsize(p) for p in files[full]), size

    # The vocabulary count reads the tokens alone (the pointer files; torch.load reads each a few times
    # over), not the run's hidden states, which would come to more than all of this.
    want = count_effective_feature_tokens(full)
    before = io_counters()
    assert count_effective_feature_tokens(small) == want
    assert io_counters()["rchar"] - before["rchar"] < hidden_bytes(reader, reader.sample_ids)

    # SpecForge's feature store hands out the export's tensors bit for bit, from the local run and from S3.
    store = LocalFeatureStore("t")
    for where in (small, small_s3):
        refs = OfflineManifestReader(where, run_id="t").read()
        for ref, path in zip(refs, files[full], strict=False):
            got, handle = store.get(ref)
            want = load_feature_file(path)
            assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want), path
            store.release(handle)

    # SpecForge's own pipeline over the pointers: targets are the model's logits; nothing written.
    head = TargetHead.from_pretrained(_indexed_checkpoint(tiny_model, str(tmp / "indexed-ip")))
    before = io_counters()
    worst, agree, n, samples = 0.0, 0, 0, 0
    for b, target in _specforge_targets(small, head):
        logits, states = hf(b["input_ids"][0])
        aux = torch.cat([states[2], states[3], states[6]], -1)
        assert (b["hidden_state"][0].float() - aux).abs().max() <= 0.01 * aux.abs().max()
        rel, a, c = _agreement(target[0, :-1].float(), logits[1:])
        worst, agree, n, samples = max(worst, rel), agree + a, n + c, samples + 1
    written = disk_written(before)
    fed = hidden_bytes(reader, reader.sample_ids)
    print(
        f"specforge in place: {samples} samples, {fed} hidden bytes fed, {written} bytes written to disk, worst "
        f"|target - HF logits| / max {worst:.4f}, argmax {agree}/{n}"
    )
    assert samples == len(reader)
    assert wrote_no_copy(written, fed), (written, fed)
    assert worst < 0.02, worst
    assert n > 500 and agree / n >= 0.99, (agree, n)
