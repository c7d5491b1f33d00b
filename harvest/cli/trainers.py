"""Trainers run with harvest's readers plugged in: `harvest speculators-train`.

speculators finds hidden-state backends only in a class registry that imports fill, and reads
their flags once, when its config module is first imported (harvest.read.speculators_backend
says why no other way exists). So harvest's command registers the `harvest` backend first and
then hands every argument, unchanged, to speculators' own `speculators train` entry: same flags,
same config file, same training code. Under torchrun: `torchrun --nproc_per_node N -m harvest.cli
speculators-train ARGS`.
"""

from __future__ import annotations

import click

from harvest.cli.options import fail

INSTALL = "install speculators 0.9.0 and hs-connectors 0.9.0 (scripts/trainer_pkgs.sh)"


@click.command(
    "speculators-train",
    add_help_option=False,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def speculators_train_cmd(args: tuple[str, ...]) -> None:
    """`speculators train ARGS` with harvest's hidden-states backend: pass `--hidden-states-backend
    harvest --data-path DEST` for an in-place export (`harvest export --format speculators
    --in-place`); `--help` lists speculators' flags, `--harvest-run` among them."""
    try:
        from harvest.read.speculators_backend import register
    except ImportError as e:
        fail(f"the harvest backend needs hs-connectors ({e}): {INSTALL}")
    register()  # before speculators' config module is imported: it reads the backends' flags then
    try:
        from speculators.train.cli import main as train
        from speculators.train.config import TrainConfig
    except ImportError as e:
        fail(f"speculators cannot be imported ({e}): {INSTALL}")
    train(TrainConfig.resolve(list(args)))


COMMANDS = (speculators_train_cmd,)
