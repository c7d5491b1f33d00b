"""The operator's commands over a run's Redis state and output: `status`, `requeue`, `janitor`,
`metrics`, `reconcile`, and `export` of a finished run for a drafter trainer."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import click

from harvest.cli.checks import check_output
from harvest.cli.errors import connect
from harvest.cli.options import (
    apply_s3_env,
    fail,
    no_progress_option,
    read_dtype_option,
    redis_option,
    run_option,
    s3_options,
    service_logging,
)
from harvest.read.trainers import EXPORT_FORMATS
from harvest.settings import MetricsSettings

work_dir_option = click.option(
    "--work-dir", "work_dir", default=None, type=click.Path(file_okay=False),
    help="A local `harvest run`'s work dir (the summary prints it): reach its Redis there, running or finished, "
         "instead of --redis.")


@contextlib.contextmanager
def _reach(redis_url: str, work_dir: str | None) -> Iterator[str]:
    """The Redis URL a command talks to: --redis, or the Redis of a local run's work dir
    (harvest.cli.workdir.work_dir_redis: its runner's, or one started for this command)."""
    if work_dir is None:
        yield redis_url
        return
    from harvest.cli.workdir import work_dir_redis

    with work_dir_redis(work_dir) as url:
        yield url


@click.command("reconcile")
@run_option
@redis_option
@click.option("--out", "out_url", default=None,
              help="The run's output URL; needed when Redis lost the run (its run.json is read from there).")
@click.option("--dedupe", is_flag=True,
              help="First remove the extra copies of samples committed by more than one shard from the index (the "
                   "copy readers read is kept); idempotent, safe while the run goes on.")
@click.option("--verify", is_flag=True,
              help="First check every committed sample's bytes against its index's checksums and drop corrupt ones "
                   "from the index, so that they are extracted again.")
@no_progress_option
@s3_options
@work_dir_option
def reconcile_cmd(run, redis_url, out_url, dedupe, verify, no_progress, s3_endpoint, s3_region, work_dir) -> None:
    """Bring the ledger of RUN in line with the index files in storage, both ways: committed samples
    done, samples done in the ledger but in no index back on the queue. First the ledger's own
    counters and side tables are rebuilt from its state hash where they disagree with it
    (`harvest status --check` lists that)."""
    apply_s3_env(s3_endpoint, s3_region)
    check_output(out_url)
    with _reach(redis_url, work_dir) as url:
        _reconcile(connect(url), run, out_url, dedupe, verify, no_progress)


def _reconcile(conn, run: str, out_url: str | None, dedupe: bool, verify: bool, no_progress: bool) -> None:
    from harvest.ops.ledgercheck import check_ledger

    repaired = check_ledger(conn, run, repair=True)
    if not repaired.ok:
        click.echo(f"repaired the ledger of run {run} from its state hash: " + "; ".join(repaired.problems))
    from harvest.formats.runfile import run_location
    from harvest.ops.reconcile import restore_run
    from harvest.ops.recovery import Recovery
    from harvest.state.runstore import load_run

    cfg = restore_run(conn, run, out_url) if out_url else load_run(conn, run)
    loc = run_location(cfg.out_url, cfg.run)
    if dedupe:
        from harvest.ops.dedupe import dedupe_run

        click.echo(dedupe_run(loc).line())
    if verify:
        from harvest.ops.verify import verify_run
        from harvest.progress import progress as progress_display

        with progress_display("verify", unit=" samples", enabled=not no_progress) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            rep = verify_run(loc, exclude=True, progress=progress)
        click.echo(rep.line())
        for c in rep.corrupt:
            click.echo(f"  {c.line()}")
    click.echo(Recovery(conn, cfg).reconcile_now().line())  # recorded as the run's processes record theirs


@click.command("export")
@click.option("--run-url", required=True, help="The run's output folder: <out>/<run> (local path or fsspec URL).")
@click.option("--format", "fmt", required=True, type=click.Choice(list(EXPORT_FORMATS)),
              help="The trainer whose on-disk layout to write.")
@click.argument("dest", type=click.Path())
@read_dtype_option
@click.option("--model", "model", default=None, type=click.Path(),
              help="The run's checkpoint on this machine (default: the run's model path); speculators reads its "
                   "final norm.")
@click.option("--in-place", "in_place", is_flag=True,
              help="Write only the small part (tokens, masks, the sample list); the trainer reads the hidden states "
                   "from RUN_URL by byte range (speculators: --hidden-states-backend harvest).")
@no_progress_option
@s3_options
def export_cmd(run_url, fmt, dest, dtype, model, in_place, no_progress, s3_endpoint, s3_region) -> None:
    """Write a run in the layout a drafter trainer reads (idempotent; a grown run adds only its new samples)."""
    from harvest.formats.dtypes import storage_torch_dtype
    from harvest.read.export import export_run

    apply_s3_env(s3_endpoint, s3_region)
    # A run that cannot be exported is a ConfigError or ExportError, an unreadable RUN_URL or DEST
    # an OSError on a path named here: harvest.cli.errors.HarvestGroup tells either as one line.
    rep = export_run(run_url, fmt, dest, dtype=storage_torch_dtype(dtype) if dtype else None,
                     progress=not no_progress, model=model, in_place=in_place)
    for note in rep.notes:
        click.echo(f"harvest: {note}", err=True)
    click.echo(f"exported {rep.written} samples to {dest} ({rep.skipped} already there)")
    if rep.corrupt:  # every other sample is exported; these are named, and the export fails (exit 1)
        import sys

        from harvest.read.damage import UnreadableShard, verify_fix
        from harvest.storage import Location

        for sid, e in rep.corrupt:
            what = (f"its shard cannot be read: {e.why}" if isinstance(e, UnreadableShard) else
                    f"tensor {e.tensor}, bytes [{e.begin}, {e.end}) of {e.shard_url} {e.problem}")
            click.echo(f"harvest: not exported: sample {sid} of shard {e.shard_id} is corrupt ({what})", err=True)
        n = len(rep.corrupt)
        click.echo(f"harvest: error: {n} corrupt sample{'s' * (n != 1)} not exported; "
                   f"{verify_fix(Location.from_url(run_url), plural=n != 1)}, then export again", err=True)
        sys.exit(1)


@click.command("generated")
@click.option("--run-url", required=True, help="A --regenerate run's output folder: <out>/<run> (local path or URL).")
@click.argument("dest", type=click.Path(dir_okay=False, allow_dash=True))
@s3_options
def generated_cmd(run_url, dest, s3_endpoint, s3_region) -> None:
    """Write a --regenerate run's committed conversations to DEST as JSON lines (`-`: stdout): one
    {"id", "messages", "turns"} per sample, the messages as the target model answered them."""
    import json
    import sys

    from harvest.atomic import write_atomic
    from harvest.read.generated import iter_generated

    apply_s3_env(s3_endpoint, s3_region)
    n = 0
    rows = iter_generated(run_url)  # a folder with no run, or a run without --regenerate: refused here, by name

    def lines() -> Iterator[str]:
        nonlocal n
        for row in rows:
            n += 1
            yield json.dumps(row, ensure_ascii=False) + "\n"

    if dest == "-":
        try:
            for line in lines():
                sys.stdout.write(line)
            sys.stdout.flush()
        except BrokenPipeError:  # a reader that stopped early (`| head`): its choice, not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
    else:  # whole or not at all, through DEST.tmp (not fsynced: the run still holds every row)
        write_atomic(dest, (line.encode() for line in lines()), temp=dest + ".tmp", fsync=False)
    if n == 0:
        click.echo(f"harvest: {run_url} commits no regenerated conversation yet", err=True)
    click.echo(f"wrote {n} conversations to {dest}", err=dest == "-")


@click.command("status")
@run_option
@redis_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per line).")
@click.option("--watch", "watch", default=None, type=click.FloatRange(0.5), is_flag=False, flag_value=2.0,
              help="Refresh in place every N seconds (default 2) until Ctrl-C.")
