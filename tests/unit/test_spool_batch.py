"""A job's spool files are made durable together and appear only at commit (harvest.node.spooldir.SpoolBatch)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from harvest.formats.spool import SpooledSample, read_sample
from harvest.node.spooldir import TEMP_MAX_AGE_S, SpoolBatch, list_spooled, spool_identity
from harvest.storage import TEMP_PREFIX


def _sample(i: int, tokens: int = 16, hidden: int = 32) -> SpooledSample:
    g = torch.Generator().manual_seed(i)
    return SpooledSample(
        f"{i:032x}",
        torch.arange(tokens, dtype=torch.int32) + i,
        (torch.arange(tokens) % 2).to(torch.uint8),
        torch.randn(tokens, 2, hidden, generator=g).to(torch.bfloat16),
    )


def test_files_appear_only_at_commit_and_read_back_exactly(tmp_path):
    spool = str(tmp_path)
    batch = SpoolBatch(spool, "r")
    samples = [_sample(i) for i in range(3)]
    sizes = [batch.add(s) for s in samples]
    assert list_spooled(spool) == []  # nothing a collector could pick before the commit
    assert sorted(n.startswith(TEMP_PREFIX) for n in os.listdir(spool)) == [True] * 3
    batch.commit()
    listed = list_spooled(spool)
    assert [sid for sid, _, _ in listed] == sorted(s.id for s in samples)
    assert sorted(size for _, _, size in listed) == sorted(sizes)
    assert not [n for n in os.listdir(spool) if n.startswith(TEMP_PREFIX)]
    for s in samples:
        back = read_sample(os.path.join(spool, f"{s.id}.safetensors"))
        assert back.id == s.id and torch.equal(back.hidden_states, s.hidden_states)
        assert torch.equal(back.input_ids, s.input_ids) and torch.equal(back.loss_mask, s.loss_mask)


def test_abort_leaves_nothing(tmp_path):
    batch = SpoolBatch(str(tmp_path), "r")
    batch.add(_sample(1))
    batch.abort()
    assert os.listdir(tmp_path) == []


def test_a_killed_workers_temp_files_go_by_age_when_the_spool_is_next_opened(tmp_path):
    spool = str(tmp_path)
    spool_identity(spool)
    batch = SpoolBatch(spool, "r")
    batch.add(_sample(1))
    batch.add(_sample(2))  # the worker dies here: never committed
    old, fresh = sorted(n for n in os.listdir(spool) if n.startswith(TEMP_PREFIX))
    past = time.time() - TEMP_MAX_AGE_S - 5
    os.utime(os.path.join(spool, old), (past, past))
    spool_identity(spool)  # the next worker or collector to open the spool
    names = os.listdir(spool)
    assert old not in names and fresh in names  # a fresh one may be another live worker's
    assert list_spooled(spool) == []


@pytest.mark.parametrize("tiny_fs", ["256k"], indirect=True)
def test_disk_full_mid_batch_keeps_the_complete_files_and_leaves_no_partial_one(tiny_fs):
    batch = SpoolBatch(tiny_fs, "r")
    added = []
    with pytest.raises(OSError):
        for i in range(100):  # ~70 KiB each into 256 KiB
            batch.add(_sample(i, tokens=128, hidden=128))
            added.append(f"{i:032x}")
    assert 1 <= len(added) < 100
    batch.commit()
    assert [sid for sid, _, _ in list_spooled(tiny_fs)] == sorted(added)
    assert not [n for n in os.listdir(tiny_fs) if n.startswith(TEMP_PREFIX)]
