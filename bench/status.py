"""Time to first output of `harvest status`, against a bare `python -c` measured in the same run.

    python bench/status.py [--n 15]

Starts a private redis-server holding one run with a few thousand samples, then runs, N times
each and interleaved, `python -c` writing one byte (the interpreter's own start, the floor) and
`python -m harvest.cli status --run bench` (this checkout's code), timing from spawn to the
first byte on stdout. Prints the medians, the difference and the ratio. The target
is a first output within 0.5 s on the 2-core CI machine: `status` imports neither torch nor
transformers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import redis  # noqa: E402

from harvest.cli.redisproc import RedisServer  # noqa: E402
from harvest.config import RunConfig  # noqa: E402
from harvest.state.runstore import publish_run  # noqa: E402


def first_output(argv: list[str]) -> float:
    """Seconds from spawn to the first byte of stdout (the process then runs to its end)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": REPO}
    )
    p.stdout.read(1)
    t = time.perf_counter() - t0
    p.stdout.read()
    if p.wait() != 0:
        raise SystemExit(f"{argv} exited {p.returncode}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(os.path.join(tmp, "redis")).start()
        try:
            conn = redis.Redis.from_url(server.url)
            publish_run(
                conn,
                RunConfig(
                    run="bench",
                    model="m",
                    capture_points=[2, 4, 5, 8],
                    hidden_size=64,
                    out_url=os.path.join(tmp, "out"),
                ),
            )
            conn.hset("harvest:bench:counts", mapping={"q": 3000, "s": 200, "d": 1800})
            base = [sys.executable, "-c", "import sys; sys.stdout.write('x')"]
            status = [sys.executable, "-m", "harvest.cli", "status", "--run", "bench", "--redis", server.url]
            first_output(status)  # warm the page cache and the bytecode cache
            pas, sts = [], []
            for _ in range(args.n):
                pas.append(first_output(base))
                sts.append(first_output(status))
        finally:
            server.stop()
    p, s = statistics.median(pas), statistics.median(sts)
    print(f"python -c (baseline)    median {p * 1000:7.1f} ms  (n={args.n})")
    print(
        f"harvest status (first)  median {s * 1000:7.1f} ms  (n={args.n}; min {min(sts) * 1000:.1f}, "
        f"max {max(sts) * 1000:.1f})"
    )
    print(f"status - baseline       {(s - p) * 1000:7.1f} ms   ratio {s / p:.1f}x   target: first output <= 500 ms")


if __name__ == "__main__":
    main()
