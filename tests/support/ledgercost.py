"""The cost of one `harvest status` and one metrics scrape as the run's ledger grows (bench/fleet.py):
a ledger synthesized through the ledger's own scripts, each read measured by the server."""

from __future__ import annotations

import time

import redis

from harvest.config import RunConfig
from harvest.ops.metrics import RedisCollector
from harvest.ops.status import compute_status
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.fleet import RedisStats, sent_counts, tagged


def ledger_cost(conn: redis.Redis, sizes: list[int], points: list[int], hidden: int) -> list[dict]:
    """Cost of one status and one metrics scrape as the ledger grows (synthesized through the
    ledger's scripts: 10% queued, 2% spooled, 1% failed, the rest done)."""
    cfg = publish_run(
        conn,
        RunConfig(
            run="big",
            model="synthetic",
            capture_points=points,
            hidden_size=hidden,
            out_url="/nonexistent",
            num_layers=8,
        ),
    )
    led, have, out = Ledger(conn, cfg.run), 0, []
    reasons = ["engine-rejected", "token-mismatch", "incomplete-dump", "nonfinite"]
    for size in sizes:
        with tagged("bench.fill"):
            for lo in range(have, size, 10_000):
                ids = [f"{i:032x}" for i in range(lo, min(size, lo + 10_000))]
                led.add_queued(ids)
                k = len(ids)
                led.mark_failed({i: (reasons[j % 4], f"synthetic failure {j}") for j, i in enumerate(ids[: k // 100])})
                led.mark_spooled(ids[k // 100 : k // 100 + k // 50], owner="spool-x")
                led.mark_done(ids[k // 100 + k // 50 + k // 10 :])
        have = size
        row = {"samples": size}
        info_us = min((lambda a: RedisStats.read(conn).since(a).cpu_s)(RedisStats.read(conn)) for _ in range(5)) * 1e6
        for what, fn in (
            ("status", lambda: compute_status(conn, "big")),
            ("metrics", lambda: list(RedisCollector(conn, ["big"]).collect())),
            ("metrics (all runs)", lambda: list(RedisCollector(conn).collect())),
        ):
            r0 = RedisStats.read(conn)
            b0, t0 = sent_counts(), time.perf_counter()
            with tagged(f"bench.{what}"):
                fn()
            t, b1 = time.perf_counter() - t0, sent_counts()
            r = RedisStats.read(conn).since(r0)  # holds r0's own INFO
            row[what] = {
                "sent": sum((b1 - b0).values()),
                "executed": r.total - 1,
                "cpu_us": r.cpu_s * 1e6 - info_us,
                "ms": t * 1e3,
            }
        out.append(row)
    return out


def print_ledger(rows: list[dict]) -> None:
    print(
        f"\n{'ledger samples':>15} | {'status: sent':>12} {'exec':>6} {'Redis µs':>9} {'ms':>7} | {'metrics: sent':>13} "
        f"{'exec':>6} {'Redis µs':>9} {'ms':>7} | {'metrics (all runs): sent':>24} {'exec':>6}"
    )
    for r in rows:
        s, m, a = r["status"], r["metrics"], r["metrics (all runs)"]
        print(
            f"{r['samples']:>15} | {s['sent']:>12} {s['executed']:>6} {s['cpu_us']:>9.0f} {s['ms']:>7.1f} | "
            f"{m['sent']:>13} {m['executed']:>6} {m['cpu_us']:>9.0f} {m['ms']:>7.1f} | {a['sent']:>24} {a['executed']:>6}"
        )
    f, l_ = rows[0], rows[-1]
    print(
        f"  ratio {l_['samples'] // f['samples']}x the samples: status {l_['status']['cpu_us'] / max(1, f['status']['cpu_us']):.1f}x "
        f"Redis CPU, {l_['status']['executed'] / max(1, f['status']['executed']):.1f}x commands; metrics "
        f"{l_['metrics']['cpu_us'] / max(1, f['metrics']['cpu_us']):.1f}x Redis CPU, "
        f"{l_['metrics']['executed'] / max(1, f['metrics']['executed']):.1f}x commands"
    )
