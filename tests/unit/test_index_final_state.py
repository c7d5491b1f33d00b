"""The index records what the final slot holds: written by every shard plan, refused when it is
missing or not this harvest's convention."""

import pytest

from harvest.formats.index import FORMAT, ShardError, parse_index


def _doc(**extra):
    return {
        "format": FORMAT,
        "shard_id": "a" * 32,
        "shard": f"shards/{'a' * 32}.safetensors",
        "samples": ["s1"],
        "tokens": [3],
        "offsets": [0, 3],
        "bytes": 10,
        "sha256": "0" * 64,
        "dtype": "bfloat16",
        "capture_points": [2, 4, 5, 8],
        "crc32": [[0, 0, 0]],
        "crc32_tensors": ["hidden_states", "input_ids", "loss_mask"],
        **extra,
    }


def test_index_final_state():
    with pytest.raises(ShardError, match="i.json: final state None, this harvest reads post-norm"):
        parse_index(_doc(), "i.json")
    assert parse_index(_doc(final_state="post-norm"), "i.json")["final_state"] == "post-norm"
    with pytest.raises(ShardError, match="i.json: final state 'pre-norm', this harvest reads post-norm"):
        parse_index(_doc(final_state="pre-norm"), "i.json")
