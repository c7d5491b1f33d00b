"""`harvest accept-model`: a run continues on its checkpoint saved again, deliberately.

A run knows its model by a fingerprint of the checkpoint (harvest.formats.fingerprint), so a
checkpoint copied, converted or re-sharded may no longer match, though it computes the same
states. The operator who knows that records it here, once, with the run stopped; every check
after that compares against the new fingerprint."""

from __future__ import annotations

import click

from harvest.cli.checks import check_output
from harvest.cli.errors import connect
from harvest.cli.options import apply_s3_env, redis_option, run_option, s3_options
from harvest.cli.reach import reach, work_dir_option


@click.command("accept-model")
@run_option
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The run's checkpoint, saved again: a local folder.",
)
@redis_option
@click.option(
    "--out", "out_url", default=None, help="The run's output URL (default: the one the run in Redis records)."
)
@s3_options
@work_dir_option
def accept_model_cmd(
    run: str,
    model_dir: str,
    redis_url: str,
    out_url: str | None,
    s3_endpoint: str | None,
    s3_region: str | None,
    work_dir: str | None,
) -> None:
    """Record MODEL as RUN's checkpoint in its run.json and in Redis: for the same model saved again,
    whose fingerprint changed. Checks its shape (layers, width) only: the states it computes are
    yours to vouch for (`harvest audit` compares a sample of them). Stop the run first."""
    from harvest.formats.fingerprint import differing, short
    from harvest.state.runstore import accept_model

    apply_s3_env(s3_endpoint, s3_region)
    check_output(out_url)
    with reach(redis_url, work_dir) as url:
        old, new = accept_model(connect(url), run, model_dir, out_url)
    if new is old:
        click.echo(f"run {run} already records {model_dir}'s fingerprint {short(new.model_fingerprint)}: nothing to do")
        return
    diff = differing(old.model_fingerprint, new.model_fingerprint)
    click.echo(
        f"run {run} now records model {new.model} (fingerprint {short(new.model_fingerprint)}), was "
        f"{old.model} (fingerprint {short(old.model_fingerprint)}); files that differ: "
        f"{', '.join(diff) or 'none'}"
    )


COMMANDS = (accept_model_cmd,)
