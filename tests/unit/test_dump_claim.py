"""Claim and verification of dump files, with real chunk files written by the shared writer."""

import json
import os
import zlib

import numpy as np
import pytest
import torch

from harvest.formats.dump import Chunk, write_chunk
from harvest.ids import rid_for
from harvest.sample import Sample
from harvest.state.failures import SampleFailure
from harvest.workers.claim import assemble, claim
from tests.support.need import need

SAMPLE = Sample.build(list(range(10, 20)))
RID = rid_for(SAMPLE.id, 1)
HS = torch.arange(10 * 2 * 4, dtype=torch.float32).reshape(10, 2, 4)


def _dump(d, start, end, ids=None, hs=None, points=(2, 4)):
    ids = torch.tensor(SAMPLE.input_ids[start:end].astype(np.int64)) if ids is None else ids
    write_chunk(str(d), Chunk(RID, start, end, ids, HS[start:end] if hs is None else hs), list(points), "m")


@pytest.fixture
def dirs(tmp_path):
    dump, claimed = tmp_path / "dump", tmp_path / "claimed"
    dump.mkdir()
    claimed.mkdir()
    return dump, claimed


def test_chunks_are_claimed_assembled_and_cast(dirs):
    dump, claimed = dirs
    for a, b in [(0, 4), (4, 8), (8, 10)]:
        _dump(dump, a, b)
    ok, failed = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    assert failed == {} and os.listdir(dump) == [] and len(ok[RID].paths) == 3
    s = assemble(ok[RID], SAMPLE, [2, 4], torch.bfloat16)
    assert torch.equal(s.hidden_states, HS.to(torch.bfloat16))
    assert s.input_ids.tolist() == list(range(10, 20))


def test_missing_chunk_times_out_with_a_reason_that_names_the_fix(dirs):
    dump, claimed = dirs
    _dump(dump, 0, 4)
    _dump(dump, 8, 10)
    ok, failed = claim(str(dump), str(claimed), {RID: 10}, timeout=0.2)
    assert ok == {} and failed[RID].reason == "incomplete-dump"
    assert "positions [4, 8) missing of [0, 10)" in failed[RID].message
    assert "harvest dump plugin" in failed[RID].message
    assert os.listdir(dump) == [] and os.listdir(claimed) == []  # nothing left behind


def test_overlapping_chunks_fail_at_once(dirs):
    dump, claimed = dirs
    _dump(dump, 0, 6)
    _dump(dump, 4, 10)
    ok, failed = claim(str(dump), str(claimed), {RID: 10}, timeout=30)
    assert failed[RID].reason == "bad-chunks" and "chunks overlap at position 4" in failed[RID].message


@pytest.mark.parametrize(
    "kwargs, reason, text",
    [
        (
            {"ids": torch.tensor([10, 11, 99, 13, 14, 15, 16, 17, 18, 19])},
            "token-mismatch",
            "position 2 is 99, sent 12",
        ),
        ({"points": (2, 5)}, "capture-mismatch", "engine captured layers [2, 5], the run captures [2, 4]"),
        ({"hs": torch.full((10, 2, 4), float("nan"))}, "nonfinite", "NaN/Inf (first at position 0, capture slot 0)"),
    ],
)
def test_verification_failures(dirs, kwargs, reason, text):
    dump, claimed = dirs
    _dump(dump, 0, 10, **kwargs)
    ok, _ = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    with pytest.raises(SampleFailure) as e:
        assemble(ok[RID], SAMPLE, [2, 4], torch.float32)
    assert e.value.reason == reason and text in e.value.message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_finiteness_check_by_bits_agrees_with_isfinite(dtype, monkeypatch):
    """The bit test behind the NaN/Inf check, against torch.isfinite on the edge values of each
    engine dtype: the largest finite value, the smallest subnormal, -0, and every kind of NaN."""
    from harvest.workers.claim import _all_finite

    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny, info.smallest_normal / 4, -0.0, 0.0, 1.0]
    base = torch.tensor(edges, dtype=torch.float64).to(dtype)
    assert _all_finite(base.reshape(1, 1, -1)) is True
    for bad in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        x = torch.cat([base, torch.tensor([bad], dtype=dtype)])
        assert _all_finite(x.reshape(1, 1, -1)) is False and not bool(torch.isfinite(x).all())
    t = torch.randn(64, 3, 8).to(dtype)
    assert _all_finite(t) and _all_finite(t[:, :, ::2])  # a strided view takes the min/max path
    t[17, 1, 5] = float("nan")
    assert not _all_finite(t) and not _all_finite(t[:, :, 1::2])
    monkeypatch.setattr("harvest.workers.claim._FINITE_BLOCK", 100)  # blocks of 100 values, the last one short
    assert not _all_finite(t)
    t[17, 1, 5] = 0.0
    t[-1, -1, -1] = float("inf")  # in the short last block
    assert not _all_finite(t)
    t[-1, -1, -1] = 1.0
    assert _all_finite(t)


