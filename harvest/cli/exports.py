"""The commands that take data out of a run's output, with no Redis: `export` (the layout a
drafter trainer reads) and `generated` (a --regenerate run's conversations)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import click

from harvest.cli.options import (
    apply_s3_env,
    no_progress_option,
    read_dtype_option,
    s3_options,
)
from harvest.read.trainers import EXPORT_FORMATS


@click.command("export")
@click.option("--run-url", required=True, help="The run's output folder: <out>/<run> (local path or fsspec URL).")
@click.option(
    "--format",
    "fmt",
    required=True,
    type=click.Choice(list(EXPORT_FORMATS)),
    help="The trainer whose on-disk layout to write.",
)
@click.argument("dest", type=click.Path())
@read_dtype_option
@click.option(
    "--model",
    "model",
    default=None,
    type=click.Path(),
    help="The run's checkpoint on this machine (default: the run's model path); speculators reads its final norm.",
)
@click.option(
    "--in-place",
    "in_place",
    is_flag=True,
    help="Write only the small part (tokens, masks, the sample list); the trainer reads the hidden states "
    "from RUN_URL by byte range (speculators: --hidden-states-backend harvest).",
)
@no_progress_option
@s3_options
def export_cmd(
    run_url: str,
    fmt: str,
    dest: str,
    dtype: str | None,
    model: str | None,
    in_place: bool,
    no_progress: bool,
    s3_endpoint: str | None,
    s3_region: str | None,
) -> None:
    """Write a run in the layout a drafter trainer reads (idempotent; a grown run adds only its new samples)."""
    from harvest.formats.dtypes import storage_torch_dtype
    from harvest.read.export import export_run

    apply_s3_env(s3_endpoint, s3_region)
    # A run that cannot be exported is a ConfigError or ExportError, an unreadable RUN_URL or DEST
    # an OSError on a path named here: harvest.cli.errors.HarvestGroup tells either as one line.
    rep = export_run(
        run_url,
        fmt,
        dest,
        dtype=storage_torch_dtype(dtype) if dtype else None,
        progress=not no_progress,
        model=model,
        in_place=in_place,
    )
    for note in rep.notes:
        click.echo(f"harvest: {note}", err=True)
    click.echo(f"exported {rep.written} samples to {dest} ({rep.skipped} already there)")
    if rep.corrupt:  # every other sample is exported; these are named, and the export fails (exit 1)
        import sys

        from harvest.read.damage import UnreadableShard, verify_fix
        from harvest.storage import Location

        for sid, e in rep.corrupt:
            what = (
                f"its shard cannot be read: {e.why}"
                if isinstance(e, UnreadableShard)
                else f"tensor {e.tensor}, bytes [{e.begin}, {e.end}) of {e.shard_url} {e.problem}"
            )
            click.echo(f"harvest: not exported: sample {sid} of shard {e.shard_id} is corrupt ({what})", err=True)
        n = len(rep.corrupt)
        click.echo(
            f"harvest: error: {n} corrupt sample{'s' * (n != 1)} not exported; "
            f"{verify_fix(Location.from_url(run_url), plural=n != 1)}, then export again",
            err=True,
        )
        sys.exit(1)


@click.command("generated")
@click.option("--run-url", required=True, help="A --regenerate run's output folder: <out>/<run> (local path or URL).")
@click.argument("dest", type=click.Path(dir_okay=False, allow_dash=True))
@s3_options
def generated_cmd(run_url: str, dest: str, s3_endpoint: str | None, s3_region: str | None) -> None:
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


COMMANDS = (export_cmd, generated_cmd)
