import pytest

from harvest.config import RunConfig, eagle3_layers, parse_layers
from harvest.errors import ConfigurationError


def test_eagle3_preset_in_hf_indices():
    assert eagle3_layers(32) == [2, 16, 29, 32]
    assert eagle3_layers(61) == [2, 30, 58, 61]
    assert eagle3_layers(8) == [2, 4, 5, 8]
    assert eagle3_layers(4) == [1, 2, 4]  # deduplicated and sorted for tiny models


def test_parse_layers_errors_are_exact():
    assert parse_layers("7,2,4,2", 8) == [2, 4, 7]
    with pytest.raises(
        ConfigurationError, match=r"--layers \[9\]: capture points must lie in \[0, 8\] for a 8-layer model"
    ):
        parse_layers("2,9", 8)
    with pytest.raises(
        ConfigurationError,
        match="expected 'eagle3', comma-separated integers like 2,4,7, or a draft model's config.json",
    ):
        parse_layers("two", 8)


def test_run_config_json_round_trip_and_validation():
    cfg = RunConfig(run="r1", model="/m", capture_points=[2, 4], hidden_size=64, out_url="/o", storage_dtype="fp32")
    assert RunConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigurationError, match="storage dtype 'int4'"):
        RunConfig(run="r1", model="/m", capture_points=[2], hidden_size=64, out_url="/o", storage_dtype="int4")
    with pytest.raises(ValueError, match="invalid run name"):
        RunConfig(run="../r", model="/m", capture_points=[2], hidden_size=64, out_url="/o")


def test_run_records_what_each_slot_holds():
    cfg = RunConfig(run="r1", model="/m", capture_points=[2, 4, 5, 8], hidden_size=64, out_url="/o", num_layers=8)
    assert cfg.slots() == ["input:2", "input:4", "input:5", "final:post-norm"]
    assert '"final_state": "post-norm"' in cfg.to_json()
    old = cfg.to_json().replace('"final_state": "post-norm",', "")  # a run.json written before it was recorded
    assert RunConfig.from_json(old) == cfg
    with pytest.raises(ConfigurationError, match="final state 'pre-norm': this harvest stores post-norm"):
        RunConfig(run="r1", model="/m", capture_points=[8], hidden_size=64, out_url="/o", final_state="pre-norm")
