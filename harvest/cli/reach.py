"""Which Redis an operator's command talks to: `--redis`, or that of a local run's work dir."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

work_dir_option = click.option(
    "--work-dir",
    "work_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="A local `harvest run`'s work dir (the summary prints it): reach its Redis there, running or finished, "
    "instead of --redis.",
)


@contextlib.contextmanager
def reach(redis_url: str, work_dir: str | None) -> Iterator[str]:
    """The Redis URL a command talks to: --redis, or the Redis of a local run's work dir
    (harvest.cli.workdir.work_dir_redis: its runner's, or one started for this command)."""
    if work_dir is None:
        yield redis_url
        return
    from harvest.cli.workdir import work_dir_redis

    with work_dir_redis(work_dir) as url:
        yield url
