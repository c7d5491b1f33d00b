"""Noticing that Redis forgot writes, and reconciling the ledger from storage before going on.

Redis forgets only across a restart of the server, or by answering from another one: the last
second of an AOF with `appendfsync everysec` on a kill or power cut, a snapshot-only or
memory-only Redis restarted, a failover to a replica that was behind. Each of those has a new
`run_id` (INFO server): a random id every redis-server process takes at start. So the ledger
keeps, in `Keys.ledger_epoch`, the run_id of the server whose ledger was last reconciled from
storage; a key that a rollback restores holds an older run_id, a wiped one is gone, and either
way it differs from the server's own.

Every long-running process (worker, collector, `harvest run`) keeps one `Recovery` and calls
`check()` often: it costs one INFO every `min_interval` s while the server stays the same. On a
new server one process takes `Keys.reconcile_lock`, publishes the run again if Redis lost it,
reconciles the ledger both ways (harvest.ops.reconcile), and records the run_id; the others wait
for that before they go on, so no worker extracts, and no collector packs, from a ledger that
has not been reconciled. The claims in storage (harvest.formats.claims) keep a commit from being
doubled even in the seconds before a process notices; this makes the run finish by itself.

The same process, still under the lock, holds reaping (harvest.ops.liveness.hold_reaping) when
the server is not the run's first: a Redis that came back without the latest heartbeats, after
a reconcile during which the run's processes waited without beating, would otherwise show live
workers as dead. It does so before the reconcile (a janitor of a process that has not noticed
yet) and again after it (one heartbeat TTL for the waiters to beat), before it records the run_id
that lets them go on. A run's first server (no run_id recorded, the run still in Redis, and this
process never saw another) holds nothing: a fresh run reaps at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import redis

from harvest.config import RunConfig
from harvest.ops.liveness import hold_reaping
from harvest.state import scripts
from harvest.state.keys import Keys
from harvest.state.runstore import publish_run
from harvest.storage import retry

if TYPE_CHECKING:
    from harvest.ops.reconcile import ReconcileReport

log = logging.getLogger("harvest.recovery")
T = TypeVar("T")

LOCK_MS = 60_000  # the reconciling process renews it while it reads the index files
WAIT_S = 3600.0  # how long a process waits for another to reconcile before it does so itself


def server_id(conn: redis.Redis) -> str:
    """The run_id of the Redis server answering: new at every start of a redis-server process."""
    return str(conn.info("server")["run_id"])


def hold_on_new_server(conn: redis.Redis, run: str, seen: str | None = None) -> tuple[str, bool]:
    """For a process that keeps no `Recovery` (the operator's `harvest janitor`): when the server
    answering is new to the run's ledger, hold reaping as `Recovery` does before it reconciles, so
    a pass made now takes no worker for dead, removes no claim dir, and proves no dump file stale,
    by a heartbeat the new server lost or rolled back (harvest.ops.janitor). New, as `Recovery`
    judges it: not the server the ledger was last reconciled on (`Keys.ledger_epoch`), or, with no
    epoch recorded, a server that lost the run, or another than the one this caller's last pass
    talked to (`seen`). It reconciles nothing: the run's workers and collectors do as they notice,
    and `harvest reconcile` by hand (`Recovery.reconcile_now`). Returns (the server's run_id,
    whether reaping was held). One INFO and one round trip of two reads."""
    keys, sid = Keys(run), server_id(conn)
    with conn.pipeline(transaction=False) as pipe:
        pipe.get(keys.ledger_epoch)
        pipe.exists(keys.config)
        epoch, has_run = pipe.execute()
    new = not _reconciled_on(epoch, sid) and _new_server(epoch, sid, not has_run, seen)
    if new:
        hold_reaping(conn, run)
    return sid, new


def reconciled_on(conn: redis.Redis, run: str, sid: str) -> bool:
    """Whether the run's ledger was last reconciled on server `sid` (`Keys.ledger_epoch`)."""
    return _reconciled_on(conn.get(Keys(run).ledger_epoch), sid)


def _reconciled_on(epoch: bytes | None, sid: str) -> bool:
    return epoch is not None and epoch.decode() == sid


def _new_server(epoch: bytes | None, sid: str, lost_run: bool, seen: str | None) -> bool:
    """Whether server `sid` is new to a ledger whose epoch is `epoch` (None: never reconciled), so
    its heartbeats prove nothing until the run's processes beat on it again (reaping held): not the
    server the epoch names; a server that lost the run; another than the one last `seen`. A run's
    first server, never reconciled and seen by no one before, is not new: a fresh run reaps at once."""
    return (epoch is not None and epoch.decode() != sid) or lost_run or seen not in (None, sid)


class Recovery:
    """One per process and run. `check()` returns True when this call reconciled the ledger."""

    def __init__(self, conn: redis.Redis, cfg: RunConfig, min_interval: float = 2.0) -> None:
        self.conn, self.cfg, self.min_interval = conn, cfg, min_interval
        self.keys = Keys(cfg.run)
        self._seen: str | None = None  # the server whose ledger this process knows is reconciled
        self._last = -float("inf")
        # bumped each time this process finds a server it had not seen reconciled, once the ledger is
        # reconciled on it (here or by another process): what it read of the ledger before may be stale
        self.generation = 0

    def check(self, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return False
        self._last = now
        sid = server_id(self.conn)
        if sid == self._seen:
            return False
        did = self._ensure(sid)
        self._seen = sid
        self.generation += 1
        return did

    def unchanged(self) -> bool:
        """Check now, not rate-limited: True when the server answering is the one already known to be
        reconciled, so what the caller read of the ledger before this call stands (a Redis that came
        back empty holds no state until the index files give the committed samples back)."""
        seen = self.generation
        self.check(force=True)
        return self.generation == seen

    def reconcile_now(self) -> ReconcileReport:
        """The reconcile an operator asks for (`harvest reconcile`): under the lock the run's
        processes take, holding reaping where the server is new to the ledger as they would, and
        recording the server as reconciled, so that a janitor which keeps no Recovery stops holding
        reaping for it (`hold_on_new_server`) even where no worker or collector runs."""
        sid = server_id(self.conn)
        rep = self._locked(lambda token: self._reconcile(sid, token))
        self._seen = sid
        return rep

    def _ensure(self, sid: str) -> bool:
        return (
            self._locked(
                lambda token: self._reconcile(sid, token), skip=lambda: reconciled_on(self.conn, self.cfg.run, sid)
            )
            is not None
        )

    def _locked(self, fn: Callable[[str], T], skip: Callable[[], bool] = lambda: False) -> T | None:
        """fn(token) under `Keys.reconcile_lock`, waiting while another process holds it; None, and
        fn not called, once `skip()` says its work is done (another process did it meanwhile)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            if skip():
                return None
            token = uuid.uuid4().hex
            if self.conn.set(self.keys.reconcile_lock, token, nx=True, px=LOCK_MS):
                try:
                    return fn(token)
                finally:
                    scripts.release_lock(self.keys.reconcile_lock, token).run(self.conn)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"run {self.cfg.run}: the ledger was not reconciled within {WAIT_S:.0f} s "
                    f"(lock {self.keys.reconcile_lock} held)"
                )
            time.sleep(0.2)  # another process is reconciling: its lock expires if it dies

    def _reconcile(self, sid: str, token: str) -> ReconcileReport:
        epoch = self.conn.get(self.keys.ledger_epoch)  # None: this ledger's first server (or a wiped one)
        lost_run = not self.conn.exists(self.keys.config)
        new_server = _new_server(epoch, sid, lost_run, self._seen)  # (asked for again on this server: not new)
        if new_server:
            hold_reaping(self.conn, self.cfg.run)
        if lost_run:  # a Redis that lost the run gets it back (refused if it differs)
            retry(lambda: publish_run(self.conn, self.cfg), f"publishing run {self.cfg.run} again")
        from harvest.ops.reconcile import reconcile  # here: it reads shards (torch), and the light commands
        # import this module for `hold_on_new_server`

        t0 = time.monotonic()
        rep = reconcile(
            self.conn,
            self.cfg,
            keepalive=lambda: scripts.release_lock(self.keys.reconcile_lock, token, LOCK_MS).run(self.conn),
        )
        if new_server:
            hold_reaping(self.conn, self.cfg.run)
        self.conn.set(self.keys.ledger_epoch, sid)
        changed = rep.marked_done or rep.requeued or rep.forgotten
        log.log(
            logging.WARNING if changed or new_server else logging.INFO,
            "Redis server %s %s run %s%s: ledger reconciled from storage in %.1fs: %s",
            sid[:12],
            "of" if _reconciled_on(epoch, sid) else "is new to",
            self.cfg.run,
            " (a restart, a rollback or a failover)" if new_server else "",
            time.monotonic() - t0,
            rep.line(),
        )
        return rep
