"""How close to the disk and the store does the hidden-state data path run?

N synthetic dump files (one chunk per sample, `[T, K, H]` bf16, written beforehand as an engine
would) go through the real code: the worker's claim (rename) and assemble (read, verify
coverage, token ids and finiteness), the spool write (`SpoolBatch`: one flush per job of
`--job-size` samples), and the collector streaming shards out of the spool and committing them.
Each repeat measures, in the same run and on the same disk:

- file:// output: the whole data path against `cp` + `sync` of the same dump bytes (one durable
  write of each), and against two of them: with the spool on the output's filesystem, the
  floor of any path that makes the spool durable per job and then the shard, unless the
  filesystem clones blocks (XFS with reflink, btrfs: `--dir` on one, where the shard costs no
  data write);
- s3:// output (moto's server, in its own process): the collector's commit against a plain s3fs
  `put_file` of the same bytes (files of the shard size) to the same server;
- per-node packing with 1, 2 and 4 packers (`--pack-workers`), to file://;
- bytes this process wrote to the disk (`/proc/self/io` write_bytes) per byte of hidden state,
  for the S3 path (the node's disk only: the store is elsewhere) and for file:// (spool + output).

The file:// and s3:// paths run once per codec of `--codecs` (default none and blosc2-zstd: the
hidden states coded on the collector, harvest.formats.codec), each in every repeat, and the
medians' ratio of each codec to none is printed (goal >= 0.9).

Prints the medians of `--repeats` runs.

    python bench/datapath.py --samples 64 --tokens 1024 --hidden 2048
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import redis  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.collector.packers import Packers  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.formats.dump import Chunk, write_chunk  # noqa: E402
from harvest.ids import rid_for  # noqa: E402
from harvest.node.spooldir import SpoolBatch  # noqa: E402
from harvest.sample import Sample  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from harvest.storage import Location  # noqa: E402
from harvest.workers.claim import assemble, claim  # noqa: E402
from tests.support.moto import moto_server  # noqa: E402

POINTS = [2, 16, 29, 32]


def written_bytes() -> int:
    """Bytes this process has caused to be sent to the disk so far (dirtied pages count)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def sync() -> None:
    subprocess.run(["sync"], check=True)


def make_dumps(dump_dir: str, n: int, tokens: int, hidden: int, seed: int) -> tuple[list[Sample], dict[str, int], int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, len(POINTS), hidden, generator=g).to(torch.bfloat16)
    samples, wanted, nbytes = [], {}, 0
    for i in range(n):
        ids = np.arange(tokens, dtype=np.int64) + (seed * n + i) * tokens
        s = Sample.build(ids.tolist())
        rid = rid_for(s.id, 1)
        hs = base.roll(i, 0)  # distinct samples without paying for n random tensors
        write_chunk(dump_dir, Chunk(rid, 0, tokens, torch.from_numpy(ids), hs), POINTS, "bench")
        samples.append(s)
        wanted[rid] = tokens
        nbytes += hs.numel() * hs.element_size()
    return samples, wanted, nbytes


def cp_sync_seconds(src: str, dst: str) -> float:
    """`cp` + `sync` of the dump bytes: one durable write of every byte. `--reflink=never`: where
    the filesystem can share blocks, `cp` would otherwise clone them and write nothing at all."""
    sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", "--reflink=never", src, dst], check=True)
    sync()
    t = time.perf_counter() - t0
    shutil.rmtree(dst)
    sync()
    return t