@work_dir_option
@click.option("--check", "check", is_flag=True,
              help="Check the ledger's invariants (its counters and failures agree with its per-sample states) and "
                   "that it knows every sample of the dataset `harvest run` read; exit 1 naming each disagreement.")
def status_cmd(run, redis_url, as_json, watch, work_dir, check) -> None:
    """Where RUN stands: counts, throughput, ETA, workers, spool backlog, failure reasons."""
    with _reach(redis_url, work_dir) as url:
        _status(connect(url), run, as_json, watch, check)


def _status(conn, run: str, as_json: bool, watch: float | None, check: bool) -> None:
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


@click.command("requeue")
@run_option
@redis_option
@click.option("--reason", "reasons", multiple=True, help="Requeue the failed samples with this reason (repeatable).")
@click.option("--sample", "samples", multiple=True, help="Requeue this failed sample id (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Every failed sample, and RQ's failed jobs of the run.")
@click.option("--dry-run", is_flag=True, help="List what would be requeued; change nothing.")
@click.option("--spool", "spools", multiple=True,
              help="Reclaim this node spool now: its spooled samples back on the queue (see `harvest status`).")
@click.option("--node", "nodes", multiple=True, help="Reclaim the spools of this node now (a node known to be gone).")
@work_dir_option
@s3_options
def requeue_cmd(run, redis_url, reasons, samples, all_, dry_run, spools, nodes, work_dir, s3_endpoint, s3_region) -> None:
    """Put failed samples of RUN back on the queue, exactly once; or reclaim a lost node's spool.
    A finished local run's requeued samples are extracted by running its `harvest run` again.
    RQ's failed jobs and a lost spool's samples are rebuilt from the job rows in the run's output."""
    apply_s3_env(s3_endpoint, s3_region)
    if not (reasons or samples or all_ or spools or nodes):
        fail("say what to requeue: --reason REASON, --sample ID or --all (see `harvest status` for the reasons), "
             "or --spool ID / --node NAME for a lost node")
    with _reach(redis_url, work_dir) as url:
        _requeue(connect(url), run, reasons, samples, all_, dry_run, spools, nodes)


