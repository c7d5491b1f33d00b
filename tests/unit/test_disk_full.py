"""A full dump dir pauses the engine's writer until workers claim files; nothing is lost.

Uses a real 1 MiB tmpfs (needs mount privileges, as root in a container; skipped otherwise)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from harvest.engines.dump_writer import DumpWriter
from harvest.formats.dump import Chunk, parse_chunk_name, read_chunk
from harvest.ids import rid_for


@pytest.mark.parametrize("tiny_fs", ["1m"], indirect=True)
def test_full_dump_dir_pauses_the_writer_and_loses_nothing(tiny_fs):
    # 12 chunks of ~256 KiB into 1 MiB: at most ~3 fit, so the writer must wait for the
    # "worker" below, which claims (reads, checks, deletes) files slowly.
    writer = DumpWriter(tiny_fs, [2, 4], "m", max_pending=2)
    chunks = []
    for i in range(12):
        hs = torch.full((512, 2, 64), float(i))
        chunks.append(Chunk(rid_for(f"{i:032x}", 1), 0, 512, torch.arange(512), hs))
    got: dict[str, float] = {}
    done = threading.Event()

    def worker() -> None:
        while not done.is_set() or os.listdir(tiny_fs):
            for name in sorted(os.listdir(tiny_fs)):
                if parse_chunk_name(name) is None:
                    continue
                path = os.path.join(tiny_fs, name)
                c = read_chunk(path)
                got[c.rid] = float(c.hidden_states[0, 0, 0])
                os.unlink(path)
                time.sleep(0.1)
            time.sleep(0.05)

    t = threading.Thread(target=worker)
    t.start()
    for c in chunks:
        writer.submit([c])  # blocks while the queue is full: the forward would wait here
    writer.flush()
    done.set()
    t.join(30)
    writer.close()
    assert got == {c.rid: float(i) for i, c in enumerate(chunks)}
    assert writer.errors == 0 and writer.full_waits > 0
    assert os.listdir(tiny_fs) == []  # no partial temporary files left by failed writes


@pytest.mark.parametrize("tiny_fs", ["1m"], indirect=True)
def test_gives_up_after_full_wait_and_counts_the_error(tiny_fs):
    writer = DumpWriter(tiny_fs, [2], "m", full_wait_s=0.5)
    big = Chunk(rid_for("a" * 32, 1), 0, 4096, torch.arange(4096), torch.zeros(4096, 1, 128))  # 2 MiB > the fs
    writer.submit([big])
    writer.flush()
    writer.close()
    assert writer.errors == 1 and writer.full_waits >= 2
    assert os.listdir(tiny_fs) == []
