"""On a filesystem that shares blocks between files, the node writes each hidden byte once.

The worker's spool file takes a dump's hidden states, and the collector's local shard the spool
files', by `copy_file_range` (harvest.formats.filecopy); every file starts its tensor data on a
4 KiB block, so on XFS with reflink those are block clones. Measured here by the filesystem's own
block count on a real XFS (a loop mount of an image file: `.ci/run` installs xfsprogs; the test
skips, saying why, where it cannot mount one) against the same steps on the test's ordinary
filesystem, where the same bytes cost a full copy each time. The shard must read back exactly."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from harvest.collector.collector import Collector
from harvest.formats.dump import Chunk, write_chunk
from harvest.ids import rid_for
from harvest.node.spooldir import SpoolBatch
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.workers.claim import assemble, claim
from tests.support.need import need
from tests.support.synth import make_config

POINTS, HIDDEN, TOKENS = [2, 4, 5, 8], 1024, 256  # 2 MiB of bf16 hidden states a sample


@pytest.fixture
def xfs(tmp_path):
    """A real XFS with reflink, loop-mounted from an image file, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None:
        need("root and mkfs.xfs (xfsprogs)", "the test mounts a reflink XFS (.ci/run: apt-get install xfsprogs)")
    image, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    with open(image, "wb") as f:
        f.truncate(512 << 20)
    mnt.mkdir()
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    res = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        need("a loop-mounted XFS", f"cannot loop-mount an XFS image here: {res.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _used(path: str) -> int:
    os.sync()
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _through_the_node(base: str, conn, run: str) -> tuple[dict[str, int], int, list, list[torch.Tensor]]:
    """Dumps -> claim -> spool -> shard on `base`, with the filesystem's used bytes after each step."""
    dumps, claimed, spool = (os.path.join(base, run, d) for d in ("dumps", "claimed", "spool"))
    for d in (dumps, claimed, spool):
        os.makedirs(d)
    cfg = publish_run(conn, make_config(f"file://{base}/{run}/out", run=run, hidden=HIDDEN))
    g = torch.Generator().manual_seed(7)
    samples, hidden, wanted = [], [], {}
    for i in range(8):
        ids = np.arange(TOKENS, dtype=np.int64) + 1000 * i
        s = Sample.build(ids.tolist())
        hs = torch.randn(TOKENS, len(POINTS), HIDDEN, generator=g).to(torch.bfloat16)
        cuts = [0, 128, TOKENS] if i % 2 else [0, TOKENS]  # half the samples in two prefill chunks
        for a, b in zip(cuts, cuts[1:], strict=False):
            write_chunk(dumps, Chunk(rid_for(s.id, 1), a, b, torch.from_numpy(ids[a:b]), hs[a:b]), POINTS, "m")
        samples.append(s)
        hidden.append(hs)
        wanted[rid_for(s.id, 1)] = TOKENS
    nbytes = sum(h.numel() * h.element_size() for h in hidden)
    ledger = Ledger(conn, run)
    ledger.add_queued([s.id for s in samples])
    used = {"dumps": _used(base)}
    ok, failed = claim(dumps, claimed, wanted, timeout=10)
    assert not failed
    batch = SpoolBatch(spool, run)
    by_rid = {rid_for(s.id, 1): s for s in samples}
    for rid, c in ok.items():
        sample = assemble(c, by_rid[rid], POINTS, cfg.torch_dtype)
        assert sample.hidden_from  # stored as dumped: the kernel copies
        batch.add(sample)
    batch.commit()
    used["spooled"] = _used(base)  # the dumps are still there
    for c in ok.values():
        for p in c.paths:
            os.unlink(p)
    used["claimed gone"] = _used(base)
    ledger.mark_spooled([s.id for s in samples])
    col = Collector(conn, cfg, spool, node="n", max_wait=0)
    plan = col.plan(col.choose(force=True))
    col.record(plan)
    assert col.claim(plan)
    packed = col.pack(plan)
    used["packed"] = _used(base)  # the spool files are still there
    col.publish(plan, packed)
    col.finish(plan)
    assert ledger.counts()["done"] == 8
    return used, nbytes, samples, hidden


def _check_shard(base: str, run: str, samples, hidden) -> None:
    reader = RunReader(f"{base}/{run}/out/{run}")
    assert len(reader) == 8
    for s, hs in zip(samples, hidden, strict=False):
        got = reader.get(s.id)
        assert got["input_ids"].tolist() == s.input_ids.tolist()
        assert torch.equal(got["hidden_states"].view(torch.int16), hs.view(torch.int16))


def test_on_reflink_xfs_spool_and_shard_are_clones_not_copies(xfs, tmp_path, conn):
    used, nbytes, samples, hidden = _through_the_node(xfs, conn, "xfs")
    print(
        f"\nXFS: spooling took {used['spooled'] - used['dumps']} bytes, packing {used['packed'] - used['claimed gone']}, "
        f"for {nbytes} bytes of hidden states"
    )
    assert used["spooled"] - used["dumps"] < nbytes // 10  # the spool shares the dumps' blocks
    assert used["packed"] - used["claimed gone"] < nbytes // 10  # the shard shares the spool's blocks
    _check_shard(xfs, "xfs", samples, hidden)

    # The same steps on an ordinary filesystem (the test's own, ext4 here) copy every byte twice.
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    probe = subprocess.run(["stat", "-f", "-c", "%T", plain], capture_output=True, text=True).stdout.strip()
    if probe in ("xfs", "btrfs"):
        return  # the test's filesystem clones too: no contrast to draw
    used, nbytes, samples, hidden = _through_the_node(plain, conn, "plain")
    assert used["spooled"] - used["dumps"] >= nbytes * 9 // 10
    assert used["packed"] - used["claimed gone"] >= nbytes * 9 // 10
    _check_shard(plain, "plain", samples, hidden)
