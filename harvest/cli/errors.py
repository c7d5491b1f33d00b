"""The CLI's one mapping from the exceptions a user's mistake raises to a line naming the fix.

Commands do not wrap their bodies in try/except: `HarvestGroup` catches what a wrong flag, a
stopped service or a missing credential raises anywhere below a command and turns it into one
`harvest: error:` line and the error's exit status (2; a Redis lost past its wait, 75). What it
tells is a `harvest.errors.HarvestError` (raised where the mistake is detected, or found in the
exception's cause/context chain), or a foreign error translated by one table, `FOREIGN` (Redis
unreachable or refusing the login, S3 without credentials or unreachable), and `OS_ERRORS` (an
OSError on a path the user named on the command line). Anything else is a bug and keeps its
traceback.

Redis connections of the CLI go through `connect` (one-shot commands) or `connect_service`
(the long-running ones: worker, collector, producer, `harvest run`, the janitor and metrics
loops), both `harvest.state.connection.redis_client`: first contact is checked at once, so a
Redis never reached fails fast with its fix; a Redis lost later is waited for (5 s for one-shot
commands; `--redis-wait`, else HARVEST_REDIS_OUTAGE_S, else harvest.settings.RedisSettings.outage_s
for services) and, past that, told as lost with how long it was waited for, exit status 75
(`REDIS_LOST_EXIT`): run the command again once Redis is back, everything resumes. Both record
the URL they tried (without its password), so the message names it however deep the failure
happened.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from harvest.errors import ConfigurationError, HarvestError, InputError, ServiceError, StorageError
from harvest.settings import RedisSettings

if TYPE_CHECKING:
    import redis

# harvest.state.connection imports redis (~70 ms): imported where used, so `harvest --help` and the
# commands without Redis (export, engine) do not pay for it. tests/unit/test_connection.py holds
# this help text to its constants (REDIS_LOST_EXIT, OUTAGE_ENV, DEFAULT_OUTAGE_S).

_tried: dict[str, str] = {}  # "redis" -> the last URL the CLI connected to (password removed)

S3_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and HARVEST_S3_ENDPOINT "
    "or --s3-endpoint for MinIO/Ceph"
)


redis_wait_option = click.option(
    "--redis-wait",
    "redis_wait",
    default=None,
    type=click.FloatRange(0),
    help="Seconds to wait for a Redis that went away (after it answered once) before stopping with exit status 75 "
    f"[default: HARVEST_REDIS_OUTAGE_S, else {RedisSettings.outage_s:.0f}].",
)


def redact(url: str) -> str:
    """`url` without its password, fit for a message (harvest.state.connection.redact)."""
    from harvest.state.connection import redact as _redact

    return _redact(url)


def redis_fix(url: str | None, cause: str = "") -> str:
    where = f" at {redact(url)}" if url else ""
    why = f" ({cause})" if cause else ""
    return (
        f"cannot reach Redis{where}{why}: start redis-server there, or pass --redis URL "
        "(default from HARVEST_REDIS_URL)"
    )


def _ping(conn: redis.Redis, wait_s: float) -> None:
    """First contact. A server still loading its data (a restart replays its append-only file,
    answering LOADING meanwhile) is running: it is waited for as an outage would be, up to
    `wait_s`, and then told as loading (`_redis_loading`), never as a Redis to start."""
    import time

    import redis

    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn.ping()
            return
        except redis.exceptions.BusyLoadingError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def connect(url: str, ping: bool = True, outage_s: float | None = None) -> redis.Redis:
    """The client of a one-shot command for `url` (at most 5 s to connect; a Redis lost mid-command
    waited for `outage_s`, default ONE_SHOT_OUTAGE_S, then RedisLost, per call: the client is not
    latched, so a process that stays up, as the metrics exporter, answers again once Redis is
    back); with `ping`, reached now, so a stopped Redis is reported before the command does
    anything else."""
    from harvest.state.connection import ONE_SHOT_OUTAGE_S, redis_client

    _tried["redis"] = url
    limit = ONE_SHOT_OUTAGE_S if outage_s is None else outage_s
    conn = redis_client(url, limit, latch=False)
    if ping:
        _ping(conn, limit)
    return conn


def connect_service(url: str, outage_s: float | None = None) -> redis.Redis:
    """The client of a long-running process for `url`: reached now (or the command fails at once,
    naming the fix), then every outage up to `outage_s` (None: HARVEST_REDIS_OUTAGE_S, else
    RedisSettings.outage_s) waited out; past it RedisLost, and the client is latched (the process
    stops, exit 75)."""
    from harvest.state.connection import outage_limit, redis_client

    _tried["redis"] = url
    conn = redis_client(url, outage_s)
    _ping(conn, outage_limit(outage_s))
    return conn


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _redis_login(e: BaseException) -> str:
    return f"Redis at {redact(_tried.get('redis', '?'))} refused the login: put user:password in the --redis URL"


def _redis_down(e: BaseException) -> str:
    return redis_fix(_tried.get("redis"), _short(e))


def _redis_loading(e: BaseException) -> str:
    return (
        f"Redis at {redact(_tried.get('redis', '?'))} is running but still loading its data (a restarted server "
        "replays its append-only file first): run the command again once it has loaded"
    )


def _s3_credentials(e: BaseException) -> str:
    return f"no S3 credentials found: {S3_CREDENTIALS_FIX}"


def _s3_endpoint(e: BaseException) -> str:
    return f"cannot reach the S3 endpoint ({_short(e)}): check --s3-endpoint / HARVEST_S3_ENDPOINT"


@dataclass(frozen=True)
class Foreign:
    """One row of the translation table: an instance of `module`.`name` is told as `kind` with
    `message(e)`. The class is looked up only in an already imported `module` (nothing can raise
    an instance of a class never imported), so `harvest --help` imports neither redis nor botocore."""

    module: str
    name: str
    kind: type[HarvestError]
    message: Callable[[BaseException], str]

    def cls(self) -> type[BaseException] | None:
        mod = sys.modules.get(self.module)
        return getattr(mod, self.name, None) if mod is not None else None


# In order: the first row an exception is an instance of wins (redis' AuthenticationError is one
# of its ConnectionErrors).
FOREIGN: tuple[Foreign, ...] = (
    Foreign("redis.exceptions", "AuthenticationError", ConfigurationError, _redis_login),
    Foreign("redis.exceptions", "AuthenticationWrongNumberOfArgsError", ConfigurationError, _redis_login),
    Foreign("redis.exceptions", "BusyLoadingError", ServiceError, _redis_loading),  # a ConnectionError: first
    Foreign("redis.exceptions", "ConnectionError", ServiceError, _redis_down),
    Foreign("redis.exceptions", "TimeoutError", ServiceError, _redis_down),
    Foreign("botocore.exceptions", "NoCredentialsError", ConfigurationError, _s3_credentials),
    Foreign("botocore.exceptions", "PartialCredentialsError", ConfigurationError, _s3_credentials),
    Foreign("botocore.exceptions", "EndpointConnectionError", ServiceError, _s3_endpoint),
)

# An OSError on a path the user named (an argument of the command, or a file under one) is told
# as the OS tells it ("[Errno 2] No such file or directory: 'x'"); on any other path it is a bug.
OS_ERRORS: dict[int, type[HarvestError]] = {
    errno.ENOENT: InputError,
    errno.ENOTDIR: InputError,
    errno.EISDIR: InputError,
    errno.EACCES: StorageError,
    errno.EPERM: StorageError,
    errno.EROFS: StorageError,
    errno.ENOSPC: StorageError,
    errno.EDQUOT: StorageError,
}


def named_paths(args: Iterable[str]) -> list[str]:
    """The absolute paths a command line's arguments may name (`--out=DIR` too; URLs other than
    file:// are no local path)."""
    roots = []
    for arg in args:
        for value in (arg, arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else ""):
            value = value.removeprefix("file://")
            if value and not value.startswith("-") and "://" not in value:
                roots.append(os.path.abspath(os.path.expanduser(value)))
    return roots


