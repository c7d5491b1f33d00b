"""Long fault-injection soak: many seeded trials of tests/support/chaos.py, then the totals.

    python bench/chaos.py --trials 100 [--samples 40] [--kills 4] [--s3-every 3] [--nodes 2]

Each trial is a real run (private Redis with AOF, reference engine, workers, collector,
producer as processes) with `--kills` SIGKILLs at random moments; every third trial (by
default) writes to a moto S3 server and runs with engine faults switched on. The faults are
SIGKILLs of every process kind, Redis killed and restarted, and Redis rolled back (`rollback`:
killed with its AOF cut back by 1 or 2 s, what `appendfsync everysec` may lose). Prints one line
a trial and the totals: kills per process kind, samples lost and doubled and runs unreadable (all must be 0),
failures by reason. With `--nodes N` (N >= 2) each trial runs N nodes (engine, workers and
collector with their own spool) and `node` faults are among the kills: a whole node lost, back
within the spool grace, after it, or never; the totals add how lost nodes came back and how
many spools were reclaimed. Exit status 1 if any trial lost, doubled or misplaced anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harvest.cli.demo import build_tiny_model  # noqa: E402
from tests.support.chaos import Trial  # noqa: E402

FAULTS = "http500:2,nan:1,bad-ids:1,cached:1,drop-chunk:1"


def s3_server() -> tuple[object, str]:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from harvest.cli.redisproc import free_port

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ.update(
        {
            "HARVEST_S3_ENDPOINT": url,
            "AWS_ACCESS_KEY_ID": "chaos",
            "AWS_SECRET_ACCESS_KEY": "chaos",
            "AWS_REGION": "us-east-1",
        }
    )
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="chaos")
    return server, "s3://chaos"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="workers per node")
    ap.add_argument("--nodes", type=int, default=1, help="nodes per trial; 2 or more adds node faults")
    ap.add_argument(
        "--s3-every", type=int, default=3, help="every Nth trial writes to S3 with engine faults on (0: never)"
    )
    ap.add_argument(
        "--s3-phase",
        type=int,
        default=0,
        help="the first trial counts as trial K of a longer soak (rerun a slice of it with the same backends)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the folders of failed trials")
    ap.add_argument(
        "--deadline",
        type=float,
        default=240.0,
        help="seconds a trial may take before it counts as stalled (more on a loaded machine; +60 per extra node)",
    )
    args = ap.parse_args()

    model = build_tiny_model()
    server, bucket = s3_server() if args.s3_every else (None, None)
    kills, exits, reasons, returns = Counter(), Counter(), Counter(), Counter()
    lost = doubled = unreadable = bad_trials = done = failed = reclaimed = revoked = 0
    t0 = time.monotonic()
    try:
        for i in range(args.trials):
            seed = args.first_seed + i
            s3 = bool(args.s3_every) and (i + args.s3_phase) % args.s3_every == args.s3_every - 1
            root = tempfile.mkdtemp(prefix=f"chaos-{seed}-")
            r = Trial(
                root,
                model,
                seed,
                samples=args.samples,
                kills=args.kills,
                workers=args.workers,
                out_url=bucket if s3 else None,
                env={"HARVEST_ENGINE_FAULTS": FAULTS} if s3 else None,
                nodes=args.nodes,
                deadline_s=args.deadline + 60 * (args.nodes - 1),
            ).execute()
            print(("s3  " if s3 else "file ") + r.summary(), flush=True)
            kills.update(r.kills)
            exits.update(r.restarts_on_exit)
            returns.update(r.node_returns)
            reclaimed += r.spools_reclaimed
            revoked += r.spools_revoked
            reasons.update(r.failure_reasons)
            lost += len(r.lost)
            doubled += len(r.doubled)
            unreadable += bool(r.unreadable)
            done += r.done
            failed += r.failed
            if r.ok or not args.keep:
                shutil.rmtree(root, ignore_errors=True)
            if not r.ok:
                bad_trials += 1
                print(f"  kept in {root}" if args.keep else "  (rerun with --keep to keep its folder)", flush=True)
    finally:
        if server is not None:
            server.stop()
    print(f"\ntrials {args.trials} ({bad_trials} with problems), {time.monotonic() - t0:.0f}s")
    print(f"kills by process: {dict(sorted(kills.items()))} (total {sum(kills.values())})")
    print(f"restarts after a process exited on its own: {dict(sorted(exits.items()))}")
    if args.nodes > 1:
        print(
            f"lost nodes came back: {dict(sorted(returns.items()))}; spools revoked: {revoked}, "
            f"of which reclaimed with samples: {reclaimed}"
        )
    print(
        f"samples: done {done}, failed with reason {failed} {dict(reasons)}, lost {lost}, doubled {doubled}; "
        f"runs unreadable {unreadable}"
    )
    return 1 if bad_trials else 0


if __name__ == "__main__":
    raise SystemExit(main())
