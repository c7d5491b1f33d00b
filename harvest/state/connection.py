"""The Redis client of every harvest process: a Redis that goes away for a while is waited out.

Why. A Redis restarted (a crash, a deploy, `harvest run` restarting its own), or a network
that drops for a minute, is a transient condition for the whole fleet. Each worker, collector,
producer and `harvest run` holds work that a restart of the process would only redo, so each
waits, reconnects with backoff and goes on; only a Redis that stays away past a documented
limit stops them. The limit is a command's `--redis-wait`, else `HARVEST_REDIS_OUTAGE_S`, else
`DEFAULT_OUTAGE_S` (harvest.settings.RedisSettings). Past it the process raises `RedisLost`,
sends nothing more to Redis (the client is latched), and the CLI stops it with one line naming
the URL and the limit and exit status `REDIS_LOST_EXIT` (75, EX_TEMPFAIL: try again later). Its
spool, packing record, claim dir and the jobs it held stay as they are: a restarted worker's job
is put back by the janitor's dead-worker reaping, a restarted collector finishes its record.

A Redis that answers but refuses writes (out of memory, a failed save to disk, a replica:
harvest.state.refusal) is waited out the same way, at this same seam: one line names the cause
and its fix, a no-op write probes until the server takes writes again, then the refused call is
sent again (a WATCHed transaction goes back to its caller's loop, which reads again). Past the
same limit the process stops with RedisLost naming the refusal.

A client that never reached Redis fails at once (a wrong URL, a Redis not started: the CLI
says how to fix it). One-shot commands use the same client with a short limit
(`ONE_SHOT_OUTAGE_S`), so a Redis lost mid-command is told apart from one never reached. Only
the clients of processes that stop on RedisLost latch (`latch=True`): a process that stays up
through it (the metrics exporter, serving scrapes) gets RedisLost per call while Redis is away
past the limit, and answers again once it is back.

What redis-py (8.x) does, read in its source, and what this relies on:

- `Redis.from_url` without `retry` gives each connection `Retry(NoBackoff(), 0)`: the first
  ConnectionError is raised at once (a process would stop seconds after its Redis died). Here
  `retry` is an `OutageRetry`, which every connection of the pool shares.
- Every command, pipeline `execute()`, PubSub call, and the pool's own `connect()` run inside
  `connection.retry.call_with_retry(do, fail)`, nested (an attempt's reconnect runs its own
  `call_with_retry` for the socket); `fail` disconnects, so the next attempt reconnects. Only
  ConnectionError (BusyLoadingError too: a Redis loading its AOF), TimeoutError and
  socket.timeout are retried; authentication and pool errors are not (they are no outage).
- A pipeline sends its whole batch again; a MULTI/EXEC without WATCH too. With a WATCH the
  `fail` callback raises WatchError instead (the watch died with the connection) and the
  caller's WATCH loop reads again, as it does when another client wrote.
- Scripts (`register_script`) run EVALSHA and, on NOSCRIPT (a restarted Redis has no script
  cache), SCRIPT LOAD then EVALSHA. In a pipeline they are loaded once, before its retries: a
  restart between the load and EXEC would fail the EXEC with NoScriptError, and Redis would
  still run the transaction's other commands. So no EVALSHA is queued in a harvest transaction:
  a script there goes as EVAL with its text (harvest.state.ledger's moves in a caller's
  MULTI/EXEC), or plain commands (harvest.state.heartbeat), and runs on any server.
- A command whose connection dropped after it was sent may have run: sent again, it runs twice.
  Harvest's writes are made for that (ledger moves are scripts that move a sample only from its
  allowed states; enqueues are WATCHed); statistics counters may count twice.
- RQ's worker loop catches ConnectionError and TimeoutError around its dequeue and retries for
  ever; `RedisLost` is neither, so a worker past the limit leaves RQ's loop and exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import Connection, parse_url
from redis.retry import Retry

from harvest.errors import ConfigurationError, ServiceError
from harvest.settings import RedisSettings
from harvest.state.refusal import RefusedWrites, refusal_of, refused_reply

log = logging.getLogger("harvest.redis")

T = TypeVar("T")

OUTAGE_ENV = "HARVEST_REDIS_OUTAGE_S"
DEFAULT_OUTAGE_S = RedisSettings.outage_s
ONE_SHOT_OUTAGE_S = 5.0  # `status`, `requeue`, ...: a dropped connection is reconnected, an outage told
REDIS_LOST_EXIT = 75  # EX_TEMPFAIL (sysexits.h): the condition is temporary, run the command again
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 2.0  # 0.1, 0.2, 0.4 ... 2 s between attempts
SOCKET_TIMEOUT_S = 10.0  # a Redis that stopped answering (a hang, a partition) counts as away after this
CONNECT_TIMEOUT_S = 5.0

_RETRIED = (redis.ConnectionError, redis.TimeoutError, socket.timeout)
_NOT_AN_OUTAGE = (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.MaxConnectionsError)


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


def outage_limit(seconds: float | None = None) -> float:
    """The outage limit: `seconds` if given (a command's `--redis-wait`), else HARVEST_REDIS_OUTAGE_S,
    else DEFAULT_OUTAGE_S."""
    if seconds is not None:
        return float(seconds)
    raw = os.environ.get(OUTAGE_ENV, "").strip()
    if not raw:
        return DEFAULT_OUTAGE_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigurationError(f"{OUTAGE_ENV}={raw!r}: expected seconds (a number)") from None
    if value < 0:
        raise ConfigurationError(f"{OUTAGE_ENV}={raw!r}: expected seconds >= 0")
    return value


class RedisLost(ServiceError, redis.exceptions.RedisError):
    """Redis answered once, went away and did not come back within the limit. Not a
    ConnectionError on purpose: code that retries those for ever (RQ's dequeue loop) must let
    it through, so that the process stops. The CLI exits with REDIS_LOST_EXIT for it."""

    exit_status = REDIS_LOST_EXIT

    def __init__(
        self, url: str, waited_s: float, limit_s: float, cause: str, hint: str = "", refused: bool = False
    ) -> None:
        self.url, self.waited_s, self.limit_s, self.cause, self.hint = redact(url), waited_s, limit_s, cause, hint
        self.refused = refused  # Redis answered throughout, refusing writes (`hint`: the fix)
        super().__init__(self.line())

    def line(self) -> str:
        if self.refused:
            return (
                f"Redis at {self.url} refused writes for {self.limit_s:.0f} s (waited {self.waited_s:.0f} s): "
                f"{self.cause}; {self.hint}"
            )
        return (
            f"lost Redis at {self.url}: it answered, then went away ({self.cause}) and did not come back within "
            f"{self.limit_s:.0f} s (waited {self.waited_s:.0f} s)" + (f"; {self.hint}" if self.hint else "")
        )

    def for_user(self) -> str:
        first = "Once it takes writes" if self.refused else "Start Redis again (with its data: AOF) and"
        return (
            f"{self.line()}. {first} run the same command: the spool, the packing records and the jobs in "
            f"flight resume (--redis-wait or {OUTAGE_ENV} waits longer)"
        )


class Outage:
    """What one client knows about its Redis, shared by every connection (and thread) of it:
    whether it was ever reached, since when it has been away, and whether it was given up."""

    def __init__(self, url: str, limit_s: float, latch: bool = True) -> None:
        self.url, self.limit_s, self.latch = url, limit_s, latch
        self.reached = False
        self.since: float | None = None  # monotonic time of the first failure of the outage in progress
        self.cause = ""
        self.lost: RedisLost | None = None
        self.outages = 0  # outages ridden out (each ended by a success)
        self.ended_at: float | None = None  # monotonic time the last one ended
        self.writes = RefusedWrites(redact(url), limit_s, url, SOCKET_TIMEOUT_S)  # a refusal of writes in progress
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: nesting of call_with_retry, and of connecting

    def enter(self) -> int:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        return self._local.depth

    def leave(self) -> None:
        self._local.depth -= 1

    def connecting(self, delta: int) -> None:
        self._local.connecting = getattr(self._local, "connecting", 0) + delta

    def in_connect(self) -> bool:
        """A connect is no sign that Redis is back: a socket that accepts and never answers (a hung
        server, a proxy, a Redis still loading its AOF) connects; only a command's answer counts."""
        return getattr(self._local, "connecting", 0) > 0

    def check(self) -> None:
        """Raise RedisLost if the client was given up: nothing reaches Redis after that."""
        if self.lost is not None:
            lost = self.lost
            raise RedisLost(lost.url, lost.waited_s, lost.limit_s, lost.cause, lost.hint, lost.refused)

    def failed(self, error: BaseException) -> float:
        """Note a failed attempt; the seconds left before the limit (<= 0: give up)."""
        now = time.monotonic()
        with self._lock:
            if self.since is None:
                self.since, self.cause = now, _short(error)
                log.warning(
                    "Redis at %s went away (%s): waiting up to %.0f s for it to come back (%s)",
                    redact(self.url),
                    self.cause,
                    self.limit_s,
                    OUTAGE_ENV,
                )
            return self.limit_s - (now - self.since)

    def succeeded(self) -> None:
        with self._lock:
            self.reached = True
            if self.since is not None:
                now = time.monotonic()
                log.warning("Redis at %s is back after %.1f s", redact(self.url), now - self.since)
                self.since, self.ended_at = None, now
                self.outages += 1

    def give_up(self, error: BaseException | None = None, latch: bool = True) -> RedisLost:
        """The RedisLost to raise. With `latch`, the client is latched: from now on every call
        raises RedisLost without reaching Redis."""
        with self._lock:
            if self.lost is not None:
                return self.lost
            refusal = self.writes.refusal
            if self.since is None and refusal is not None:
                lost = RedisLost(self.url, self.writes.waited(), self.limit_s, refusal.cause, refusal.fix, refused=True)
            else:
                since = self.since if self.since is not None else time.monotonic()
                cause = self.cause or (_short(error) if error is not None else "connection lost")
                lost = RedisLost(self.url, time.monotonic() - since, self.limit_s, cause)
            if latch:
                self.lost = lost
                log.error("%s: stopping", lost.line())
            return lost

    def quiet_for(self) -> float:
        """Seconds since the last outage or refusal of writes ended (infinite if none, 0 while one is
        in progress): heartbeats may have lapsed meanwhile."""
        if self.since is not None or self.writes.since is not None:
            return 0.0
        ended = max((t for t in (self.ended_at, self.writes.ended_at) if t is not None), default=None)
        return float("inf") if ended is None else time.monotonic() - ended


class OutageRetry(Retry):
    """redis-py's Retry bounded by time, not by a count, with one outage state for the client.

    Attempts back off exponentially (BACKOFF_BASE_S doubling, at most BACKOFF_CAP_S) until a call
    succeeds or the outage, counted from its first failure by any connection of the client, has
    lasted `Outage.limit_s`. Copies share the state: redis-py deep-copies `retry` into every
    connection."""

    def __init__(self, outage: Outage) -> None:
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), -1, _RETRIED)
        self.outage = outage

    def __deepcopy__(self, memo: dict) -> OutageRetry:
        return self

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        o = self.outage
        o.check()
        depth = o.enter()
        failures = 0
        try:
            while True:
                try:
                    result = do()
                    refused = refused_reply(result)  # a pipeline's replies, returned rather than raised
                    if refused is not None:
                        raise refused
                except redis.ResponseError as error:
                    seen_at = time.monotonic()
                    refusal = refusal_of(error)
                    if refusal is None:
                        raise  # an answer about the command itself, not about the server
                    failures += 1
                    # fail() disconnects; for a WATCHed transaction it raises WatchError: the watch ended
                    # with the refused EXEC, so the caller's loop reads again once writes are taken, rather
                    # than the transaction going again unguarded.
                    try:
                        fail(error, failures) if with_failure_count else fail(error)
                        watch = None
                    except redis.WatchError as e:
                        watch = e
                    if not o.writes.wait(refusal, seen_at, self._backoff.compute, o.check):
                        raise o.give_up(error, o.latch) from error
                    if watch is not None:
                        raise watch from error
                    continue
                except self._supported_errors as error:
                    if is_retryable and not is_retryable(error):
                        raise
                    failures += 1
                    outage = o.reached and not isinstance(error, _NOT_AN_OUTAGE)
                    left = o.failed(error) if outage else 0.0
                    fail(error, failures) if with_failure_count else fail(error)  # may raise WatchError
                    if not outage:
                        raise  # never reached (a wrong URL, a Redis not started), or refused: told at once
                    o.check()  # another thread gave up meanwhile
                    if left <= 0:
                        raise o.give_up(error, o.latch) from error
                    time.sleep(min(self._backoff.compute(failures), left))
                    o.check()
                    continue
                if depth == 1 and not o.in_connect():
                    o.succeeded()
                return result
        finally:
            o.leave()