def _on_named_path(e: OSError, roots: list[str]) -> bool:
    for name in (e.filename, e.filename2):
        if isinstance(name, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(name))
            if any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
                return True
    return False


def translate(exc: BaseException, args: Iterable[str] = ()) -> HarvestError | None:
    """What `exc` tells the user: the first HarvestError in its chain (itself, then its cause or
    context), or a foreign error there translated by FOREIGN, or OS_ERRORS for an OSError on a
    path among `args` (the command line); None for a bug."""
    roots = named_paths(args)
    for e in _chain(exc):
        if isinstance(e, HarvestError):
            return e
        for row in FOREIGN:
            cls = row.cls()
            if cls is not None and isinstance(e, cls):
                return _told(row.kind(row.message(e)), e)
        if isinstance(e, OSError) and e.errno in OS_ERRORS and _on_named_path(e, roots):
            return _told(OS_ERRORS[e.errno](str(e)), e)
    return None


def _told(err: HarvestError, cause: BaseException) -> HarvestError:
    err.__cause__ = cause
    return err


_ARGS = "harvest.args"  # ctx.meta key: the command line below the group (the command and its arguments)
CONFIG_EXIT = 78  # EX_CONFIG (sysexits.h): `harvest node`'s configuration errors, which a scheduler must not requeue
EXIT_STATUS_OF = "harvest.exit_status_of"  # ctx.meta key: a command's own exit status for an error it raised


class OwnExitCommand(click.Command):
    """A command with exit statuses of its own (`harvest node`): `exit_status_of(err)` for a
    HarvestError, and `usage_exit` for a bad flag or argument (click's UsageError)."""

    def __init__(self, *args: Any, exit_status_of: Callable[[HarvestError], int], usage_exit: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.exit_status_of, self.usage_exit = exit_status_of, usage_exit

    def make_context(self, *args: Any, **kw: Any) -> click.Context:
        try:
            return super().make_context(*args, **kw)
        except click.UsageError as e:
            e.exit_code = self.usage_exit
            raise

    def invoke(self, ctx: click.Context) -> Any:
        ctx.meta[EXIT_STATUS_OF] = self.exit_status_of
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            e.exit_code = self.usage_exit
            raise


class HarvestGroup(click.Group):
    """The `harvest` group: a command's known failure becomes one line and its exit status (2;
    a Redis lost past its wait, 75: temporary, the same command resumes)."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        ctx.meta[_ARGS] = list(args)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            err = translate(e, ctx.meta.get(_ARGS, ()))
            if err is None:
                raise
            click.echo(f"harvest: error: {err.for_user()}", err=True)
            sys.exit(ctx.meta.get(EXIT_STATUS_OF, lambda e: e.exit_status)(err))
