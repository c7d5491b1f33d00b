"""The operator's commands that repair a run's Redis state and output: `reconcile`, `requeue`
and `janitor`."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import click

from harvest.cli.checks import check_output
from harvest.cli.errors import connect
from harvest.cli.options import (
    apply_s3_env,
    fail,
    no_progress_option,
    redis_option,
    run_option,
    s3_options,
    service_logging,
)
from harvest.cli.reach import reach, work_dir_option

if TYPE_CHECKING:
    import redis


@click.command("reconcile")
@run_option
@redis_option
@click.option(
    "--out",
    "out_url",
    default=None,
    help="The run's output URL; needed when Redis lost the run (its run.json is read from there).",
)
@click.option(
    "--dedupe",
    is_flag=True,
    help="First remove the extra copies of samples committed by more than one shard from the index (the "
    "copy readers read is kept); idempotent, safe while the run goes on.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="First check every committed sample's bytes against its index's checksums and drop corrupt ones "
    "from the index, so that they are extracted again.",
)
@no_progress_option
@s3_options
@work_dir_option
def reconcile_cmd(
    run: str,
    redis_url: str,
    out_url: str | None,
    dedupe: bool,
    verify: bool,
    no_progress: bool,
    s3_endpoint: str | None,
    s3_region: str | None,
    work_dir: str | None,
) -> None:
    """Bring the ledger of RUN in line with the index files in storage, both ways: committed samples
    done, samples done in the ledger but in no index back on the queue. First the ledger's own
    counters and side tables are rebuilt from its state hash where they disagree with it
    (`harvest status --check` lists that)."""
    apply_s3_env(s3_endpoint, s3_region)
    check_output(out_url)
    with reach(redis_url, work_dir) as url:
        _reconcile(connect(url), run, out_url, dedupe, verify, no_progress)


def _reconcile(conn: redis.Redis, run: str, out_url: str | None, dedupe: bool, verify: bool, no_progress: bool) -> None:
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


@click.command("requeue")
@run_option
@redis_option
@click.option("--reason", "reasons", multiple=True, help="Requeue the failed samples with this reason (repeatable).")
@click.option("--sample", "samples", multiple=True, help="Requeue this failed sample id (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Every failed sample, and RQ's failed jobs of the run.")
@click.option("--dry-run", is_flag=True, help="List what would be requeued; change nothing.")
@click.option(
    "--spool",
    "spools",
    multiple=True,
    help="Reclaim this node spool now: its spooled samples back on the queue (see `harvest status`).",
)
@click.option("--node", "nodes", multiple=True, help="Reclaim the spools of this node now (a node known to be gone).")
@work_dir_option
@s3_options
def requeue_cmd(
    run: str,
    redis_url: str,
    reasons: tuple[str, ...],
    samples: tuple[str, ...],
    all_: bool,
    dry_run: bool,
    spools: tuple[str, ...],
    nodes: tuple[str, ...],
    work_dir: str | None,
    s3_endpoint: str | None,
    s3_region: str | None,
) -> None:
    """Put failed samples of RUN back on the queue, exactly once; or reclaim a lost node's spool.
    A finished local run's requeued samples are extracted by running its `harvest run` again.
    RQ's failed jobs and a lost spool's samples are rebuilt from the job rows in the run's output."""
    apply_s3_env(s3_endpoint, s3_region)
    if not (reasons or samples or all_ or spools or nodes):
        fail(
            "say what to requeue: --reason REASON, --sample ID or --all (see `harvest status` for the reasons), "
            "or --spool ID / --node NAME for a lost node"
        )
    with reach(redis_url, work_dir) as url:
        _requeue(connect(url), run, reasons, samples, all_, dry_run, spools, nodes)


def _requeue(
    conn: redis.Redis,
    run: str,
    reasons: tuple[str, ...],
    samples: tuple[str, ...],
    all_: bool,
    dry_run: bool,
    spools: tuple[str, ...],
    nodes: tuple[str, ...],
) -> None:
    from harvest.ops.requeue import requeue
    from harvest.state.runstore import load_run

    if spools or nodes:
        _reclaim(conn, run, spools, nodes, dry_run)
        if not (reasons or samples or all_):
            return
    res = requeue(conn, load_run(conn, run), reasons=reasons, sample_ids=samples, all_=all_, dry_run=dry_run)
    verb = "would requeue" if dry_run else "requeued"
    click.echo(
        f"{verb} {len(res.samples)} failed samples"
        + (f" in {len(res.jobs)} jobs" if res.jobs else "")
        + "".join(f", {n} {r}" for r, n in sorted(res.reasons.items()))
    )
    if dry_run:
        for sid in res.samples:
            click.echo(f"  {sid}")
    if res.rq_jobs_requeued or res.rq_jobs_dropped:
        click.echo(
            f"RQ failed jobs: {verb} {len(res.rq_jobs_requeued)}, "
            f"{'would drop' if dry_run else 'dropped'} {len(res.rq_jobs_dropped)} whose samples the ledger holds"
        )
    if res.no_payload:
        click.echo(
            f"{len(res.no_payload)} failed samples have no kept tokens and stay failed; "
            "requeue them from the dataset with `harvest produce` after `harvest reconcile`",
            err=True,
        )


def _reclaim(conn: redis.Redis, run: str, spools: tuple[str, ...], nodes: tuple[str, ...], dry_run: bool) -> None:
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
            click.echo(
                f"would reclaim spool {spool} of node {v.node}: {v.samples} spooled samples"
                + (" (already reclaimed)" if v.revoked else "")
            )
            continue
        rep = reclaim_spool(conn, cfg, spool)
        click.echo(
            f"reclaimed spool {spool} of node {rep.node}: {len(rep.samples)} samples back on the queue in "
            f"{len(rep.jobs)} jobs"
            + (f", {len(rep.lost)} failed (tokens not kept)" if rep.lost else "")
            + (f", {len(rep.decided)} left to a commit already decided" if rep.decided else "")
        )


@click.command("janitor")
@run_option
@redis_option
@click.option("--dump-dir", default=None, type=click.Path(), help="Also clean this node's dump dir.")
@click.option("--interval", default=None, type=click.FloatRange(1), help="Repeat every N seconds (default: once).")
@s3_options
def janitor_cmd(
    run: str,
    redis_url: str,
    dump_dir: str | None,
    interval: float | None,
    s3_endpoint: str | None,
    s3_region: str | None,
) -> None:
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
            log.warning(
                "Redis server %s is new to run %s and its ledger is not reconciled on it yet (a restart, a "
                "rollback or a failover): no worker is taken for dead and no claim dir or dump file removed "
                "by a heartbeat until a worker or collector of the run reconciles it, or `harvest reconcile "
                "--run %s` does",
                seen[:12],
                run,
                run,
            )
        click.echo(janitor_pass(conn, run, dump_dir, unnamed=unnamed).line())
        if interval is None:
            return
        time.sleep(interval)


COMMANDS = (requeue_cmd, janitor_cmd, reconcile_cmd)