def _requeue(conn, run: str, reasons, samples, all_: bool, dry_run: bool, spools, nodes) -> None:
    from harvest.ops.requeue import requeue
    from harvest.state.runstore import load_run

    if spools or nodes:
        _reclaim(conn, run, spools, nodes, dry_run)
        if not (reasons or samples or all_):
            return
    res = requeue(conn, load_run(conn, run), reasons=reasons, sample_ids=samples, all_=all_, dry_run=dry_run)
    verb = "would requeue" if dry_run else "requeued"
    click.echo(f"{verb} {len(res.samples)} failed samples" + (f" in {len(res.jobs)} jobs" if res.jobs else "")
               + "".join(f", {n} {r}" for r, n in sorted(res.reasons.items())))
    if dry_run:
        for sid in res.samples:
            click.echo(f"  {sid}")
    if res.rq_jobs_requeued or res.rq_jobs_dropped:
        click.echo(f"RQ failed jobs: {verb} {len(res.rq_jobs_requeued)}, "
                   f"{'would drop' if dry_run else 'dropped'} {len(res.rq_jobs_dropped)} whose samples the ledger holds")
    if res.no_payload:
        click.echo(f"{len(res.no_payload)} failed samples have no kept tokens and stay failed; "
                   "requeue them from the dataset with `harvest produce` after `harvest reconcile`", err=True)


