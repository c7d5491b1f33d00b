"""The CLI's one mapping from the exceptions a user's mistake raises to a line naming the fix.

Commands do not wrap their bodies in try/except: `HarvestGroup` catches what a wrong flag, a
stopped service or a missing credential raises anywhere below a command (Redis unreachable,
S3 without credentials, a bad run configuration or id) and turns it into one `harvest: error:`
line and exit status 2. Anything else is a bug and keeps its traceback.

Redis connections of the CLI go through `connect` (one-shot commands) or `connect_service`
(the long-running ones: worker, collector, producer, `harvest run`, the janitor and metrics
loops), both `harvest.state.connection.redis_client`: first contact is checked at once, so a
Redis never reached fails fast with its fix; a Redis lost later is waited for (5 s for one-shot
commands, `--redis-wait` / HARVEST_REDIS_OUTAGE_S / 300 s for services) and, past that, told as
lost with how long it was waited for, exit status 75 (`REDIS_LOST_EXIT`): run the command again
once Redis is back, everything resumes. Both record the URL they tried (without its password),
so the message names it however deep the failure happened.
"""

from __future__ import annotations

import sys

import click

from harvest.cli.options import fail

# harvest.state.connection imports redis (~70 ms): imported where used, so `harvest --help` and the
# commands without Redis (export, engine) do not pay for it. tests/unit/test_connection.py holds
# this help text to its constants (REDIS_LOST_EXIT, OUTAGE_ENV, DEFAULT_OUTAGE_S).

_tried: dict[str, str] = {}  # "redis" -> the last URL the CLI connected to (password removed)

S3_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and HARVEST_S3_ENDPOINT "
                      "or --s3-endpoint for MinIO/Ceph")


redis_wait_option = click.option(
    "--redis-wait", "redis_wait", default=None, type=click.FloatRange(0),
    help="Seconds to wait for a Redis that went away (after it answered once) before stopping with exit status 75 "
         "[default: HARVEST_REDIS_OUTAGE_S, else 300].")


def redact(url: str) -> str:
    """`url` without its password, fit for a message (harvest.state.connection.redact)."""
    from harvest.state.connection import redact as _redact

    return _redact(url)


def redis_fix(url: str | None, cause: str = "") -> str:
    where = f" at {redact(url)}" if url else ""
    why = f" ({cause})" if cause else ""
    return (f"cannot reach Redis{where}{why}: start redis-server there, or pass --redis URL "
            "(default from HARVEST_REDIS_URL)")


def connect(url: str, ping: bool = True, outage_s: float | None = None):
    """The client of a one-shot command for `url` (at most 5 s to connect; a Redis lost mid-command
    waited for `outage_s`, default ONE_SHOT_OUTAGE_S, then RedisLost, per call: the client is not
    latched, so a process that stays up, as the metrics exporter, answers again once Redis is
    back); with `ping`, reached now, so a stopped Redis is reported before the command does
    anything else."""
    from harvest.state.connection import ONE_SHOT_OUTAGE_S, redis_client

    _tried["redis"] = url
    conn = redis_client(url, ONE_SHOT_OUTAGE_S if outage_s is None else outage_s, latch=False)
    if ping:
        conn.ping()
    return conn


def connect_service(url: str, outage_s: float | None = None):
    """The client of a long-running process for `url`: reached now (or the command fails at once,
    naming the fix), then every outage up to `outage_s` (None: HARVEST_REDIS_OUTAGE_S, else 300 s)
    waited out; past it RedisLost, and the client is latched (the process stops, exit 75)."""
    from harvest.state.connection import redis_client

    _tried["redis"] = url
    conn = redis_client(url, outage_s)
    conn.ping()
    return conn


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _is(e: BaseException, module: str, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith(module) for c in type(e).__mro__)


def explain(exc: BaseException) -> str | None:
    """The one-line message for a user's mistake, or None for a bug."""
    from harvest.config import ConfigError
    from harvest.ids import InvalidId
    from harvest.state.connection import OUTAGE_ENV, RedisLost
    from harvest.storage import StorageError

    for e in _chain(exc):
        if isinstance(e, RedisLost):
            return (f"{e.line()}. Start Redis again (with its data: AOF) and run the same command: the spool, the "
                    f"packing records and the jobs in flight resume (--redis-wait or {OUTAGE_ENV} waits longer)")
        if _is(e, "redis", "AuthenticationError") or _is(e, "redis", "AuthenticationWrongNumberOfArgsError"):
            return f"Redis at {redact(_tried.get('redis', '?'))} refused the login: put user:password in the --redis URL"
        if _is(e, "redis", "ConnectionError") or _is(e, "redis", "TimeoutError"):
            return redis_fix(_tried.get("redis"), _short(e))
        if _is(e, "botocore", "NoCredentialsError") or _is(e, "botocore", "PartialCredentialsError"):
            return f"no S3 credentials found: {S3_CREDENTIALS_FIX}"
        if _is(e, "botocore", "EndpointConnectionError"):
            return f"cannot reach the S3 endpoint ({_short(e)}): check --s3-endpoint / HARVEST_S3_ENDPOINT"
        if isinstance(e, (ConfigError, InvalidId, StorageError)):
            return str(e)
        if type(e).__name__ == "RedisNotInstalled":
            return str(e)
    return None


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 160 else text[:157] + "..."


class HarvestGroup(click.Group):
    """The `harvest` group: a command's known failure becomes one line and exit status 2; a
    Redis lost past its wait, exit status 75 (temporary: the same command resumes)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            msg = explain(e)
            if msg is None:
                raise
            if any(type(c).__name__ == "RedisLost" for c in _chain(e)):
                from harvest.state.connection import REDIS_LOST_EXIT

                click.echo(f"harvest: error: {msg}", err=True)
                sys.exit(REDIS_LOST_EXIT)
            fail(msg)

