"""What the per-sample claims (harvest.formats.claims) cost a commit, against the commit itself.

A collector claims every sample of a shard in storage (one conditional create each, 16 in
flight) before it packs the shard. This commits `--shards` shards of `--samples` synthetic
samples each (`--tokens` tokens x 4 capture points x `--hidden`, bf16) through the real
collector, to a local folder and to moto's S3 server (in its own process), and prints per
output the median time of the claim step and of the rest of the commit (pack, publish, index,
ledger), their ratio, and the requests each takes (claims: one per sample; the shard: its
multipart parts). Same run, same disk and server: the ratio is the figure.

    python bench/claims.py --shards 5 --samples 16 --tokens 512 --hidden 1024
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import redis  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.collector.collector import Collector  # noqa: E402
from harvest.multipart import DEFAULT_PART_BYTES  # noqa: E402
from harvest.state.ledger import Ledger  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402
from tests.support.synth import make_config, spool_samples  # noqa: E402


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    import boto3

    os.environ.update(
        {
            "HARVEST_S3_ENDPOINT": url,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_REGION": "us-east-1",
        }
    )
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    for _ in range(100):
        try:
            s3.create_bucket(Bucket="bench")
            return proc, "s3://bench/out"
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def _measure(conn: redis.Redis, root: str, out_url: str, args) -> tuple[list[float], list[float]]:
    conn.flushdb()
    cfg = publish_run(conn, make_config(out_url, hidden=args.hidden))
    claim_s, rest_s = [], []
    for i in range(args.shards):
        spool = os.path.join(root, f"spool{i}")
        ids = [s.id for s in spool_samples(spool, cfg, [args.tokens] * args.samples, seed0=1000 * i)]
        ledger = Ledger(conn, cfg.run)
        ledger.add_queued(ids)
        ledger.mark_spooled(ids)
        c = Collector(conn, cfg, spool, node=f"n{i}")
        t0 = time.perf_counter()
        plan = c.plan(c.choose(force=True))
        c.record(plan)
        t1 = time.perf_counter()
        assert c.claim(plan)
        t2 = time.perf_counter()
        c.publish(plan, c.pack(plan))
        c.finish(plan)
        t3 = time.perf_counter()
        claim_s.append(t2 - t1)
        rest_s.append((t1 - t0) + (t3 - t2))
    return claim_s, rest_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16, help="samples per shard")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    shard_mb = args.samples * args.tokens * 4 * args.hidden * 2 / 2**20
    parts = -(-int(shard_mb * 2**20) // DEFAULT_PART_BYTES)
    print(
        f"{args.shards} shards of {args.samples} samples x {args.tokens} tokens x 4 x {args.hidden} bf16 "
        f"= {shard_mb:.0f} MiB a shard"
    )
    moto, s3_url = _moto()
    try:
        with tempfile.TemporaryDirectory() as root, RedisServer(os.path.join(root, "redis")) as server:
            conn = redis.Redis.from_url(server.url)
            for name, url in (("file", f"file://{root}/out"), ("s3 (moto)", s3_url)):
                claim_s, rest_s = _measure(conn, os.path.join(root, name.split()[0]), url, args)
                c, r = statistics.median(claim_s), statistics.median(rest_s)
                reqs = (
                    f"{args.samples} claim PUTs vs {parts} part PUTs + 2"
                    if name != "file"
                    else f"{args.samples} links vs 1 shard file"
                )
                print(
                    f"  {name:10s} claims {c * 1e3:7.1f} ms   rest of the commit {r * 1e3:8.1f} ms   "
                    f"claims / commit {c / (c + r):6.1%}   ({reqs})"
                )
    finally:
        moto.terminate()
        moto.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