class _MarksConnects:
    """Mixed into the URL's connection class: its connects are marked, so that their success is
    not taken for the end of an outage (`Outage.in_connect`)."""

    retry: OutageRetry

    def connect(self) -> None:
        self.retry.outage.connecting(1)
        try:
            super().connect()  # type: ignore[misc]
        finally:
            self.retry.outage.connecting(-1)

    def connect_check_health(self, *args: Any, **kw: Any) -> None:
        self.retry.outage.connecting(1)
        try:
            super().connect_check_health(*args, **kw)  # type: ignore[misc]
        finally:
            self.retry.outage.connecting(-1)


_CLASSES: dict[type, type] = {}


def _connection_class(url: str) -> type:
    base = parse_url(url).get("connection_class", Connection)  # unix:// and rediss:// have their own
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Outage{base.__name__}", (_MarksConnects, base), {})
    return _CLASSES[base]


def redis_client(
    url: str,
    outage_s: float | None = None,
    *,
    latch: bool = True,
    socket_timeout: float = SOCKET_TIMEOUT_S,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
) -> redis.Redis:
    """The client for `url` that waits out an outage of up to `outage_limit(outage_s)` seconds
    and then raises RedisLost; with `latch` (a process that stops on it) it then sends nothing
    more (see the module docstring). Nothing is sent until the first command."""
    outage = Outage(url, outage_limit(outage_s), latch)
    return redis.Redis.from_url(
        url,
        retry=OutageRetry(outage),
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        connection_class=_connection_class(url),
    )


def outage_of(conn: redis.Redis) -> Outage | None:
    """The outage state of a client made by `redis_client` (None for any other client)."""
    retry = conn.connection_pool.connection_kwargs.get("retry")
    return retry.outage if isinstance(retry, OutageRetry) else None


def is_connection_error(e: BaseException) -> bool:
    """Redis unreachable, refusing the login, or given up: a condition of the connection, never of
    the work it was doing."""
    return isinstance(e, (RedisLost, *_RETRIED))


def give_up(conn: redis.Redis, error: BaseException) -> RedisLost:
    """Latch `conn` (nothing more reaches Redis from it) and return the RedisLost to raise:
    for a connection error met where going on could record the wrong thing."""
    if isinstance(error, RedisLost):
        return error
    outage = outage_of(conn)
    if outage is None:
        kw = conn.connection_pool.connection_kwargs
        return RedisLost(
            f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}", 0.0, 0.0, _short(error)
        )
    return outage.give_up(error)


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
