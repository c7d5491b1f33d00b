"""`harvest audit`: prove a committed run right against a second computation (harvest.ops.audit);
with `--requeue-bad`, send what fails back for extraction."""

from __future__ import annotations

import sys

import click

from harvest.cli.checks import check_output
from harvest.cli.errors import connect
from harvest.cli.options import apply_s3_env, no_progress_option, redis_option, run_option, s3_options
from harvest.settings import AuditSettings

ROUTES = ("engine", "hf")


@click.command("audit")
@run_option
@redis_option
@click.option(
    "--out",
    "out_url",
    default=None,
    help="The run's output URL; needed when Redis lost the run (its run.json is read from there).",
)
@click.option(
    "--samples",
    "n",
    default=AuditSettings.samples,
    show_default=True,
    type=click.IntRange(1),
    help="Committed samples to recompute, at random, stratified by length.",
)
@click.option("--seed", default=None, type=click.IntRange(0), help="The choice's seed (default: random, printed).")
@click.option(
    "--against",
    "route",
    default="engine",
    show_default=True,
    type=click.Choice(ROUTES),
    help="engine: the run's engine, each sample alone, a fresh rid, other chunk boundaries; hf: an "
    "independent transformers forward of the run's model on this machine.",
)
@click.option(
    "--engine-url",
    default=None,
    help="A server of the run's engine kind on this node (default: the audit starts a reference engine, "
    "for reference runs).",
)
@click.option("--dump-dir", default=None, type=click.Path(), help="Where that server writes its dump files.")
@click.option(
    "--chunked-prefill-size",
    default=AuditSettings.chunked_prefill_size,
    show_default=True,
    type=click.IntRange(1),
    help="Prefill chunk of the reference engine the audit starts.",
)
@click.option(
    "--model",
    default=None,
    type=click.Path(),
    help="The run's checkpoint on this machine (default: the run's model path).",
)
@click.option("--device", default=None, help="Device of the transformers forward (default: cuda if any, else cpu).")
@click.option(
    "--tolerance",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Largest relative error of a row that passes (default: the storage dtype's, see docs).",
)
@click.option(
    "--requeue-bad",
    is_flag=True,
    help="Exclude the failing samples' copies from their index files and put them back on the queue, to "
    "be extracted and committed again, once.",
)
@no_progress_option
@s3_options
def audit_cmd(
    run: str,
    redis_url: str,
    out_url: str | None,
    n: int,
    seed: int | None,
    route: str,
    engine_url: str | None,
    dump_dir: str | None,
    chunked_prefill_size: int,
    model: str | None,
    device: str | None,
    tolerance: float | None,
    requeue_bad: bool,
    no_progress: bool,
    s3_endpoint: str | None,
    s3_region: str | None,
) -> None:
    """Recompute N committed samples of RUN by a second route and compare them with what is stored,
    per capture point; exit 1 if any differs beyond the storage dtype's bound or is corrupt."""
    import secrets

    apply_s3_env(s3_endpoint, s3_region)
    check_output(out_url)
    conn = connect(redis_url)
    from tqdm import tqdm

    from harvest.formats.runfile import run_location
    from harvest.ops.audit import audit_run, exclude_bad
    from harvest.ops.audit_compare import TOLERANCE
    from harvest.ops.audit_record import mirror, summary, write_record
    from harvest.ops.reconcile import reconcile, restore_run
    from harvest.state.runstore import load_run

    cfg = restore_run(conn, run, out_url) if out_url else load_run(conn, run)
    loc = run_location(cfg.out_url, cfg.run)
    seed = secrets.randbelow(1 << 31) if seed is None else seed
    if route == "hf":
        from harvest.node.modelcheck import check_model_dir
        from harvest.ops.audit_hf import HFRoute

        check_model_dir(cfg, model or cfg.model)  # the run's model, or the audit proves nothing
        engine = HFRoute(cfg, model or cfg.model, device)
    else:
        from harvest.cli.audit_engine import EngineRoute

        engine = EngineRoute(cfg, engine_url, dump_dir, model, chunked_prefill_size)
    try:
        with tqdm(desc="audit", unit=" samples", disable=no_progress, file=sys.stderr) as bar:

            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            rep = audit_run(loc, cfg, engine, n, seed, tolerance or TOLERANCE[cfg.storage_dtype], progress)
    finally:
        close = getattr(engine, "close", None)
        if close:
            close()
    if requeue_bad and rep.bad:
        excluded, rewritten = exclude_bad(loc, rep)
        rec = reconcile(conn, cfg)
        rep.requeued = sorted(set(rec.requeued) & set(excluded))
        rep.requeue_line = (
            f"requeue-bad: excluded {len(excluded)} samples from {len(rewritten)} index files; {rec.line()}"
        )
    elif requeue_bad:
        rep.requeue_line = "requeue-bad: nothing to requeue"
    record = rep.to_dict()
    rep.record = write_record(loc, record)
    mirror(conn, cfg.run, {**summary(record), "record": rep.record})
    for line in rep.lines():
        click.echo(line)
    click.echo(f"recorded: {loc.path(rep.record) if loc.is_local else loc.fs.unstrip_protocol(loc.path(rep.record))}")
    if rep.verdict != "pass":
        sys.exit(1)


@click.command("ratio")
@click.option("--run-url", required=True, help="The run's output folder: <out>/<run> (local path or fsspec URL).")
@s3_options
def ratio_cmd(run_url: str, s3_endpoint: str | None, s3_region: str | None) -> None:
    """How much smaller the run's codec stores its committed hidden states (from the index files alone)."""
    from harvest.ops.ratio import run_ratio
    from harvest.storage import Location

    apply_s3_env(s3_endpoint, s3_region)
    click.echo(run_ratio(Location.from_url(run_url)).line())


COMMANDS = (audit_cmd, ratio_cmd)