class Trial:
    """One set of dumps through claim, assemble and spool; then one collector commit."""

    def __init__(self, base: str, conn: redis.Redis, args, seed: int, out_url: str, codec: str = "none") -> None:
        self.dir = os.path.join(base, f"t{seed}")
        self.dumps, self.claimed, self.spool = (os.path.join(self.dir, d) for d in ("dumps", "claimed", "spool"))
        for d in (self.dumps, self.claimed, self.spool):
            os.makedirs(d)
        made = make_dumps(self.dumps, args.samples, args.tokens, args.hidden, seed)
        self.samples, self.wanted, self.hidden_bytes = made
        self.cfg = publish_run(
            conn,
            RunConfig(
                run=f"bench{seed}",
                model="bench",
                capture_points=POINTS,
                hidden_size=args.hidden,
                out_url=out_url,
                storage_dtype="bf16",
                shard_bytes=args.shard_mb << 20,
                codec=codec,
            ),
        )
        self.conn, self.args = conn, args
        self.ledger = Ledger(conn, self.cfg.run)
        self.ledger.add_queued([s.id for s in self.samples])
        sync()

    def spool_all(self) -> None:
        """The workers' part: claim, assemble, one SpoolBatch per job, then mark spooled."""
        ok, failed = claim(self.dumps, self.claimed, self.wanted, timeout=10)
        assert not failed, failed
        by_rid = {rid_for(s.id, 1): s for s in self.samples}
        items = list(ok.items())
        for j in range(0, len(items), self.args.job_size):
            batch = SpoolBatch(self.spool, self.cfg.run)
            for rid, c in items[j : j + self.args.job_size]:
                batch.add(assemble(c, by_rid[rid], POINTS, self.cfg.torch_dtype))
                for p in c.paths:
                    os.unlink(p)
            batch.commit()
        self.ledger.mark_spooled([s.id for s in self.samples])

    def collect(self, pack_workers: int = 1) -> int:
        c = Packers(self.conn, self.cfg, self.spool, pack_workers, node="bench", max_wait=0)
        c.drain()
        assert self.ledger.counts()["done"] == self.args.samples
        return c.shards_committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--job-size", type=int, default=16, help="samples per worker job (one spool flush each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packers", default="1,2,4", help="pack-workers counts to compare (file:// output)")
    ap.add_argument("--codecs", default="none,blosc2-zstd", help="codecs of the file:// and s3:// paths (none first)")
    ap.add_argument(
        "--dir", default=None, help="Where to work (default: a temp dir); dumps, spool, output and cp share it."
    )
    args = ap.parse_args()

    base = tempfile.mkdtemp(prefix="harvest-datapath-", dir=args.dir)
    server = RedisServer(os.path.join(base, "redis"), appendonly=False).start()
    moto, endpoint = moto_server()
    os.environ.update(
        HARVEST_S3_ENDPOINT=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
    )
    rows: dict[str, list[float]] = {}
    seed = 0

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    try:
        conn = redis.Redis.from_url(server.url)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        for rep in range(args.repeats):
            for codec in args.codecs.split(","):
                # file:// : the whole data path against cp + sync of the same dump bytes
                seed += 1
                t = Trial(base, conn, args, seed, f"file://{os.path.join(base, f'out{seed}')}", codec)
                dump_bytes = sum(os.path.getsize(os.path.join(t.dumps, f)) for f in os.listdir(t.dumps))
                t_cp = cp_sync_seconds(t.dumps, os.path.join(base, "cp"))
                w0, t0 = written_bytes(), time.perf_counter()
                t.spool_all()
                t_spool = time.perf_counter()
                t.collect()
                sync()
                t_end = time.perf_counter()
                mib = t.hidden_bytes / 2**20
                add(f"{codec} file: data path MiB/s", mib / (t_end - t0))
                add(f"{codec} file: cp + sync MiB/s", dump_bytes / 2**20 / t_cp)
                add(f"{codec} file: ratio", (mib / (t_end - t0)) / (dump_bytes / 2**20 / t_cp))
                # The spool is durable per job and, here, on the output's disk: a path that keeps it writes
                # every byte twice where the filesystem cannot share blocks, so two cp + sync are its floor.
                add(f"{codec} file: ratio to 2 x (cp + sync)", (mib / (t_end - t0)) / (dump_bytes / 2**20 / (2 * t_cp)))
                add(f"{codec} file: spool s", t_spool - t0)
                add(f"{codec} file: pack + commit s", t_end - t_spool)
                add(f"{codec} file: disk bytes / hidden byte (spool + output)", (written_bytes() - w0) / t.hidden_bytes)
                shutil.rmtree(t.dir)
                shutil.rmtree(os.path.join(base, f"out{seed}"))

                # s3:// : the collector's commit against put_file of the same bytes in shard-sized files
                seed += 1
                t = Trial(base, conn, args, seed, f"s3://bench/out{seed}", codec)
                w0 = written_bytes()
                t.spool_all()
                sync()
                spool_written = written_bytes() - w0
                t0 = time.perf_counter()
                t.collect()
                t_s3 = time.perf_counter() - t0
                w_commit = written_bytes() - w0 - spool_written
                loc = Location.from_url(f"s3://bench/base{seed}")
                files, left = [], t.hidden_bytes
                while left > 0:
                    n = min(left, args.shard_mb << 20)
                    path = os.path.join(t.dir, f"plain{len(files)}")
                    with open(path, "wb") as f:
                        f.write(os.urandom(n))
                    files.append(path)
                    left -= n
                sync()
                t0 = time.perf_counter()
                for i, path in enumerate(files):
                    loc.fs.put_file(path, loc.path(f"plain{i}"))
                t_put = time.perf_counter() - t0
                add(f"{codec} s3: commit MiB/s", t.hidden_bytes / 2**20 / t_s3)
                add(f"{codec} s3: put_file MiB/s", t.hidden_bytes / 2**20 / t_put)
                add(f"{codec} s3: ratio", t_put / t_s3)
                add(f"{codec} s3: disk bytes / hidden byte (node)", (spool_written + w_commit) / t.hidden_bytes)
                shutil.rmtree(t.dir)

            # packers: the collector alone, to file://, with 1, 2, 4 packers
            for p in [int(x) for x in args.packers.split(",") if x]:
                seed += 1
                t = Trial(base, conn, args, seed, f"file://{os.path.join(base, f'out{seed}')}")
                t.spool_all()
                sync()
                t0 = time.perf_counter()
                t.collect(pack_workers=p)
                sync()
                add(f"pack {p}: MiB/s", t.hidden_bytes / 2**20 / (time.perf_counter() - t0))
                shutil.rmtree(t.dir)
                shutil.rmtree(os.path.join(base, f"out{seed}"))
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
        print(
            f"{args.samples} samples of [{args.tokens}, {len(POINTS)}, {args.hidden}] bf16 "
            f"({args.samples * args.tokens * len(POINTS) * args.hidden * 2 / 2**20:.0f} MiB of hidden states), "
            f"jobs of {args.job_size}, shards of {args.shard_mb} MiB; medians of {args.repeats}:"
        )
        for key, vals in rows.items():
            print(f"  {key:50s} {statistics.median(vals):9.2f}   (runs: {', '.join(f'{v:.2f}' for v in vals)})")
        codecs = args.codecs.split(",")
        for codec in codecs[1:]:
            for key in ("file: data path MiB/s", "s3: commit MiB/s"):
                ratio = statistics.median(rows[f"{codec} {key}"]) / statistics.median(rows[f"{codecs[0]} {key}"])
                print(f"  {codec} / {codecs[0]}, {key.split(' MiB')[0]}: {ratio:.2f}")
        for p in [int(x) for x in args.packers.split(",") if x][1:]:
            one = statistics.median(rows["pack 1: MiB/s"])
            print(f"  packers {p} / 1: {statistics.median(rows[f'pack {p}: MiB/s']) / one:.2f}")
    finally:
        moto.terminate()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
