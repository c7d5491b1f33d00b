"""A Redis that answers but refuses writes: which refusal it is, and what the operator does about it.

Three replies mean "this server takes no writes now", not "this command is wrong":

- `OOM`: memory is over `maxmemory` and the policy is `noeviction` (the only policy harvest's
  keys survive), so every command that may grow memory is refused;
- `MISCONF`: its last RDB save failed and `stop-writes-on-bgsave-error` is on (a full or broken
  disk under Redis's `dir`): writes stop until a save succeeds;
- `READONLY`: the URL names a replica.

Redis refuses each of them before running the command (a script at its first write, having
written nothing; a MULTI/EXEC at queue time, so EXEC runs nothing), so a refused call is safe to
send again, as after an outage. harvest.state.connection waits them out like one: it probes with
`SET PROBE_KEY 1 XX`, a write Redis refuses for the same three reasons and that changes nothing
when accepted (the key never exists), then sends the refused call again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from harvest.state.keys import WRITES_PROBE

log = logging.getLogger("harvest.redis")

PROBE_KEY = WRITES_PROBE  # never set: the probe is SET ... XX


@dataclass(frozen=True)
class Refusal:
    code: str  # Redis's error code: OOM, MISCONF, READONLY
    cause: str  # what the server's state is, for a log line
    fix: str  # what the operator does to end it


_REFUSALS = {
    "OOM": Refusal(
        "OOM",
        "Redis is out of memory (used memory over maxmemory, policy noeviction)",
        "raise its maxmemory (redis-cli CONFIG SET maxmemory ...) or free memory on it; keep the policy "
        "noeviction, harvest's keys must not be evicted",
    ),
    "MISCONF": Refusal(
        "MISCONF",
        "Redis cannot save to disk (its last RDB save failed, stop-writes-on-bgsave-error)",
        "free or fix the disk under Redis's dir (its log says why the save failed); writes resume "
        "once a save succeeds (redis-cli BGSAVE)",
    ),
    "READONLY": Refusal(
        "READONLY", "Redis is a read-only replica", "point harvest at the primary (--redis URL, HARVEST_REDIS_URL)"
    ),
}


def refusal_of(error: BaseException) -> Refusal | None:
    """The refusal `error` is (a reply of a server that takes no writes now), else None."""
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return _REFUSALS["OOM"]
    if isinstance(error, redis.exceptions.ReadOnlyError):
        return _REFUSALS["READONLY"]
    if isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("MISCONF"):
        return _REFUSALS["MISCONF"]
    return None


def refused_reply(result: Any) -> BaseException | None:
    """The first refusal among a pipeline's replies returned rather than raised
    (`execute(raise_on_error=False)`), else None."""
    if isinstance(result, list):
        return next((r for r in result if isinstance(r, BaseException) and refusal_of(r) is not None), None)
    return None


def accepts_writes(probe: redis.Redis) -> bool:
    """Whether the server behind `probe` (a client that retries nothing) takes writes now. A
    connection error says nothing either way: False, and the caller asks again."""
    try:
        probe.set(PROBE_KEY, 1, xx=True)
        return True
    except redis.exceptions.ResponseError as e:
        if refusal_of(e) is None:
            raise
        return False
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


class RefusedWrites:
    """One client's refusal of writes in progress (harvest.state.connection.Outage holds it): since
    when, why, and its end, each said once in the log for all the client's threads."""

    def __init__(self, shown_url: str, limit_s: float, probe_url: str, timeout_s: float) -> None:
        self.shown_url, self.limit_s = shown_url, limit_s  # shown_url: without its password
        self._probe_url, self._timeout_s = probe_url, timeout_s
        self.refusal: Refusal | None = None
        self.since: float | None = None  # monotonic time of the first refusal of the one in progress
        self.ended_at: float | None = None  # monotonic time the last one ended
        self._probe: redis.Redis | None = None
        self._lock = threading.Lock()

    def note(self, refusal: Refusal, seen_at: float) -> None:
        """A write was refused (its reply read at monotonic `seen_at`): the first of a refusal says
        its cause and fix in one line. A reply older than the end of the last refusal opens none."""
        with self._lock:
            if self.since is None and (self.ended_at is None or seen_at > self.ended_at):
                self.refusal, self.since = refusal, time.monotonic()
                log.warning(
                    "Redis at %s refuses writes (%s: %s): waiting up to %.0f s for it to take them again; fix: %s",
                    self.shown_url,
                    refusal.code,
                    refusal.cause,
                    self.limit_s,
                    refusal.fix,
                )

    def left(self) -> float | None:
        """Seconds left before the limit while writes are refused; None once they are taken again."""
        with self._lock:
            since = self.since
        return None if since is None else self.limit_s - (time.monotonic() - since)

    def waited(self) -> float:
        with self._lock:
            return 0.0 if self.since is None else time.monotonic() - self.since

    def probe(self) -> bool:
        """Whether the server takes writes now; if so the refusal is over, and its end is said once."""
        with self._lock:
            if self._probe is None:  # retries nothing: a probe that fails is asked again by the caller
                self._probe = redis.Redis.from_url(
                    self._probe_url,
                    retry=Retry(NoBackoff(), 0),
                    socket_timeout=self._timeout_s,
                    socket_connect_timeout=self._timeout_s,
                )
            probe = self._probe
        if not accepts_writes(probe):
            return False
        with self._lock:
            if self.since is not None:
                now = time.monotonic()
                log.warning("Redis at %s takes writes again after %.1f s", self.shown_url, now - self.since)
                self.refusal, self.since, self.ended_at = None, None, now
        return True

    def wait(
        self, refusal: Refusal, seen_at: float, backoff: Callable[[int], float], check: Callable[[], None]
    ) -> bool:
        """Block until the server takes writes again (True), or until the limit (False), for a
        refusal read at monotonic `seen_at`. `check` raises if the client was given up meanwhile."""
        self.note(refusal, seen_at)
        tries = 0
        while True:
            left = self.left()
            if left is None:
                return True  # another call saw writes taken again
            if left <= 0:
                return False
            tries += 1
            time.sleep(min(backoff(tries), left))
            check()
            if self.probe():
                return True
