"""`harvest node`: one node of a run in a shared Redis, as a scheduler starts it (the loop is
harvest.cli.nodeserve's, the node harvest.cli.node's)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from harvest.cli.errors import CONFIG_EXIT, OwnExitCommand
from harvest.cli.options import (
    apply_s3_env,
    dp_option,
    node_option,
    redis_option,
    run_option,
    s3_endpoint_option,
    service_logging,
    tp_option,
)
from harvest.settings import NodeSettings

if TYPE_CHECKING:
    from harvest.errors import HarvestError


def _node_exit_status(err: HarvestError) -> int:
    from harvest.cli.nodeserve import node_exit_status

    return node_exit_status(err)


@click.command("node", cls=OwnExitCommand, exit_status_of=_node_exit_status, usage_exit=CONFIG_EXIT)
@run_option
@redis_option
@click.option(
    "--engine",
    "engine",
    default=None,
    type=click.Choice(["reference", "sglang", "vllm"]),
    help="The run's engine kind (default: the run's); sglang and vllm start servers from this Python "
    "environment (or HARVEST_SGLANG_VENV / HARVEST_VLLM_VENV) with harvest's plugin.",
)
@click.option("--engine-url", default=None, help="Use the engine server there instead of starting one.")
@click.option(
    "--model",
    default=None,
    type=click.Path(),
    help="The run's model as this node sees it (default: the run's model path); checked against the run.",
)
@tp_option
@dp_option
@click.option(
    "--workers",
    default=NodeSettings.workers,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Workers per engine: with 2, one batch is in the engine while the other worker spools.",
)
@click.option(
    "--work",
    "work",
    default=None,
    type=click.Path(),
    help="Node-local state (spool, logs); one node at a time [default: $HARVEST_WORK/RUN, else "
    "~/.cache/harvest/work/RUN].",
)
@node_option
@click.option(
    "--stop-grace",
    default=NodeSettings.stop_grace_s,
    show_default=True,
    type=click.FloatRange(1),
    help="On SIGTERM or SIGINT: seconds within which the workers, then the collector (committing what is "
    "spooled), then the engines stop.",
)
@click.option(
    "--join-wait",
    default=NodeSettings.join_wait_s,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds to wait for Redis to answer and for the run to appear in it, and for a Redis that went "
    "away to come back, before exiting 75.",
)
@s3_endpoint_option
def node_cmd(
    run: str,
    redis_url: str,
    engine: str | None,
    engine_url: str | None,
    model: str | None,
    tp_size: int,
    dp_size: int,
    workers: int,
    work: str | None,
    node: str | None,
    stop_grace: float,
    join_wait: float,
    s3_endpoint: str | None,
) -> None:
    """Join run RUN as one node: start its engines, workers and collector, keep them until the run
    is done, stop them in order on SIGTERM.

    Exit status: 0 when the run is done (its producer finished its pass, nothing is queued or
    spooled); 75 when stopped by SIGTERM or SIGINT, or when Redis stayed away past --join-wait
    (requeue it: the spool is kept); 77 when the output refuses writes; 78 on a configuration
    error (a bad flag, an engine refused or failing at start, a model that is not the run's).
    """
    service_logging()
    apply_s3_env(s3_endpoint, None)
    from harvest.cli.nodeserve import serve

    settings = NodeSettings(
        workers=workers,
        engine_url=engine_url,
        tp_size=tp_size,
        dp_size=dp_size,
        outage_s=join_wait,
        node=node,
        stop_grace_s=stop_grace,
        join_wait_s=join_wait,
    )
    sys.exit(serve(run, redis_url, settings, engine=engine, model=model, work=work))


COMMANDS = (node_cmd,)
