"""The commands that show runs without changing them: `status`, `runs` and the Prometheus
exporter `metrics`."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import click

from harvest.cli.errors import connect
from harvest.cli.options import (
    redis_option,
    run_option,
)
from harvest.cli.reach import reach, work_dir_option
from harvest.settings import MetricsSettings

if TYPE_CHECKING:
    import redis


@click.command("status")
@run_option
@redis_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per line).")
@click.option(
    "--watch",
    "watch",
    default=None,
    type=click.FloatRange(0.5),
    is_flag=False,
    flag_value=2.0,
    help="Refresh in place every N seconds (default 2) until Ctrl-C.",
)
@work_dir_option
@click.option(
    "--check",
    "check",
    is_flag=True,
    help="Check the ledger's invariants (its counters and failures agree with its per-sample states) and "
    "that it knows every sample of the dataset `harvest run` read; exit 1 naming each disagreement.",
)
def status_cmd(run: str, redis_url: str, as_json: bool, watch: float | None, work_dir: str | None, check: bool) -> None:
    """Where RUN stands: counts, throughput, ETA, workers, spool backlog, failure reasons."""
    with reach(redis_url, work_dir) as url:
        _status(connect(url), run, as_json, watch, check)


def _status(conn: redis.Redis, run: str, as_json: bool, watch: float | None, check: bool) -> None:
    import json
    import time

    from harvest.ops.status import compute_status, render
    from harvest.state.runstore import load_run

    cfg = load_run(conn, run)  # a run not in Redis: say so, and how to start it
    if check:
        import sys

        from harvest.ops.coverage import dataset_check
        from harvest.ops.ledgercheck import check_ledger

        rep, lost = check_ledger(conn, run), dataset_check(conn, cfg)
        click.echo("\n".join(rep.lines() + lost))
        sys.exit(0 if rep.ok and not lost else 1)
    try:
        while True:
            st = compute_status(conn, run)
            if as_json:
                click.echo(json.dumps(st.to_dict()))
            elif watch:  # clear the screen and redraw (on a terminal; piped output gets one frame after another)
                click.echo("\x1b[H\x1b[2J" + render(st))
            else:
                click.echo(render(st))
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        pass


@click.command("metrics")
@redis_option
@click.option(
    "--port", default=MetricsSettings.port, show_default=True, type=int, help="Port of the Prometheus exporter."
)
@click.option(
    "--host",
    "--addr",
    "host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; 0.0.0.0 exposes the metrics to other hosts (docker compose passes it).",
)
@click.option("--run", "runs", multiple=True, help="Export these runs (default: every run in Redis).")
def metrics_cmd(redis_url: str, port: int, host: str, runs: tuple[str, ...]) -> None:
    """Serve Prometheus metrics for the runs in Redis at http://HOST:PORT/metrics."""
    import threading

    conn = connect(redis_url)
    from harvest.ops.metrics import serve

    serve(conn, port, host, runs or None)  # an address taken: CannotListen, told as one line
    click.echo(f"serving metrics on http://{host}:{port}/metrics", err=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass


@click.command("runs")
@redis_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run, one per line.")
@work_dir_option
def runs_cmd(redis_url: str, as_json: bool, work_dir: str | None) -> None:
    """List the runs in Redis with their progress."""
    with reach(redis_url, work_dir) as url:
        _runs(connect(url), as_json)


def _runs(conn: redis.Redis, as_json: bool) -> None:
    import json

    from harvest.ops.runlist import list_runs, render_runs

    rows = list_runs(conn)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r.to_dict()))
    else:
        click.echo(render_runs(rows))


COMMANDS = (status_cmd, runs_cmd, metrics_cmd)
