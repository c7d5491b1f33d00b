"""The frozen-node soak: many seeded trials of tests/support/freeze.py, each with a random freeze point
and occurrence, a random resume order, a random point at which the other collector stops (for
`before-fence`), an optional tend pass at a random moment, on a local output and on S3 alternately.

    python -m tests.support.freeze_soak --trials 100 [--seed 1]

starts its own Redis and moto S3 server, prints one line per trial that went wrong and the totals
(trials, froze, lost, doubled, unreadable, wrong, other, seconds); exits 1 unless all are clean.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid

import redis

from harvest.collector.faults import CRASH_POINTS
from tests.support.freeze import ORDERS, FreezeTrial

B_POINTS = ("recorded", "claimed", "packing", "uploaded")  # where the other collector waits for A, before its fence


def soak(
    conn: redis.Redis, redis_url: str, root: str, trials: int, seed: int, s3_url: str, log=lambda line: None
) -> dict[str, float]:
    """Run `trials` trials (odd ones to `s3_url`, a bucket, even ones to a local folder); returns the totals."""
    totals = dict.fromkeys(("trials", "froze", "lost", "doubled", "unreadable", "wrong", "other"), 0)
    t0 = time.monotonic()
    for i in range(trials):
        rng = random.Random(seed * 100_003 + i)
        conn.flushall()
        d = os.path.join(root, f"t{i}")
        os.makedirs(d)
        out = f"{s3_url}/t{i}" if i % 2 else f"file://{d}/out"
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(3, 9))]
        t = FreezeTrial(conn, redis_url, d, out, lengths, run=f"t{i}", shard_samples=rng.randint(1, 4))
        case = {
            "point": rng.choice(CRASH_POINTS),
            "order": rng.choice(ORDERS),
            "at": rng.randint(1, 2),
            "b_point": rng.choice(B_POINTS),
            "tend_at": rng.choice((None, "frozen", "resumed")),
        }
        try:
            t.execute(**case)
            found = t.problems()
        except Exception as e:  # noqa: BLE001 - a trial that cannot finish is counted, with why
            found = {"other": [f"{type(e).__name__}: {e}"]}
        totals["trials"] += 1
        totals["froze"] += t.froze
        bad = {k: v for k, v in found.items() if v}
        for k, v in bad.items():
            totals[k if k in totals else "other"] += len(v)
        if bad:
            log(f"trial {i} {out} {case}: {bad}")
    totals["seconds"] = round(time.monotonic() - t0, 1)
    return totals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    import boto3

    from harvest.cli.redisproc import RedisServer
    from tests.support.moto import moto_server

    with tempfile.TemporaryDirectory(prefix="freeze-soak-") as root:
        server = RedisServer(os.path.join(root, "redis")).start()
        moto, endpoint = moto_server()
        os.environ.update(
            {
                "HARVEST_S3_ENDPOINT": endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
            }
        )
        try:
            bucket = f"harvest-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            totals = soak(
                redis.Redis.from_url(server.url),
                server.url,
                root,
                args.trials,
                args.seed,
                f"s3://{bucket}",
                log=lambda line: print(line, flush=True),
            )
        finally:
            moto.terminate()
            moto.wait()
            server.stop()
    print(" ".join(f"{k} {v}" for k, v in totals.items()))
    return 0 if all(totals[k] == 0 for k in ("lost", "doubled", "unreadable", "wrong", "other")) else 1


if __name__ == "__main__":
    sys.exit(main())
