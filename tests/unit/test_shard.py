"""The streaming shard writer against the in-memory reference encoding, its checksums against
hashlib's and zlib's of the reference bytes, and range reads back."""

import errno
import io
import itertools
import json
import os
import zlib

import pytest
import torch

from harvest.formats.index import ShardError, encode_index, index_file, parse_index
from harvest.formats.shard import ShardSums, plan_shard, shard_file
from harvest.formats.shard_write import copy_shard, write_shard
from harvest.formats.spool import SpoolError, inspect_sample
from harvest.formats.stformat import BLOCK, encode
from harvest.node.spooldir import spool_path
from harvest.read.shard_reader import ShardReader
from harvest.storage import Location
from tests.support.synth import HIDDEN, POINTS, make_config, spool_samples


def _plan(spool, cfg, samples):
    entries = [inspect_sample(spool_path(spool, s.id), s.id, len(POINTS), HIDDEN, cfg.torch_dtype) for s in samples]
    return plan_shard(entries, cfg.run, cfg.capture_points, cfg.torch_dtype)


def _stream(plan) -> tuple[bytes, ShardSums]:
    buf = io.BytesIO()
    sums = write_shard(plan, buf)
    return buf.getvalue(), sums


def _copy(plan, path) -> tuple[bytes, ShardSums]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sums = copy_shard(plan, fd)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read(), sums


def _reference_crc32(ref: dict, offsets: list[int]) -> list[list[int]]:
    """zlib.crc32 of each sample's rows of each tensor but `offsets`, in sorted name order, computed
    from the reference tensors' own bytes (not from the shard)."""
    names = sorted(n for n in ref if n != "offsets")
    return [
        [zlib.crc32(ref[n][a:b].contiguous().view(torch.uint8).numpy().tobytes()) for n in names]
        for a, b in itertools.pairwise(offsets)
    ]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8_e4m3"])
def test_streamed_shard_equals_reference_encoding_and_reads_back_by_range(tmp_path, dtype):
    import hashlib

    cfg = make_config(str(tmp_path / "out"), dtype=dtype)
    spool = tmp_path / "spool"
    samples = spool_samples(str(spool), cfg, [1, 17, 5, 300])
    plan = _plan(str(spool), cfg, samples)
    data, sha = _stream(plan)
    # Byte for byte what stformat.encode makes of the concatenated tensors (sorted names).
    offsets = [0, 1, 18, 23, 323]
    ref = {
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
        "hidden_states": torch.cat([s.hidden_states for s in samples]),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if dtype == "fp8_e4m3":
        ref["hidden_scale"] = torch.cat([s.hidden_scale for s in samples])
    meta = {
        "format": "harvest-shard-1",
        "run": "r",
        "sample_ids": json.dumps([s.id for s in samples]),
        "capture_points": json.dumps(POINTS),
    }
    assert data == encode(ref, meta, BLOCK)  # tensor data on a filesystem block (harvest.formats.filecopy)
    assert sha.sha256 == hashlib.sha256(data).hexdigest() and plan.nbytes == len(data)
    names = (
        ["hidden_scale", "hidden_states", "input_ids", "loss_mask"]
        if dtype == "fp8_e4m3"
        else ["hidden_states", "input_ids", "loss_mask"]
    )
    assert sha.crc32 == _reference_crc32(ref, offsets) and len(sha.crc32) == 4 and len(sha.crc32[0]) == len(names)
    assert _copy(plan, str(tmp_path / "copied")) == (data, sha)  # a local output: the kernel's copy, summed aside
    index = plan.index(sha)
    assert index["offsets"] == offsets and index["samples"] == [s.id for s in samples]
    assert index["tokens"] == [1, 17, 5, 300] and index["dtype"] == str(cfg.torch_dtype).removeprefix("torch.")
    assert index["final_state"] == "post-norm"  # what the final slot holds, whatever the engine
    assert index["sha256"] == sha.sha256 and index["crc32"] == sha.crc32 and index["crc32_tensors"] == names
    assert encode_index(index) == json.dumps(index, indent=1).encode()  # the collector's encoding, byte for byte
    assert parse_index(json.loads(encode_index(index)), "i.json") == index

    loc = Location.from_url(str(tmp_path / "out"))
    loc.write_atomic(shard_file(plan.shard_id), data)
    loc.write_atomic(index_file(plan.shard_id), encode_index(index))
    r = ShardReader(loc, index)
    for i, s in enumerate(samples):
        got = r.sample(i)
        assert torch.equal(got["input_ids"], s.input_ids)
        assert torch.equal(got["loss_mask"], s.loss_mask)
        assert got["hidden_states"].dtype == cfg.torch_dtype
        assert torch.equal(got["hidden_states"].view(torch.uint8), s.hidden_states.view(torch.uint8))
        if dtype == "fp8_e4m3":
            assert torch.equal(got["hidden_scale"], s.hidden_scale)


def test_same_samples_same_bytes_and_id(tmp_path):
    cfg = make_config(str(tmp_path / "out"))
    samples = spool_samples(str(tmp_path / "spool"), cfg, [4, 3, 9])
    a, b = _plan(str(tmp_path / "spool"), cfg, samples), _plan(str(tmp_path / "spool"), cfg, samples)
    assert a.shard_id == b.shard_id and _stream(a) == _stream(b)
    c = _plan(str(tmp_path / "spool"), cfg, samples[::-1])
    assert c.shard_id != a.shard_id  # the order is part of the identity


@pytest.mark.parametrize("how", ["streaming", "copying"])
def test_truncated_spool_file_is_refused(tmp_path, how):
    cfg = make_config(str(tmp_path / "out"))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [5, 6])
    plan = _plan(spool, cfg, samples)
    path = spool_path(spool, samples[1].id)
    with open(path, "r+b") as f:
        f.truncate(plan.entries[1].spans["hidden_states"].begin + 3)
    with pytest.raises(SpoolError, match=f"{path}: ends inside tensor hidden_states \\(spool file truncated\\)"):
        _stream(plan) if how == "streaming" else _copy(plan, str(tmp_path / "copied"))