@pytest.mark.parametrize(
    "dumped,stored,kernel",
    [
        (torch.bfloat16, torch.bfloat16, True),  # stored as dumped: the spool takes the dump's bytes by the kernel
        (torch.float32, torch.bfloat16, False),  # cast: written from the tensor
        (torch.bfloat16, torch.float8_e4m3fn, False),  # quantized, with scales: written from the tensor
    ],
)
def test_spool_file_takes_the_dumped_bytes_by_the_kernel_only_when_stored_as_dumped(
    dirs, tmp_path, dumped, stored, kernel
):
    """A sample of three chunks: when nothing converts its hidden states, the spool file's copy comes
    from the claimed dump files' ranges (block-aligned, so a reflink filesystem clones them), and
    the file is byte for byte the one written from the tensor."""
    import dataclasses

    from harvest.formats.spool import read_sample
    from harvest.formats.stformat import BLOCK, read_file_header
    from harvest.node.spooldir import SpoolBatch, spool_path

    dump, claimed = dirs
    hs = torch.randn(10, 2, 4).to(dumped)
    for a, b in [(0, 4), (4, 8), (8, 10)]:
        _dump(dump, a, b, hs=hs[a:b])
    ok, _ = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    s = assemble(ok[RID], SAMPLE, [2, 4], stored)
    assert bool(s.hidden_from) is kernel
    if kernel:
        assert [os.path.basename(p).split(".")[1] for p, _, _ in s.hidden_from] == ["0-4", "4-8", "8-10"]
        assert all(begin % BLOCK == 0 for _, begin, _ in s.hidden_from)
    files = {}
    for name, sample in (("kernel", s), ("tensor", dataclasses.replace(s, hidden_from=()))):
        d = tmp_path / name
        b = SpoolBatch(str(d), "r")
        n = b.add(sample)
        b.commit()
        with open(spool_path(str(d), s.id), "rb") as f:
            files[name] = f.read()
        assert n == len(files[name])
    assert files["kernel"] == files["tensor"]
    back = read_sample(spool_path(str(tmp_path / "kernel"), s.id))
    assert torch.equal(back.hidden_states.view(torch.uint8), s.hidden_states.view(torch.uint8))
    # The file records each tensor's crc32: the hidden states' combined from the engine's verified
    # sums of the three chunks where stored as dumped, the same numbers as summing the stored bytes
    assert (s.hidden_crc32 is not None) is kernel
    path = spool_path(str(tmp_path / "kernel"), s.id)
    spans, meta = read_file_header(path)
    assert json.loads(meta["crc32"]) == {
        name: zlib.crc32(files["kernel"][span.begin : span.end]) for name, span in spans.items()
    }
    assert sorted(spans) == sorted(
        ["hidden_states", "input_ids", "loss_mask"] + (["hidden_scale"] if not kernel and stored.itemsize == 1 else [])
    )


