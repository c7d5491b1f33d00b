"""The CLI's one mapping from the exceptions a user's mistake raises to a line naming the fix.

Commands do not wrap their bodies in try/except: `HarvestGroup` catches what a wrong flag, a
stopped service or a missing credential raises anywhere below a command (Redis unreachable,
S3 without credentials, a bad run configuration or id) and turns it into one `harvest: error:`
line and exit status 2. Anything else is a bug and keeps its traceback.

Redis connections of the CLI go through `connect`, which records the URL it tried (without its
password), so the message names it however deep the failure happened.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import click

from harvest.cli.options import fail

_tried: dict[str, str] = {}  # "redis" -> the last URL the CLI connected to (password removed)

S3_CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and HARVEST_S3_ENDPOINT "
                      "or --s3-endpoint for MinIO/Ceph")


def redact(url: str) -> str:
    """`url` without its password, fit for a message."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.rsplit("@", 1)[1]
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit(parts._replace(netloc=user + netloc))
    except ValueError:
        return "<unparsable URL>"


def redis_fix(url: str | None, cause: str = "") -> str:
    where = f" at {redact(url)}" if url else ""
    why = f" ({cause})" if cause else ""
    return (f"cannot reach Redis{where}{why}: start redis-server there, or pass --redis URL "
            "(default from HARVEST_REDIS_URL)")


def connect(url: str, ping: bool = True):
    """A Redis client for `url` (at most 5 s to connect); with `ping`, reached now, so a stopped
    Redis is reported before the command does anything else."""
    import redis

    _tried["redis"] = url
    conn = redis.Redis.from_url(url, socket_connect_timeout=5)
    if ping:
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
    from harvest.storage import StorageError

    for e in _chain(exc):
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
    """The `harvest` group: a command's known failure becomes one line and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:
            msg = explain(e)
            if msg is None:
                raise
            fail(msg)

