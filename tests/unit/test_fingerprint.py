"""A run knows its model by what the checkpoint holds (harvest.formats.fingerprint), not by its
path: a symlink or a copy is the same run; weights, config or tokenizer changed under the same
path are not. The fingerprint reads headers and 64 KiB of samples a weights file, so an edit that
keeps every header and misses every sample is not seen: pinned here as the documented limit."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from harvest.config import build_config
from harvest.errors import ConfigurationError
from harvest.formats.fingerprint import SAMPLE_BYTES, SAMPLES, model_fingerprint, short
from harvest.formats.runfile import check_same_run, publish_run_json, run_location
from harvest.node.modelcheck import check_digest, check_model_dir

WEIGHTS = "model.safetensors"


@pytest.fixture
def model(tiny_model, tmp_path) -> str:
    """A copy of the session's tiny model this test may change."""
    return shutil.copytree(tiny_model, str(tmp_path / "model"))


def _replace_weights(model_dir: str, seed: int = 1) -> None:
    """Other weights of the same names, shapes and dtypes saved over the checkpoint (a fine-tune)."""
    path = os.path.join(model_dir, WEIGHTS)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def _header(path: str) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def test_the_fingerprint_names_what_the_folder_holds(model, tmp_path):
    fp = model_fingerprint(model)
    assert set(fp["files"]) >= {"config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS}
    assert model_fingerprint(model) == fp  # stable
    link = tmp_path / "link"
    link.symlink_to(model)
    assert model_fingerprint(str(link)) == fp
    copy = shutil.copytree(model, str(tmp_path / "copy"))  # new mtimes: not part of it
    os.utime(os.path.join(copy, WEIGHTS), (1, 1))
    assert model_fingerprint(copy) == fp
    assert model_fingerprint("org/not-a-local-folder") is None


def test_other_weights_of_the_same_shapes_are_seen(model):
    before, header = model_fingerprint(model), _header(os.path.join(model, WEIGHTS))
    _replace_weights(model)
    assert _header(os.path.join(model, WEIGHTS)) == header  # a header alone could not tell them apart
    after = model_fingerprint(model)
    assert after["digest"] != before["digest"]
    assert [n for n in after["files"] if after["files"][n] != before["files"][n]] == [WEIGHTS]


def test_an_edit_that_keeps_every_header_and_misses_every_sample_is_not_seen(tmp_path):
    """The documented limit: values only, between the sampled bytes."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    w = torch.zeros(1 << 18)  # 1 MiB of tensor bytes
    save_file({"w": w}, str(d / WEIGHTS))
    fp = model_fingerprint(str(d))
    size = os.path.getsize(d / WEIGHTS)
    start = 8 + len(_header(str(d / WEIGHTS)))
    step = (size - start - SAMPLE_BYTES) // (SAMPLES - 1)
    between = start + SAMPLE_BYTES + 64  # after the first sample, before the second
    assert between + 4 < start + step
    w[(between - start) // 4] = 1.0
    save_file({"w": w}, str(d / WEIGHTS))
    assert model_fingerprint(str(d)) == fp
    w[0] = 1.0  # in the first sample
    save_file({"w": w}, str(d / WEIGHTS))
    assert model_fingerprint(str(d)) != fp


def test_torch_bin_weights_by_their_zip_crcs(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    w = torch.zeros(1 << 12)
    torch.save({"w": w}, str(d / "pytorch_model.bin"))
    fp = model_fingerprint(str(d))
    w[100] = 1.0  # anywhere: torch wrote each member's CRC-32 over its bytes
    torch.save({"w": w}, str(d / "pytorch_model.bin"))
    assert model_fingerprint(str(d))["files"]["pytorch_model.bin"] != fp["files"]["pytorch_model.bin"]


def _cfg(model: str, out: str):
    return build_config("fp", model, out)


def test_a_run_accepts_a_symlink_and_a_copy_of_its_model(model, tmp_path):
    out = str(tmp_path / "out")
    stored = _cfg(model, out)
    publish_run_json(stored)
    link = tmp_path / "link"
    link.symlink_to(model)
    publish_run_json(_cfg(str(link), out))  # accepted: nothing raised, run.json kept
    publish_run_json(_cfg(shutil.copytree(model, str(tmp_path / "copy")), out))
    loc = run_location(out, "fp")
    assert json.loads(loc.read_bytes("run.json"))["model"] == model


@pytest.mark.parametrize("change", ["weights", "config", "tokenizer"])
def test_a_run_refuses_its_model_path_holding_another_checkpoint(model, tmp_path, change):
    out = str(tmp_path / "out")
    stored = _cfg(model, out)
    if change == "weights":
        _replace_weights(model)
    elif change == "config":
        path = os.path.join(model, "config.json")
        doc = json.load(open(path))
        doc["rms_norm_eps"] = doc.get("rms_norm_eps", 1e-6) * 10
        json.dump(doc, open(path, "w"))
    else:
        path = os.path.join(model, "tokenizer_config.json")
        doc = json.load(open(path))
        doc["chat_template"] = "{{ messages }}"
        json.dump(doc, open(path, "w"))
    now = _cfg(model, out)
    name = {"weights": WEIGHTS, "config": "config.json", "tokenizer": "tokenizer_config.json"}[change]
    with pytest.raises(ConfigurationError) as e:
        check_same_run(now, stored, "RUNJSON")
    assert str(e.value) == (
        f"run 'fp' was extracted from the model with fingerprint {short(stored.model_fingerprint)} (at {model}, "
        f"recorded in RUNJSON), but {model} has fingerprint {short(now.model_fingerprint)}; differs in {name}: "
        f"another checkpoint, or the same path with other weights; use another --run, or `harvest accept-model --run "
        f"fp --model {model}` if it is the same model saved again"
    )
    with pytest.raises(ConfigurationError, match="^run 'fp' was extracted from the model with fingerprint"):
        check_model_dir(stored, model)
    with pytest.raises(
        ConfigurationError, match=f"^{model} has model fingerprint {short(now.model_fingerprint)}, not the "
    ):
        check_digest(stored.model_fingerprint["digest"], model)
    check_digest(now.model_fingerprint["digest"], model)


def test_a_run_json_without_a_fingerprint_is_refused_with_the_way_to_record_one(model, tmp_path):
    import dataclasses

    out = str(tmp_path / "out")
    now = _cfg(model, out)
    older = dataclasses.replace(now, model_fingerprint=None)
    with pytest.raises(ConfigurationError) as e:
        check_same_run(now, older, "RUNJSON")
    assert str(e.value) == (
        f"run 'fp' records no model fingerprint in RUNJSON: it cannot tell whether {model} "
        f"(fingerprint {short(now.model_fingerprint)}) is its model; `harvest accept-model --run fp --model {model}` "
        "records it, if it is"
    )


def test_a_hub_id_is_still_known_by_its_name(model, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(_cfg(model, str(tmp_path / "out")), model="org/name", model_fingerprint=None)
    check_same_run(cfg, cfg, "X")
    with pytest.raises(ConfigurationError, match="model: 'org/name' there, 'org/other' now"):
        check_same_run(dataclasses.replace(cfg, model="org/other"), cfg, "X")