def test_dumps_on_another_filesystem_are_spooled_from_the_tensor(tmp_path, monkeypatch):
    """The usual GPU-node layout: dumps on tmpfs, the spool on a disk. The kernel would refuse to
    copy across, so the tensor (already read and checked) is written; the same file."""
    import dataclasses

    from harvest.node.spooldir import SpoolBatch, spool_path

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        need("/dev/shm on a filesystem of its own", "the test copies a dump across filesystems")
    dump = f"/dev/shm/harvest-test-{os.getpid()}-{os.urandom(4).hex()}"
    os.makedirs(os.path.join(dump, "claimed"))
    try:
        _dump(dump, 0, 10, hs=torch.randn(10, 2, 4).to(torch.bfloat16))
        ok, _ = claim(dump, os.path.join(dump, "claimed"), {RID: 10}, timeout=1)
        s = assemble(ok[RID], SAMPLE, [2, 4], torch.bfloat16)
        assert s.hidden_from
        monkeypatch.setattr(os, "copy_file_range", lambda *a: pytest.fail("the kernel was asked across filesystems"))
        files = []
        for name, sample in (("a", s), ("b", dataclasses.replace(s, hidden_from=()))):
            b = SpoolBatch(str(tmp_path / name), "r")
            b.add(sample)
            b.commit()
            with open(spool_path(str(tmp_path / name), s.id), "rb") as f:
                files.append(f.read())
        assert files[0] == files[1]
    finally:
        import shutil

        shutil.rmtree(dump, ignore_errors=True)


def test_chunks_of_mixed_dtypes_are_spooled_from_the_tensor(dirs):
    """torch.cat promotes a bf16 chunk beside an fp32 one: the stored fp32 bytes are not the dumped
    ones, so they come from the tensor, not the dump files."""
    dump, claimed = dirs
    _dump(dump, 0, 4, hs=HS[0:4].to(torch.bfloat16))
    _dump(dump, 4, 10, hs=HS[4:10])
    ok, _ = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    s = assemble(ok[RID], SAMPLE, [2, 4], torch.float32)
    assert s.hidden_from == () and s.hidden_states.dtype == torch.float32


@pytest.mark.parametrize("tensor", ["hidden_states", "input_ids"])
def test_a_dump_file_changed_after_the_engine_wrote_it_is_refused(dirs, tensor):
    """The engine records each tensor's crc32 in the dump's metadata; a byte flipped on the node's
    disk or in its memory after that fails the sample as a bad dump instead of being spooled."""
    from harvest.formats.stformat import read_file_header

    dump, claimed = dirs
    _dump(dump, 0, 4)
    _dump(dump, 4, 10)
    name = f"{RID}.4-10.safetensors"
    spans, meta = read_file_header(str(dump / name))
    span = spans[tensor]
    data = bytearray((dump / name).read_bytes())
    data[span.begin + 8] ^= 0x04  # a bit of the second row: a hidden value, or a token id
    (dump / name).write_bytes(bytes(data))
    recorded, found = json.loads(meta["crc32"])[tensor], zlib.crc32(data[span.begin : span.end])
    ok, _ = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    with pytest.raises(SampleFailure) as e:
        assemble(ok[RID], SAMPLE, [2, 4], torch.float32)
    assert (e.value.reason, e.value.message) == (
        "bad-dump",
        f"{claimed / name}: {tensor} has crc32 {found}, the engine recorded {recorded}: the file changed "
        "after the engine wrote it (a disk or memory fault on this node?)",
    )


def test_a_dump_file_without_checksums_is_refused(dirs):
    from safetensors.torch import save_file

    dump, claimed = dirs
    name = f"{RID}.0-10.safetensors"
    meta = {"format": "harvest-dump-1", "rid": RID, "start": "0", "end": "10", "capture_points": "[2, 4]", "model": "m"}
    save_file(
        {"hidden_states": HS, "input_ids": torch.tensor(SAMPLE.input_ids.astype(np.int64))},
        str(dump / name),
        metadata=meta,
    )
    ok, _ = claim(str(dump), str(claimed), {RID: 10}, timeout=1)
    with pytest.raises(SampleFailure) as e:
        assemble(ok[RID], SAMPLE, [2, 4], torch.float32)
    assert (e.value.reason, e.value.message) == ("bad-dump", f"{claimed / name}: no crc32 in its metadata")
