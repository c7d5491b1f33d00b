"""`--layers <draft config.json>`: the capture points a draft trains on, from SpecForge's and
speculators' real config keys, in each framework's layer convention."""

import json

import pytest

from harvest.config import eagle3_layers, parse_layers
from harvest.errors import ConfigurationError


def _cfg(tmp_path, doc, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_speculators_ids_are_hf_indices(tmp_path):
    # speculators / vLLM: top-level eagle_aux_hidden_state_layer_ids, id k = input of decoder layer k.
    doc = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 12, 22]}
    assert parse_layers(_cfg(tmp_path, doc), 24) == [2, 12, 22, 24]
    assert parse_layers(str(tmp_path), 24) == [2, 12, 22, 24]  # the draft model's dir, as both trainers accept


def test_specforge_ids_are_sglang_layer_outputs(tmp_path):
    # SpecForge / SGLang: eagle_config.eagle_aux_hidden_state_layer_ids, id k = output of layer k = HF k + 1.
    doc = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 11, 21]},
    }
    assert parse_layers(_cfg(tmp_path, doc), 24) == [2, 12, 22, 24]  # the published gpt-oss-20B draft's set
    assert eagle3_layers(24) == [2, 12, 21, 24]  # which the preset would have missed


def test_configs_without_ids_take_both_trainers_default(tmp_path):
    for doc in (
        {"architectures": ["LlamaForCausalLMEagle3"]},
        {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": None},
    ):
        assert parse_layers(_cfg(tmp_path, doc), 32) == eagle3_layers(32) == [2, 16, 29, 32]


def test_both_conventions_must_agree(tmp_path):
    same = {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    }
    assert parse_layers(_cfg(tmp_path, same), 8) == [2, 4, 5, 8]
    differ = {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
    }
    with pytest.raises(
        ConfigurationError,
        match=r"\[2, 4, 5\] \(vLLM ids\) and eagle_config.eagle_aux_hidden_state_layer_ids "
        r"\[2, 4, 5\] \(SGLang ids, \+1\) name different layers",
    ):
        parse_layers(_cfg(tmp_path, differ), 8)


def test_bad_draft_configs_are_refused_by_name(tmp_path):
    path = _cfg(tmp_path, {"model_type": "llama", "num_hidden_layers": 8})
    with pytest.raises(ConfigurationError, match=f"--layers {path}: not an EAGLE-3 draft config"):
        parse_layers(path, 8)
    with pytest.raises(ConfigurationError, match=r"aux layer ids \[2, 4\]: expected a list of three integers"):
        parse_layers(_cfg(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4]}), 8)
    with pytest.raises(
        ConfigurationError,
        match=r"aux layers \[2, 16, 29\] \(HF indices\) must be 3 distinct indices in "
        r"\[0, 8\) for a 8-layer model: is it this model's draft\?",
    ):
        parse_layers(_cfg(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}), 8)
    with pytest.raises(ConfigurationError, match=r"aux layers \[5, 2, 4\] \(HF indices\) are not ascending"):
        parse_layers(_cfg(tmp_path, {"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}), 8)
    with pytest.raises(ConfigurationError, match="cannot read it as a draft model's JSON config"):
        parse_layers(str(tmp_path / "missing.json"), 8)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigurationError, match="cannot read it as a draft model's JSON config"):
        parse_layers(str(tmp_path / "broken.json"), 8)