def test_tensor_data_lies_on_filesystem_blocks(tmp_path):
    """Spool files and shards start their tensor data on a 4 KiB block, and whole samples of a
    usual width are whole blocks, so a reflink filesystem can clone every sample's hidden states
    from the spool into the shard instead of copying them."""
    cfg = make_config(str(tmp_path / "out"))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [64, 128])  # 64 tokens x 4 points x 16 wide x 2 bytes = 2 blocks
    plan = _plan(spool, cfg, samples)
    assert len(plan.header) % BLOCK == 0 and plan.tensors[0].name == "hidden_states"
    assert [e.spans["hidden_states"].begin % BLOCK for e in plan.entries] == [0, 0]


def test_kernel_refusing_the_copy_falls_back_to_the_same_bytes(tmp_path, monkeypatch):
    """Where copy_file_range is refused (another filesystem on an older kernel: EXDEV), the ranges
    are copied through a buffer: the same bytes and checksum."""
    cfg = make_config(str(tmp_path / "out"))
    spool = str(tmp_path / "spool")
    plan = _plan(spool, cfg, spool_samples(spool, cfg, [3, 40, 7]))
    want = _stream(plan)
    calls = []

    def refuse(*a):
        calls.append(a)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    assert _copy(plan, str(tmp_path / "copied")) == want
    assert calls  # the kernel was asked first


def test_kernel_answering_zero_bytes_with_data_there_falls_back(tmp_path, monkeypatch):
    """Some filesystems (FUSE, overlay, NFS) answer copy_file_range with 0 though the source holds
    data: that is not the end of the file, the range is copied through a buffer instead."""
    cfg = make_config(str(tmp_path / "out"))
    spool = str(tmp_path / "spool")
    plan = _plan(spool, cfg, spool_samples(spool, cfg, [3, 40]))
    want = _stream(plan)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)
    assert _copy(plan, str(tmp_path / "copied")) == want


def test_spool_file_of_another_dtype_cannot_join_a_shard(tmp_path):
    cfg = make_config(str(tmp_path / "out"))
    spool = str(tmp_path / "spool")
    s = spool_samples(spool, make_config("x", dtype="fp16"), [3])[0]
    with pytest.raises(
        SpoolError, match="hidden_states is torch.float16 \\[3, 4, 16\\], the run stores torch.bfloat16"
    ):
        inspect_sample(spool_path(spool, s.id), s.id, len(POINTS), HIDDEN, cfg.torch_dtype)
    with pytest.raises(ShardError, match="at least one sample"):
        plan_shard([], "r", POINTS, torch.bfloat16)


@pytest.mark.parametrize("how", ["streaming", "copying"])
def test_crc32_of_samples_read_in_pieces_cut_anywhere(tmp_path, monkeypatch, how):
    """The sums see the shard in buffers that cut samples and tensors anywhere (a buffer smaller
    than a sample, not a multiple of a row): each sample's crc32s still cover exactly its rows."""
    from harvest.formats import shard_write as shard

    cfg = make_config(str(tmp_path / "out"), dtype="fp8_e4m3")
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, [40, 1, 33, 7])
    plan = _plan(spool, cfg, samples)
    want_bytes, want = _stream(plan)  # 8 MiB buffers: every sample in one piece
    monkeypatch.setattr(shard, "COPY_BUFFER", 1000)
    got = _stream(plan) if how == "streaming" else _copy(plan, str(tmp_path / "copied"))
    ref = {
        "hidden_scale": torch.cat([s.hidden_scale for s in samples]),
        "hidden_states": torch.cat([s.hidden_states for s in samples]),
        "input_ids": torch.cat([s.input_ids for s in samples]),
        "loss_mask": torch.cat([s.loss_mask for s in samples]),
    }
    assert got == (want_bytes, want) and want.crc32 == _reference_crc32(ref, [0, 40, 41, 74, 81])
