"""Does packing the next shard while the last one uploads pay? The collector to S3, both ways.

The same spooled samples are committed to an S3 server (moto's, in its own process on this
machine) by (a) the collector one shard at a time (record, pack, upload, index, then the next:
`Collector.step`), and (b) its run loop, which uploads shard N on a thread while packing N+1
(`collector.collector.Overlap`). Rounds alternate (a) and (b); prints MiB/s of each and (b)/(a).
Against a real object store the upload is network-bound and the pack disk-bound, so the
overlap hides the shorter of the two; here both compete for the same 2 cores, so the figure
is a floor.

    python bench/upload_overlap.py --samples 48 --tokens 512 --hidden 2048 --shard-mb 48
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from collector.collector import Collector  # noqa: E402
from harvest.cli.redisproc import RedisServer, free_port  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.formats.spool import SpooledSample, write_sample  # noqa: E402
from harvest.ids import sample_id  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402

POINTS = [2, 16, 29, 32]


def spool(spool_dir: str, cfg: RunConfig, n: int, tokens: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, len(POINTS), cfg.hidden_size, generator=g).to(torch.bfloat16)
    ids = []
    for i in range(n):
        tok = torch.arange(tokens, dtype=torch.int32) + (seed * n + i) * tokens
        mask = torch.ones(tokens, dtype=torch.uint8)
        sid = sample_id(tok.numpy(), mask.numpy())
        write_sample(spool_dir, SpooledSample(sid, tok, mask, base.roll(i, 0)), cfg.run)
        ids.append(sid)
    return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shard-mb", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="harvest-upload-")
    port = free_port()
    moto = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"HARVEST_S3_ENDPOINT": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    server = RedisServer(os.path.join(tmp, "redis"), appendonly=False).start()
    try:
        import boto3
        import redis

        for _ in range(100):
            try:
                boto3.client("s3", endpoint_url=os.environ["HARVEST_S3_ENDPOINT"]).create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        conn = redis.Redis.from_url(server.url)
        rates: dict[str, list[float]] = {"one at a time": [], "overlapped": []}
        mib = 0.0
        for r in range(args.rounds):
            for mode in (list(rates) if r % 2 == 0 else list(reversed(rates))):
                run = f"r{r}{'o' if mode == 'overlapped' else 's'}"
                cfg = publish_run(conn, RunConfig(run=run, model="bench", capture_points=POINTS, hidden_size=args.hidden,
                                                  out_url="s3://bench/out", storage_dtype="bf16",
                                                  shard_bytes=args.shard_mb << 20))
                spool_dir = os.path.join(tmp, f"spool-{run}")
                ids = spool(spool_dir, cfg, args.samples, args.tokens, seed=r)
                ledger = Ledger(conn, run)
                ledger.add_queued(ids)
                ledger.mark_spooled(ids)
                mib = sum(os.path.getsize(os.path.join(spool_dir, f)) for f in os.listdir(spool_dir)
                          if f.endswith(".safetensors")) / 2**20
                c = Collector(conn, cfg, spool_dir, node="bench", max_wait=3600)
                t0 = time.perf_counter()
                if mode == "overlapped":
                    c.run(should_stop=lambda: ledger.counts()["spooled"] == 0, poll=0.02)
                else:
                    while c.step(force=True):
                        pass
                dt = time.perf_counter() - t0
                assert ledger.counts()["done"] == args.samples, ledger.counts()
                rates[mode].append(mib / dt)
                print(f"round {r} {mode:13s}: {c.shards_committed} shards, {mib:.0f} MiB in {dt:.2f} s = {mib / dt:.0f} MiB/s",
                      flush=True)
        a, b = (statistics.median(v) for v in rates.values())
        print(f"\nmedian: one at a time {a:.0f} MiB/s, overlapped {b:.0f} MiB/s, ratio {b / a:.2f}")
    finally:
        server.stop()
        moto.terminate()
        moto.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