def _reclaim(conn, run: str, spools: tuple[str, ...], nodes: tuple[str, ...], dry_run: bool) -> None:
    from harvest.ids import check_id
    from harvest.ops.reclaim import reclaim_spool
    from harvest.state.runstore import load_run
    from harvest.state.spools import SpoolLeases

    cfg = load_run(conn, run)
    leases = SpoolLeases(conn, run)
    chosen = [check_id(s, "spool id") for s in spools]
    for node in nodes:
        found = leases.of_node(check_id(node, "node name"))
        if not found:
            fail(f"node {node!r} has no spool in run {run} (`harvest status --run {run}` lists the spools)")
        chosen += found
    views = {v.spool: v for v in SpoolLeases(conn, run).list()}
    for spool in dict.fromkeys(chosen):
        v = views.get(spool)
        if v is None:
            fail(f"spool {spool!r} is not one of run {run}'s (`harvest status --run {run}` lists the spools)")
        if dry_run:
            click.echo(f"would reclaim spool {spool} of node {v.node}: {v.samples} spooled samples"
                       + (" (already reclaimed)" if v.revoked else ""))
            continue
        rep = reclaim_spool(conn, cfg, spool)
        click.echo(f"reclaimed spool {spool} of node {rep.node}: {len(rep.samples)} samples back on the queue in "
                   f"{len(rep.jobs)} jobs" + (f", {len(rep.lost)} failed (tokens not kept)" if rep.lost else "")
                   + (f", {len(rep.decided)} left to a commit already decided" if rep.decided else ""))


@click.command("janitor")
@run_option
@redis_option
@click.option("--dump-dir", default=None, type=click.Path(), help="Also clean this node's dump dir.")
@click.option("--interval", default=None, type=click.FloatRange(1), help="Repeat every N seconds (default: once).")
@s3_options
def janitor_cmd(run, redis_url, dump_dir, interval, s3_endpoint, s3_region) -> None:
    """Take back dead workers' jobs, release due retries, clean dead claim dirs (workers do this too).
    Reclaim and the stranded sweep read job rows from the run's output: give it the S3 endpoint."""
    apply_s3_env(s3_endpoint, s3_region)
    import logging
    import time

    service_logging()
    conn = connect(redis_url)
    from harvest.ops.janitor import UnnamedDumps, janitor_pass
    from harvest.ops.recovery import hold_on_new_server
    from harvest.state.runstore import load_run

    load_run(conn, run)  # a run not in Redis: say so rather than clean nothing
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    log = logging.getLogger("harvest.janitor")
    unnamed = UnnamedDumps()  # a dump file named by no worker goes at a later pass (--interval), not at one
    if interval is not None:
        log.info("janitor started: run %s, dump dir %s, every %.0fs", run, dump_dir or "(none)", interval)
    seen, warned = None, None
    while not stop["now"]:
        seen, held = hold_on_new_server(conn, run, seen)
        if held and warned != seen:
            warned = seen
            log.warning("Redis server %s is new to run %s and its ledger is not reconciled on it yet (a restart, a "
                        "rollback or a failover): no worker is taken for dead and no claim dir or dump file removed "
                        "by a heartbeat until a worker or collector of the run reconciles it, or `harvest reconcile "
                        "--run %s` does", seen[:12], run, run)
        click.echo(janitor_pass(conn, run, dump_dir, unnamed=unnamed).line())
        if interval is None:
            return
        time.sleep(interval)


@click.command("metrics")
@redis_option
@click.option("--port", default=MetricsSettings.port, show_default=True, type=int, help="Port of the Prometheus exporter.")
@click.option("--host", "--addr", "host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the metrics to other hosts (docker compose passes it).")
@click.option("--run", "runs", multiple=True, help="Export these runs (default: every run in Redis).")
def metrics_cmd(redis_url, port, host, runs) -> None:
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
def runs_cmd(redis_url, as_json, work_dir) -> None:
    """List the runs in Redis with their progress."""
    with _reach(redis_url, work_dir) as url:
        _runs(connect(url), as_json)


def _runs(conn, as_json: bool) -> None:
    import json

    from harvest.ops.runlist import list_runs, render_runs

    rows = list_runs(conn)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r.to_dict()))
    else:
        click.echo(render_runs(rows))


COMMANDS = (generated_cmd, status_cmd, runs_cmd, requeue_cmd, janitor_cmd, metrics_cmd, reconcile_cmd, export_cmd)
