import os

import pytest
import torch
from safetensors.torch import load_file

from harvest.engines.batch import cut_batch
from harvest.formats.dump import DumpError, parse_chunk_name, read_chunk, write_chunk

R1 = "hv-" + "1" * 32 + "-1"
R2 = "hv-" + "2" * 32 + "-7"


def test_cut_batch_slices_a_flat_extend_batch_like_sglang(tmp_path):
    # Three requests in one forward: R1 continues from prefix 4 with 3 tokens, a warmup
    # request (no hv- prefix) with 2 tokens, R2 new with 5 tokens.
    ids = torch.arange(10)
    hs = torch.arange(10 * 2 * 3, dtype=torch.float32).reshape(10, 2, 3)
    chunks = cut_batch([R1, "warmup-0", R2], [4, 0, 0], [3, 2, 5], ids, hs)
    assert [(c.rid, c.start, c.end) for c in chunks] == [(R1, 4, 7), (R2, 0, 5)]
    assert torch.equal(chunks[1].hidden_states, hs[5:10])
    path = write_chunk(str(tmp_path), chunks[0], [2, 4], "tiny")
    assert os.path.basename(path) == f"{R1}.4-7.safetensors"
    assert sorted(os.listdir(tmp_path)) == [f"{R1}.4-7.safetensors"]  # no temporary left behind
    t = load_file(path)
    assert torch.equal(t["hidden_states"], hs[0:3]) and t["input_ids"].tolist() == [0, 1, 2]
    c = read_chunk(path)
    assert (c.rid, c.start, c.end, c.capture_points, c.model) == (R1, 4, 7, [2, 4], "tiny")


def test_cut_batch_rejects_inconsistent_layout():
    with pytest.raises(DumpError, match=r"batch has 5 extend tokens but input_ids \(4,\)"):
        cut_batch([R1], [0], [5], torch.arange(4), torch.zeros(4, 1, 1))


def test_chunk_names_only_match_the_contract():
    assert parse_chunk_name(f"{R1}.0-64.safetensors") == (R1, 0, 64)
    for bad in [f".tmp-{R1}.0-64.safetensors.1", f"{R1}.0-64.safetensors.x", "hv-../x.0-1.safetensors", "other.bin"]:
        assert parse_chunk_name(bad) is None


def test_read_chunk_refuses_garbage(tmp_path):
    p = tmp_path / f"{R1}.0-4.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(DumpError, match="unreadable dump file"):
        read_chunk(str(p))
