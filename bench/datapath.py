"""How close to `cp` does the hidden-state data path run? Claim, spool, pack, commit vs cp.

N synthetic dump files (one chunk per sample, `[T, K, H]` bf16, written beforehand as an
engine would) go through the real code: the worker's claim (rename) and assemble (read,
verify coverage, token ids and finiteness), the spool write (atomic, fsynced), and the
collector packing shards by streaming spool bytes and committing them to a `file://` output
(rename into place, index, ledger on a private redis-server). The same dump bytes are then
copied with `cp` on the same disk, in the same run. Prints both throughputs and the ratio
(goal >= 0.5), also against `cp` followed by `sync` since the data path fsyncs what it writes.

    python bench/datapath.py --samples 32 --tokens 1024 --hidden 2048
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from collector.collector import Collector  # noqa: E402
from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.formats.dump import Chunk, write_chunk  # noqa: E402
from harvest.formats.spool import write_sample  # noqa: E402
from harvest.ids import rid_for  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.payload import Sample  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from workers.claim import assemble, claim  # noqa: E402

POINTS = [2, 16, 29, 32]


def make_dumps(dump_dir: str, n: int, tokens: int, hidden: int) -> tuple[list[Sample], dict[str, int], int]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, len(POINTS), hidden, generator=g).to(torch.bfloat16)
    samples, wanted, nbytes = [], {}, 0
    for i in range(n):
        ids = np.arange(tokens, dtype=np.int64) + i * tokens
        s = Sample.build(ids.tolist())
        rid = rid_for(s.id, 1)
        hs = base.roll(i, 0)  # distinct samples without paying for n random tensors
        write_chunk(dump_dir, Chunk(rid, 0, tokens, torch.from_numpy(ids), hs), POINTS, "bench")
        samples.append(s)
        wanted[rid] = tokens
        nbytes += hs.numel() * hs.element_size()
    return samples, wanted, nbytes


def copy_times(src: str, dst: str) -> tuple[float, float]:
    """(seconds of `cp -r src dst`, seconds of the same followed by `sync`); dst is removed."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    t_cp = time.perf_counter() - t0
    subprocess.run(["sync"], check=True)
    t_sync = time.perf_counter() - t0
    shutil.rmtree(dst)
    subprocess.run(["sync"], check=True)
    return t_cp, t_sync


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--dir", default=None, help="Where to work (default: a temp dir); dumps, spool, output and cp share it.")
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="harvest-datapath-", dir=args.dir)
    dumps, claimed, spool = (os.path.join(base, d) for d in ("dumps", "claimed", "spool"))
    cp_dst, out = os.path.join(base, "cp"), os.path.join(base, "out")
    for d in (dumps, claimed, spool):
        os.makedirs(d)
    server = RedisServer(os.path.join(base, "redis"), appendonly=False).start()
    try:
        import redis

        conn = redis.Redis.from_url(server.url)
        samples, wanted, hidden_bytes = make_dumps(dumps, args.samples, args.tokens, args.hidden)
        dump_bytes = sum(os.path.getsize(os.path.join(dumps, f)) for f in os.listdir(dumps))
        subprocess.run(["sync"], check=True)
        print(f"{args.samples} dumps of [{args.tokens}, {len(POINTS)}, {args.hidden}] bf16: "
              f"{hidden_bytes / 2**20:.0f} MiB of hidden states ({dump_bytes / 2**20:.0f} MiB of files) in {base}")

        t_cp, t_cp_sync = copy_times(dumps, cp_dst)
        cfg = publish_run(conn, RunConfig(run="bench", model="bench", capture_points=POINTS, hidden_size=args.hidden,
                                          out_url=f"file://{out}", storage_dtype="bf16", shard_bytes=args.shard_mb << 20))
        ledger = Ledger(conn, cfg.run)
        ledger.add_queued([s.id for s in samples])
        by_rid = {rid_for(s.id, 1): s for s in samples}
        t0 = time.perf_counter()
        ok, failed = claim(dumps, claimed, wanted, timeout=10)
        assert not failed, failed
        t_claim = time.perf_counter()
        for rid, c in ok.items():
            s = assemble(c, by_rid[rid], POINTS, cfg.torch_dtype)
            write_sample(spool, s, cfg.run)
            for p in c.paths:
                os.unlink(p)
        ledger.mark_spooled([s.id for s in samples])
        t_spool = time.perf_counter()
        collector = Collector(conn, cfg, spool, node="bench", max_wait=0)
        while collector.step(force=True):
            pass
        subprocess.run(["sync"], check=True)  # the data path fsyncs as it goes: this is ~free
        t_end = time.perf_counter()
        assert ledger.counts()["done"] == args.samples
        # cp again, now that the disk has absorbed the data path's writes: take the faster
        shutil.copytree(out, os.path.join(base, "dumps2"))  # any files of the same size will do
        t_cp2, t_cp_sync2 = copy_times(os.path.join(base, "dumps2"), cp_dst)
        t_cp, t_cp_sync = min(t_cp, t_cp2), min(t_cp_sync, t_cp_sync2)

        t_path = t_end - t0
        mib = hidden_bytes / 2**20
        path_rate, cp_rate, cps_rate = mib / t_path, dump_bytes / 2**20 / t_cp, dump_bytes / 2**20 / t_cp_sync
        print(f"data path: {t_path:.2f} s = {path_rate:.0f} MiB/s "
              f"(claim {t_claim - t0:.2f} s, assemble+spool {t_spool - t_claim:.2f} s, "
              f"pack+commit {t_end - t_spool:.2f} s, {collector.shards_committed} shards)")
        print(f"cp:        {t_cp:.2f} s = {cp_rate:.0f} MiB/s;  cp + sync: {t_cp_sync:.2f} s = {cps_rate:.0f} MiB/s")
        print(f"ratio data path / cp: {path_rate / cp_rate:.2f};  data path / (cp + sync): {path_rate / cps_rate:.2f}  (goal >= 0.5)")
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
