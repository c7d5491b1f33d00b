"""`harvest runs`: the runs Redis holds, each with its progress, for an operator who forgot a
name or wants the fleet at a glance (`harvest status --run R` has the details of one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import redis

from harvest.errors import ConfigurationError
from harvest.state.heartbeat import read_workers
from harvest.state.keys import RUN_CONFIG_PATTERN, run_of_config_key
from harvest.state.ledger import Ledger
from harvest.state.runstore import load_run


@dataclass
class RunRow:
    run: str
    model: str
    engine: str
    out: str
    total: int
    queued: int
    spooled: int
    done: int
    failed: int
    workers: int  # with a live heartbeat
    samples_per_s: float  # committed, over the last minute

    @property
    def settled_pct(self) -> float:
        return 100.0 * (self.done + self.failed) / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "settled_pct": round(self.settled_pct, 1)}


def discover_runs(conn: redis.Redis) -> list[str]:
    """Every run whose configuration is in Redis, by name."""
    return sorted(run_of_config_key(k.decode()) for k in conn.scan_iter(match=RUN_CONFIG_PATTERN, count=1000))


def list_runs(conn: redis.Redis) -> list[RunRow]:
    rows = []
    for run in discover_runs(conn):
        try:
            cfg = load_run(conn, run)
        except ConfigurationError:  # removed since the scan, or written by a newer harvest
            continue
        led = Ledger(conn, run)
        c = led.counts()
        rates, window = led.rates()
        alive, _ = read_workers(conn, run)
        rows.append(
            RunRow(
                run=run,
                model=cfg.model,
                engine=cfg.engine,
                out=cfg.out_url,
                total=c["total"],
                queued=c["queued"],
                spooled=c["spooled"],
                done=c["done"],
                failed=c["failed"],
                workers=len(alive),
                samples_per_s=round(rates.get("samples_done", 0) / window, 2),
            )
        )
    return rows


def render_runs(rows: list[RunRow]) -> str:
    if not rows:
        return "no runs in Redis (start one with `harvest run` or `harvest produce`)"
    head = ("run", "settled", "total", "queued", "spooled", "done", "failed", "workers", "samples/s", "engine", "out")
    table = [head] + [
        (
            r.run,
            f"{r.settled_pct:.1f}%",
            *map(str, (r.total, r.queued, r.spooled, r.done, r.failed, r.workers, r.samples_per_s)),
            r.engine,
            r.out,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in table
    )
