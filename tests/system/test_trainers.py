"""Each export read by its trainer's own code, on a model with random non-unit norm weights: a real
`harvest run` (reference engine, bf16) whose layers come from a SpecForge draft config with a
non-default aux set, exported, then loaded through SpecForge 0.2.0's and speculators 0.9.0's
dataset classes, collators and target computations, whose targets are compared with an HF
forward's logits. speculators' training entry point runs far enough to compute one loss on CPU.

The packages come from PyPI without their dependency trees (.ci/run; scripts/trainer_pkgs.sh);
these tests skip, saying so, only when they cannot be imported.
"""

import json
import os

import pytest
import torch

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.read.reader import RunReader
from tests.support.cli import harvest_cli
from tests.support.need import need_module

INSTALL = "install them with scripts/trainer_pkgs.sh"


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """(worst |got - ref| relative to max |ref|, argmax agreements, positions) over the positions
    whose reference top-2 margin is not a near-tie (> 2% of the logit range)."""
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * ref.abs().max()
    return rel, int((got.argmax(-1) == ref.argmax(-1))[clear].sum()), int(clear.sum())


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("trainers")
    rows = [r for r in demo_rows(24) if "input_ids" not in r or len(r["input_ids"]) > 1]
    data = write_jsonl(str(tmp / "rows.jsonl"), rows)
    draft = tmp / "draft.json"  # SGLang ids 1, 2, 5: HF 2, 3, 6 (the preset would be 2, 4, 5)
    draft.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 5]},
            }
        )
    )
    res = harvest_cli(
        "run",
        data,
        "--model",
        tiny_model,
        "--out",
        f"file://{tmp}/out",
        "--run",
        "tr",
        "--workers",
        "1",
        "--layers",
        str(draft),
        "--no-progress",
        "--work-dir",
        str(tmp / "work"),
        "--dump-dir",
        str(tmp / "dumps"),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert RunReader(f"{tmp}/out/tr").capture_points == [2, 3, 6, 8]
    return tmp, f"{tmp}/out/tr"


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    w = model.model.norm.weight
    assert w.min() < 0.6 and w.max() > 1.5  # non-unit: a norm applied twice would show

    def forward(ids: torch.Tensor):
        with torch.no_grad():
            out = model(ids.long().unsqueeze(0), output_hidden_states=True)
        return out.logits[0], [h[0] for h in out.hidden_states]

    return forward


def _indexed_checkpoint(model: str, where: str) -> str:
    """The model dir with a `model.safetensors.index.json`: SpecForge's TargetHead reads lm_head
    only through an index file, which a single-file checkpoint lacks (real ones have it)."""
    from safetensors import safe_open

    os.makedirs(where)
    for name in os.listdir(model):
        os.symlink(os.path.join(model, name), os.path.join(where, name))
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    with open(os.path.join(where, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return where


def _specforge_targets(dest: str, head):
    """SpecForge's own offline pipeline: manifest reader -> feature store -> the eagle3 normalizer
    and collator (FeatureDataLoader) -> the strategy's target preparation (TargetHead)."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.strategies.base import _prepare_eagle_target

    provider = builtin_algorithm_registry().resolve("eagle3").providers.offline_for("text")
    refs = provider.build_reader(dest, run_id="t", ttt_length=7, max_len=2048).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("t"),
        refs=refs,
        batch_size=1,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(2048, ttt_length=7),
        strategy="eagle3",
    )
    for batch in loader:
        b = batch.tensors
        _, target, _ = _prepare_eagle_target(
            target_head=head,
            target_repr=batch.metadata["target_repr"],
            input_ids=b["input_ids"],
            target=b["target"],
            loss_mask=b["loss_mask"],
            device=torch.device("cpu"),
        )
        yield b, target


def test_specforge_reads_the_export_and_its_targets_are_the_models_logits(run, hf, tiny_model):
    need_module("specforge.runtime.data_plane.offline_reader", "SpecForge 0.2.0", INSTALL)
    from specforge.modeling.target.target_head import TargetHead

    tmp, run_url = run
    dest = str(tmp / "specforge")
    res = harvest_cli("export", "--run-url", run_url, "--format", "specforge", dest, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr == (
        "harvest: train a draft whose config has eagle_config.eagle_aux_hidden_state_layer_ids "
        "[1, 2, 5] (SGLang's ids of this run's aux layers [2, 3, 6]), or set "
        "model.aux_hidden_state_layer_ids [1, 2, 5]\n"
    )  # the draft config the run came from
    head = TargetHead.from_pretrained(_indexed_checkpoint(tiny_model, str(tmp / "indexed")))
    worst, agree, n, samples = 0.0, 0, 0, 0
    for b, target in _specforge_targets(dest, head):
        ids = b["input_ids"][0]
        assert b["hidden_state"].shape == (1, len(ids), 3 * 64) and b["target"].dtype == torch.bfloat16
        logits, states = hf(ids)
        aux = torch.cat([states[2], states[3], states[6]], -1)  # the draft config's layers, in SpecForge's order
        assert (b["hidden_state"][0].float() - aux).abs().max() <= 0.01 * aux.abs().max()
        # TargetHead.preprocess shifts by one: target[t] is the state at t + 1 (the last is padding).
        rel, a, c = _agreement(target[0, :-1].float(), logits[1:])
        worst, agree, n, samples = max(worst, rel), agree + a, n + c, samples + 1
    print(f"specforge: {samples} samples, worst |target - HF logits| / max {worst:.4f}, argmax {agree}/{n}")
    assert samples == len(RunReader(run_url))
    assert worst < 0.02, worst  # bf16 states and a bf16 lm_head
    assert n > 500 and agree / n >= 0.99, (agree, n)

    # The warning an fp32 export prints is real: SpecForge's bf16 TargetHead does not take it.
    dest32 = str(tmp / "specforge32")
    assert (
        harvest_cli(
            "export", "--run-url", run_url, "--format", "specforge", dest32, "--dtype", "fp32", "--no-progress"
        ).returncode
        == 0
    )
    with pytest.raises(RuntimeError, match="dtype"):
        next(_specforge_targets(dest32, head))


class _CpuTrainer:
    """Stands in for speculators' Trainer, which moves the model to an accelerator this machine
    lacks: it takes one batch from the trainer's own train loader and computes the loss with the
    model's own forward, as Trainer.train_epoch does (under autocast in the hidden-state dtype)."""

    seen: dict = {}

    def __init__(self, model, config, train_loader, val_loader):
        self.seen.update(model=model, config=config, loader=train_loader)

    def run_training(self):
        model, cfg = self.seen["model"], self.seen["config"]
        batch = next(iter(self.seen["loader"]))
        with torch.autocast("cpu", dtype=cfg.hidden_states_dtype):
            _, loss, metrics = model(**batch, **(cfg.train_call_kwargs or {}))
            with torch.no_grad():  # the targets, as Eagle3DraftModel.forward computes them
                targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))
        self.seen.update(batch=batch, loss=loss, targets=targets.float())

    @classmethod
    def targets_of(cls, hidden: torch.Tensor) -> torch.Tensor:
        """The trainer's target computation applied to other final states."""
        model, cfg = cls.seen["model"], cls.seen["config"]
        with torch.no_grad(), torch.autocast("cpu", dtype=cfg.hidden_states_dtype):
            return model.verifier_lm_head(model.verifier_norm(hidden.to(cfg.hidden_states_dtype))).float()


def test_speculators_trains_on_the_export_and_its_targets_are_the_models_logits(run, hf, tiny_model, monkeypatch):
    need_module("speculators.train.cli", "speculators 0.9.0 / hs-connectors 0.9.0", INSTALL)
    import speculators.train.cli as cli
    from datasets import load_from_disk
    from speculators.train.config import TrainConfig

    tmp, run_url = run
    dest = str(tmp / "speculators")
    res = harvest_cli("export", "--run-url", run_url, "--format", "speculators", dest, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stderr == "harvest: train with --target-layer-ids 2 3 6 (this run's aux layers; the default is 2 4 5)\n"
    reader = RunReader(run_url)

    monkeypatch.setattr(cli, "Trainer", _CpuTrainer)
    cfg = TrainConfig.resolve(
        [
            "--speculator-type",
            "eagle3",
            "--verifier-name-or-path",
            tiny_model,
            "--data-path",
            dest,
            "--draft-vocab-size",
            "128",
            "--total-seq-len",
            "1024",
            "--epochs",
            "1",
            "--save-path",
            str(tmp / "ckpt"),
            "--on-missing",
            "raise",
            "--num-workers",
            "0",
            "--target-layer-ids",
            "2",
            "3",
            "6",  # as the export said
            "--draft-attn-impl",
            "sdpa",
            "--loss-implementation",
            "eager",  # flex attention and fused losses need a GPU
        ]
    )
    cli.main(cfg)  # speculators' entry point: vocab mapping from token_freq.pt, draft and verifier weights, loaders
    seen = _CpuTrainer.seen
    assert torch.isfinite(seen["loss"]) and seen["loss"].item() > 0
    assert os.path.exists(os.path.join(dest, "d2t-128.npy"))  # built from our token_freq.pt, not the full vocab
    t2d = seen["model"].t2d.bool()
    assert int(t2d.sum()) == 128
    assert seen["model"].target_layer_ids == [2, 3, 6]

    # Compare per packed document: shift_batch drops each sample's first token, so position t of a
    # document is the sample's position t + 1, whose target is the model's logits there.
    ds = load_from_disk(dest)
    rows = json.load(open(os.path.join(dest, "harvest-export.json")))["samples"]
    by_ids = {tuple(r["input_ids"].tolist()[1:]): (r["input_ids"], rows[i]) for i, r in enumerate(ds)}
    batch, doc = seen["batch"], seen["batch"]["document_ids"][0]
    worst, agree, n, agree_twice = 0.0, 0, 0, 0
    docs = int(doc.max()) + 1
    assert docs >= 5
    for d in range(docs - 1):  # the last document may be cut at --total-seq-len
        pos = (doc == d).nonzero().flatten()
        ids, sid = by_ids[tuple(batch["input_ids"][0, pos].tolist())]
        logits, states = hf(ids)
        ref = logits[1:][:, t2d]
        # shift_batch pairs position t's aux states with the target at t + 1.
        aux = torch.cat([states[2], states[3], states[6]], -1)[:-1]
        assert (batch["hidden_states"][0, pos].float() - aux).abs().max() <= 0.01 * aux.abs().max()
        rel, a, c = _agreement(seen["targets"][0, pos], ref)
        worst, agree, n = max(worst, rel), agree + a, n + c
        stored = reader.get(sid)["hidden_states"][1:, -1]  # harvest's post-norm state, as the old export wrote it
        agree_twice += _agreement(_CpuTrainer.targets_of(stored), ref)[1]
    print(
        f"speculators: loss {seen['loss'].item():.4f}, worst |target - HF logits| / max {worst:.4f}, argmax "
        f"{agree}/{n}; with the norm applied twice {agree_twice}/{n}"
    )
    assert worst < 0.02, worst
    assert n > 200 and agree / n >= 0.99, (agree, n)
    assert agree_twice / n < 0.9, agree_twice / n  # the norm applied twice (the old export) is visibly wrong
