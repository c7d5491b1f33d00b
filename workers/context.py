"""The worker process's context: what `harvest worker` knows that a job's JSON payload does not
(the engine, the dump, claim and spool directories, the retry policy, the heartbeat), installed
once before the worker takes jobs and read by every job (harvest.workers.job)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import redis

from harvest.config import RunConfig
from harvest.node.spooldir import list_spooled, spool_identity
from harvest.ops.recovery import Recovery
from harvest.settings import WorkerSettings
from harvest.state.connection import outage_of
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import MAX_RETRY_INTERVAL_S
from harvest.state.ledger import Ledger
from harvest.state.spools import SpoolLeases
from harvest.state.tally import Tally
from harvest.workers.clients.base import Engine

DEFAULT_RETRIES = WorkerSettings.retries

log = logging.getLogger("harvest.worker")


def backoff_intervals(base: float, retries: int, cap: float = MAX_RETRY_INTERVAL_S) -> list[int]:
    """base, 3*base, 9*base, ... (whole seconds, RQ's unit), capped."""
    return [max(1, int(min(cap, base * 3**i))) for i in range(max(1, retries))]


class JobStart(NamedTuple):
    """A job's start made in RQ's transaction that starts its execution
    (harvest.workers.rqworker.HarvestWorker.prepare_execution), taken up by the job (harvest.workers.job)."""

    attempt: int  # named by the heartbeat in that transaction
    states: dict[str, str | None]  # sample -> state letter, read in it
    generation: int  # WorkerContext.recovery_generation() as it was read


@dataclass
class WorkerContext:
    conn: redis.Redis
    cfg: RunConfig
    engine: Engine
    dump_dir: str
    spool_dir: str
    claim_dir: str
    dump_timeout: float = WorkerSettings.dump_timeout_s
    max_spool_bytes: int = WorkerSettings.max_spool_bytes
    retries: int = DEFAULT_RETRIES
    retry_intervals: list[int] = field(
        default_factory=lambda: backoff_intervals(WorkerSettings.retry_backoff_s, DEFAULT_RETRIES)
    )
    beat: WorkerBeat | None = None  # None only where no janitor cleans the dump dir: it names the job's attempt
    node: str = "node"
    recovery: Recovery | None = None  # one per process: the job and the heartbeat thread share it
    spool_id: str = field(init=False)
    started: dict[str, JobStart] = field(init=False, default_factory=dict)  # by job id
    # the jobs' throughput stats and latencies, written at the heartbeat (harvest.state.tally)
    tally: Tally = field(init=False)
    _recovery_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.spool_id = spool_identity(self.spool_dir)  # once: it lists the spool dir
        self.tally = Tally(self.conn, self.cfg.run)  # here, not lazily: the job and the heartbeat thread share it

    def check_recovery(self, force: bool = False) -> bool:
        """harvest.ops.recovery: a restarted or rolled-back Redis is noticed, and the ledger
        reconciled from storage, before work goes on. One check at a time per process; `force`
        skips Recovery's rate limit (a reconnect was just seen)."""
        if self.recovery is None:
            return False
        with self._recovery_lock:
            return self.recovery.check(force=force)

    def recovery_generation(self) -> int:
        """Changes once a server new to this process is reconciled (harvest.ops.recovery): a read of
        the ledger made under another generation may be stale."""
        return self.recovery.generation if self.recovery is not None else 0

    def outages(self) -> int:
        """Outages this process's client rode out so far (harvest.state.connection)."""
        outage = outage_of(self.conn)
        return outage.outages if outage is not None else 0

    def redis_lost(self) -> bool:
        """True once this process gave Redis up (harvest.state.connection): touch it no more."""
        outage = outage_of(self.conn)
        return outage is not None and outage.lost is not None

    def wait_for_spool_room(self) -> None:
        """Backpressure: a collector that falls behind makes workers wait, not fill the disk."""
        warned = False
        while sum(size for _, _, size in list_spooled(self.spool_dir)) > self.max_spool_bytes:
            if not warned:
                log.warning("spool %s above %d bytes: waiting for the collector", self.spool_dir, self.max_spool_bytes)
                warned = True
            time.sleep(0.5)

    @cached_property
    def leases(self) -> SpoolLeases:
        return SpoolLeases(self.conn, self.cfg.run)

    def renew_lease(self) -> None:
        """Renew the spool's lease (at every heartbeat). A revoked spool (its samples were
        reclaimed while this node was silent) takes a new id and goes on as a fresh spool."""
        self.spool_id = self.leases.renew_or_rotate(self.spool_dir, self.spool_id, self.node)

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger(self.conn, self.cfg.run)


_context: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    global _context
    _context = ctx


def installed() -> WorkerContext | None:
    """The context `harvest worker` installed, if any (RQ's worker runs without one in some benches)."""
    return _context


def current() -> WorkerContext:
    if _context is None:
        raise RuntimeError("process_batch runs only inside `harvest worker` (no worker context installed)")
    return _context
