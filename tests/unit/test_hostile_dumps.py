"""Bad files in the dump directory: each fails only its sample, with a reason naming it, and
nothing is followed, read or written outside the directory."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from harvest.formats.dump import Chunk, chunk_name, encode_chunk, write_chunk
from harvest.ids import rid_for
from harvest.node.paths import UnsafePath, private_dir
from harvest.sample import Sample
from harvest.state.failures import SampleFailure
from harvest.workers.claim import assemble, claim

SAMPLE = Sample.build(list(range(10, 20)))
RID = rid_for(SAMPLE.id, 1)
HS = torch.arange(10 * 2 * 4, dtype=torch.float32).reshape(10, 2, 4)
GOOD = Sample.build(list(range(40, 50)))
GOOD_RID = rid_for(GOOD.id, 1)


def _chunk(rid=RID, sample=SAMPLE, start=0, end=10) -> Chunk:
    return Chunk(rid, start, end, torch.tensor(sample.input_ids[start:end].astype(np.int64)), HS[start:end])


def _verify(dump, claimed) -> dict[str, str]:
    """Claim and verify SAMPLE and GOOD; the reason (or 'ok') for each, with the message for SAMPLE."""
    write_chunk(str(dump), _chunk(GOOD_RID, GOOD), [2, 4], "m")
    ok, failed = claim(str(dump), str(claimed), {RID: 10, GOOD_RID: 10}, timeout=0.2)
    out = {}
    for rid, s in ((RID, SAMPLE), (GOOD_RID, GOOD)):
        if rid in failed:
            out[rid] = f"{failed[rid].reason}: {failed[rid].message}"
            continue
        try:
            assemble(ok[rid], s, [2, 4], torch.float32)
            out[rid] = "ok"
        except SampleFailure as e:
            out[rid] = f"{e.reason}: {e.message}"
    return out


@pytest.fixture
def dirs(tmp_path):
    dump, claimed = tmp_path / "dump", tmp_path / "claimed"
    dump.mkdir()
    claimed.mkdir()
    return dump, claimed


def test_truncated_chunk(dirs):
    dump, claimed = dirs
    data = encode_chunk(_chunk(), [2, 4], "m")
    (dump / chunk_name(RID, 0, 10)).write_bytes(data[: len(data) - 7])
    out = _verify(dump, claimed)
    assert out[GOOD_RID] == "ok"
    assert out[RID].startswith(f"bad-dump: {claimed}/{chunk_name(RID, 0, 10)}: unreadable dump file (")


def test_header_claiming_a_huge_size(dirs):
    dump, claimed = dirs
    (dump / chunk_name(RID, 0, 10)).write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    out = _verify(dump, claimed)
    assert out[GOOD_RID] == "ok"
    assert out[RID].startswith("bad-dump: ") and "unreadable dump file" in out[RID]


def test_garbage_bytes(dirs):
    dump, claimed = dirs
    (dump / chunk_name(RID, 0, 10)).write_bytes(os.urandom(4096))
    out = _verify(dump, claimed)
    assert out[GOOD_RID] == "ok" and "unreadable dump file" in out[RID]


def test_symlinked_chunk_is_refused_not_followed(dirs, tmp_path):
    dump, claimed = dirs
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(encode_chunk(_chunk(), [2, 4], "m"))  # a perfectly valid chunk, but not in the dump dir
    os.symlink(elsewhere, dump / chunk_name(RID, 0, 10))
    out = _verify(dump, claimed)
    assert out[GOOD_RID] == "ok"
    assert (
        out[RID]
        == f"bad-dump: {claimed}/{chunk_name(RID, 0, 10)}: {claimed}/{chunk_name(RID, 0, 10)} is a symlink; refused"
    )
    assert elsewhere.exists()  # the link's target is never touched


def test_metadata_naming_another_path(dirs):
    dump, claimed = dirs
    evil = _chunk()
    evil.rid = "hv-../../etc/passwd-1"
    (dump / chunk_name(RID, 0, 10)).write_bytes(encode_chunk(evil, [2, 4], "m"))
    out = _verify(dump, claimed)
    assert out[GOOD_RID] == "ok"
    assert "file name says" in out[RID] and "metadata says ('hv-../../etc/passwd-1', 0, 10)" in out[RID]


def test_files_that_are_not_chunks_are_ignored(dirs):
    dump, claimed = dirs
    (dump / "hv-..%2F..%2Fx.0-10.safetensors").write_bytes(b"x")
    (dump / "notes.txt").write_text("hello")
    write_chunk(str(dump), _chunk(), [2, 4], "m")
    out = _verify(dump, claimed)
    assert out == {RID: "ok", GOOD_RID: "ok"}
    assert sorted(os.listdir(dump)) == ["hv-..%2F..%2Fx.0-10.safetensors", "notes.txt"]


def test_private_dir_is_0700_and_refuses_symlinks(tmp_path):
    d = private_dir(str(tmp_path / "spool"), "spool dir")
    assert os.stat(d).st_mode & 0o777 == 0o700
    os.symlink(tmp_path / "spool", tmp_path / "link")
    with pytest.raises(UnsafePath, match=r"^dump dir .*/link is a symlink; refusing to follow it"):
        private_dir(str(tmp_path / "link"), "dump dir")
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafePath, match=r"^dump dir .*/file exists and is not a directory$"):
        private_dir(str(tmp_path / "file"), "dump dir")
