"""Does the training feed's read-ahead hide its reads behind the trainer's step?

A synthetic run (`--samples` samples of `--tokens` tokens, 4 capture points of `--hidden`, bf16,
`--shard-samples` a shard) is committed by the real shard writer to a local folder and, with
`--s3`, to moto's S3 server in its own process. Per store, `HiddenStateIterable` is read:

- alone, in line (`readahead_bytes=0`, no step): the read time R;
- with a step after every sample (`time.sleep(step)`, standing for an accelerator step, which
  waits on the device and releases the GIL; by default the step is R's per-sample time, the case
  where overlap matters most): in line (the reads and steps add up) and with read-ahead
  (`--cap-mb`).

Reads run in this process with one torch thread, as they do in a DataLoader worker. It prints
each time and the ratio in line / read-ahead; the bound is (R + S) / max(R, S), 2.0
when the step equals the read.

    python bench/readahead.py --samples 96 --tokens 512 --hidden 1024 --s3
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from harvest.read.feed import HiddenStateIterable  # noqa: E402
from tests.support.feedrun import FeedRun  # noqa: E402


def moto_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (so its work is not this process's GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return p, url
        except OSError:
            time.sleep(0.1)
    p.kill()
    raise RuntimeError("moto's server did not start")


def epoch(url: str, cap: int, step: float) -> float:
    """Seconds for one epoch of the feed with a `step`-second step after each sample."""
    feed = HiddenStateIterable(url, seed=0, readahead_bytes=cap)
    t0 = time.perf_counter()
    for _ in feed:
        if step:
            time.sleep(step)
    return time.perf_counter() - t0


def measure(name: str, url: str, samples: int, cap: int, step: float | None, repeats: int) -> None:
    epoch(url, 0, 0)  # warm: connections, caches
    read = min(epoch(url, 0, 0) for _ in range(repeats))
    s = read / samples if step is None else step
    inline = min(epoch(url, 0, s) for _ in range(repeats))
    ahead = min(epoch(url, cap, s) for _ in range(repeats))
    bound = (read + s * samples) / max(read, s * samples)
    print(
        f"{name}: read alone {read:.2f}s ({samples / read:.0f} samples/s); step {s * 1e3:.1f} ms/sample; "
        f"in line {inline:.2f}s, read-ahead {ahead:.2f}s: ratio {inline / ahead:.2f} (bound {bound:.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--shard-samples", type=int, default=8)
    ap.add_argument("--cap-mb", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=None, help="the step (default: the read time per sample)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="also against moto's S3 server")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker: intra-op threads only fight over a busy machine's cores
    step = None if args.step_ms is None else args.step_ms / 1e3
    cap = args.cap_mb << 20
    sizes = [args.shard_samples] * (args.samples // args.shard_samples)
    n = sum(sizes)
    mb = n * args.tokens * 4 * args.hidden * 2 / 1e6
    print(
        f"{n} samples x {args.tokens} tokens x 4 x {args.hidden} bf16: {mb:.0f} MB of hidden states, "
        f"{len(sizes)} shards; read-ahead cap {args.cap_mb} MiB"
    )
    with tempfile.TemporaryDirectory() as tmp:
        local = FeedRun(Path(tmp) / "local", n, hidden=args.hidden, tokens=args.tokens)
        local.commit_sizes(sizes)
        measure("file://", local.url, n, cap, step, args.repeats)
        if args.s3:
            moto, endpoint = moto_server()
            try:
                import boto3

                os.environ.update(
                    {
                        "HARVEST_S3_ENDPOINT": endpoint,
                        "AWS_ACCESS_KEY_ID": "bench",
                        "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_REGION": "us-east-1",
                    }
                )
                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
                remote = FeedRun(Path(tmp) / "s3", n, hidden=args.hidden, tokens=args.tokens, out_url="s3://bench/out")
                remote.commit_sizes(sizes)
                measure("s3:// (moto)", remote.url, n, cap, step, args.repeats)
            finally:
                moto.terminate()


if __name__ == "__main__":
    main()
