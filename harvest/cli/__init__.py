"""The `harvest` command: the composition root, and the only code that imports every wing.

Each command module declares its commands with the shared options of `harvest.cli.options`
and imports the services it runs lazily, so `harvest --help` stays fast. `harvest.cli.runner`
is the local runner behind `harvest run`.
"""

from __future__ import annotations

import click

from harvest import __version__
from harvest.cli import accept, audit, exports, launch, nodecmd, observe, operate, pipeline, services, trainers
from harvest.cli.errors import HarvestGroup
from harvest.cli.options import setup_logging


@click.group(cls=HarvestGroup)
@click.version_option(__version__, "--version", prog_name="harvest", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """harvest: extract an LLM's hidden states for whole datasets (EAGLE-3 drafter training data)."""
    setup_logging(verbose)


for _cmd in (
    *pipeline.COMMANDS,
    *services.COMMANDS,
    *nodecmd.COMMANDS,
    *operate.COMMANDS,
    *observe.COMMANDS,
    *exports.COMMANDS,
    *launch.COMMANDS,
    *trainers.COMMANDS,
    *audit.COMMANDS,
    *accept.COMMANDS,
):
    main.add_command(_cmd)
