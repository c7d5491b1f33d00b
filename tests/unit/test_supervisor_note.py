"""supervisor.log on a real full filesystem (a 1 MiB tmpfs; needs mount privileges, skipped
otherwise): a line that does not fit is kept, not raised, and written before the next one that fits."""

from __future__ import annotations

import errno
import os

import pytest

from harvest.cli.supervisor import Supervisor


def _fill(fs: str) -> str:
    filler = os.path.join(fs, "filler")
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    return filler


@pytest.mark.parametrize("tiny_fs", ["1m"], indirect=True)
def test_a_note_on_a_full_disk_is_kept_and_written_once_there_is_room(tiny_fs):
    sup = Supervisor(tiny_fs)
    log = os.path.join(tiny_fs, "supervisor.log")
    filler = _fill(tiny_fs)
    sup.note("paused: the disk is full")  # no room for supervisor.log's first block: kept
    sup.note("still full")
    assert not os.path.exists(log) or os.path.getsize(log) == 0
    os.unlink(filler)
    sup.note("resumed")
    with open(log) as f:
        said = [line.split(" ", 1)[1] for line in f.read().splitlines()]
    assert said == ["paused: the disk is full", "still full", "resumed"]
