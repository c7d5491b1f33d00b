"""The RQ job: one batch of samples through the engine, the dump directory and the spool.

RQ calls `process_batch` with the JSON payload only; everything node-local (engine URL, dump
and spool directories) comes from the `WorkerContext` that `harvest worker` installs before it
starts taking jobs. Samples not in state `q` are skipped, so a duplicated or retried job
never spools a sample twice.

Failures come in two kinds. Transient ones (engine unreachable, timeouts and 5xx after the
engine client's own retries, an OSError writing the spool, RQ's job timeout) leave the samples queued and the
job returns `rq.Retry` with a growing interval, so the job waits in RQ's ScheduledJobRegistry
(released by the janitor) and any worker can take it later; once the job's retry budget is
spent the samples fail with the transient reason. Permanent ones (the engine rejects a sample,
a dump fails verification) fail that sample at once, with its reason and message. Every failed
sample keeps its payload row so `harvest requeue` can put it back. An unexpected exception
fails the job's queued samples (harvest.state.failures.WORKER_ERROR) instead of stranding them.

A Redis error is never the samples' fault, so it never fails them. Within the outage limit the
worker's client (harvest.state.connection) waits Redis out inside the very call, and the job goes
on. Past it, or on a connection error of any kind, the client is latched (nothing more from this
process reaches Redis) and `RedisLost` is raised through RQ, which cannot persist anything either,
and the worker exits: its job stays in RQ's started registry under this worker's name, whose
heartbeat is then gone, so the janitor's dead-worker reaping puts it back on the queue, with its
samples still `q` (or `s`, if their mark landed: a retried job skips those). That loses nothing
provably because the process stops writing at the moment it stops trusting the connection; handing
the job back instead (returning `rq.Retry`) needs the very Redis that is away, and a hand-back
that half lands would leave the job failed in RQ's bookkeeping with its samples queued. Other Redis
errors (Redis answered, with an error) hand the job back with `rq.Retry`; once its retries are
spent RQ files it as failed and its samples stay queued for `harvest requeue --all`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import redis
from rq import Retry, get_current_job
from rq.timeouts import JobTimeoutException

from harvest.config import RunConfig
from harvest.ids import rid_for
from harvest.node.spooldir import SpoolBatch, list_spooled, spool_identity
from harvest.ops.metrics import observe
from harvest.ops.recovery import Recovery
from harvest.state.connection import give_up, is_connection_error, outage_of
from harvest.state.failures import (
    ENGINE_REJECTED,
    ENGINE_UNAVAILABLE,
    JOB_TIMEOUT,
    PREFIX_CACHED,
    PROMPT_LENGTH,
    SPOOL_REVOKED,
    STORAGE_ERROR,
    WORKER_ERROR,
    WORKER_STOPPED,
    SampleFailure,
    record_failures,
)
from harvest.state.heartbeat import WorkerBeat
from harvest.state.jobs import MAX_RETRY_INTERVAL_S
from harvest.state.ledger import QUEUED, Ledger
from harvest.state.payload import Sample, decode_batch, payload_rows
from harvest.state.spools import SpoolLeases
from workers.claim import assemble, claim
from workers.clients.base import Engine, EngineUnavailable, Rejected

log = logging.getLogger("harvest.worker")

DEFAULT_RETRIES = 5


def backoff_intervals(base: float, retries: int, cap: float = MAX_RETRY_INTERVAL_S) -> list[int]:
    """base, 3*base, 9*base, ... (whole seconds, RQ's unit), capped."""
    return [max(1, int(min(cap, base * 3**i))) for i in range(max(1, retries))]


@dataclass
class WorkerContext:
    conn: redis.Redis
    cfg: RunConfig
    engine: Engine
    dump_dir: str
    spool_dir: str
    claim_dir: str
    dump_timeout: float = 60.0
    max_spool_bytes: int = 64 << 30
    retries: int = DEFAULT_RETRIES
    retry_intervals: list[int] = field(default_factory=lambda: backoff_intervals(10, DEFAULT_RETRIES))
    beat: WorkerBeat | None = None
    node: str = "node"
    recovery: Recovery | None = None  # one per process: the job and the heartbeat thread share it
    spool_id: str = field(init=False)
    _recovery_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.spool_id = spool_identity(self.spool_dir)  # once: it lists the spool dir

    def check_recovery(self, force: bool = False) -> bool:
        """harvest.ops.recovery: a restarted or rolled-back Redis is noticed, and the ledger
        reconciled from storage, before work goes on. One check at a time per process; `force`
        skips Recovery's rate limit (a reconnect was just seen)."""
        if self.recovery is None:
            return False
        with self._recovery_lock:
            return self.recovery.check(force=force)

    def outages(self) -> int:
        """Outages this process's client rode out so far (harvest.state.connection)."""
        outage = outage_of(self.conn)
        return outage.outages if outage is not None else 0

    def redis_lost(self) -> bool:
        """True once this process gave Redis up (harvest.state.connection): touch it no more."""
        outage = outage_of(self.conn)
        return outage is not None and outage.lost is not None

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


def _ctx() -> WorkerContext:
    if _context is None:
        raise RuntimeError("process_batch runs only inside `harvest worker` (no worker context installed)")
    return _context


def _wait_for_spool_room(ctx: WorkerContext) -> None:
    """Backpressure: a collector that falls behind makes workers wait, not fill the disk."""
    warned = False
    while sum(size for _, _, size in list_spooled(ctx.spool_dir)) > ctx.max_spool_bytes:
        if not warned:
            log.warning("spool %s above %d bytes: waiting for the collector", ctx.spool_dir, ctx.max_spool_bytes)
            warned = True
        time.sleep(0.5)


def process_batch(payload: dict) -> dict | Retry:
    ctx = _ctx()
    run, samples = decode_batch(payload)
    if run != ctx.cfg.run:
        raise ValueError(f"job of run {run!r} reached a worker of run {ctx.cfg.run!r}")
    job = get_current_job()
    try:
        ctx.check_recovery()  # before the ledger's states are read: a restarted Redis is reconciled first
    except Exception as e:  # a connection error stops the worker; any other hands the job back
        if is_connection_error(e):
            raise give_up(ctx.conn, e) from e
        return _hand_back(ctx, job, f"reconciling the ledger before the job: {type(e).__name__}: {e}")
    ledger = ctx.ledger
    states = ledger.states([s.id for s in samples])  # a connection error here: nothing to undo
    todo = [s for s, st in zip(samples, states) if st == QUEUED]
    if not todo:
        log.info("job %s: nothing to do, its %d samples are past queued", job.id if job else "?", len(samples))
        return {"spooled": 0, "failed": 0, "skipped": len(samples)}
    t0 = time.monotonic()
    if ctx.beat:
        ctx.beat.job_started(job.id if job else "", len(todo))
    try:
        rows = dict(zip((s.id for s in samples), payload_rows(payload)))
        out = _process(ctx, todo, rows)
        out["skipped"] = len(samples) - len(todo)
        log.info("job %s: %d samples, %d tokens, %.2fs: spooled %d, failed %d%s", job.id if job else "?", len(todo),
                 sum(s.num_tokens for s in todo), time.monotonic() - t0, out["spooled"], out["failed"],
                 "".join(f", {r} {n}" for r, n in sorted(out.pop("reasons").items())))
        return out
    except SampleFailure as e:  # only transient failures leave _process: per-sample ones are recorded there
        return _retry_or_fail(ctx, job, todo, e.reason, e.message)
    except JobTimeoutException as e:  # RQ's limit for the job: a slow engine, not a bad sample
        return _retry_or_fail(ctx, job, todo, JOB_TIMEOUT, str(e))
    except (SystemExit, KeyboardInterrupt):
        # A second stop signal (cold shutdown) while working: hand the job back rather than let RQ
        # file it as failed with its samples still queued. Counts as one retry.
        log.warning("stopped during job %s: handing it back", job.id if job else "?")
        return _retry_or_fail(ctx, job, todo, WORKER_STOPPED, "the worker was stopped during the job", interval=0)
    except redis.RedisError as e:  # Redis's condition, never the samples' (see the module docstring)
        if is_connection_error(e):
            log.error("job %s: Redis connection lost (%s): the worker stops; the janitor puts the job back",
                      job.id if job else "?", e)
            raise give_up(ctx.conn, e) from e
        log.exception("job %s: Redis answered with an error", job.id if job else "?")
        return _hand_back(ctx, job, f"{type(e).__name__}: {e}")
    except Exception as e:
        log.exception("job failed unexpectedly")
        _fail(ctx, todo, {s.id: (WORKER_ERROR, f"{type(e).__name__}: {e} | {_where(e)}") for s in todo})
        return {"spooled": 0, "failed": len(todo), "skipped": len(samples) - len(todo)}
    finally:
        if not ctx.redis_lost():
            observe(ctx.conn, ctx.cfg.run, "job_seconds", time.monotonic() - t0)
            if ctx.beat:
                ctx.beat.job_ended()


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"


def _fail(ctx: WorkerContext, todo: list[Sample], failures: dict[str, tuple[str, str]]) -> None:
    """Fail those of `failures` still queued (a retried job may find some already spooled)."""
    by_id = {s.id: s for s in todo}
    still = {sid for sid, st in zip(failures, ctx.ledger.states(list(failures))) if st == QUEUED}
    failures = {sid: f for sid, f in failures.items() if sid in still}
    changed = record_failures(ctx.ledger, ctx.cfg.run, by_id, failures)
    ctx.ledger.add_stats(samples_failed=len(changed))
    for sid in changed:
        log.warning("sample %s failed: %s: %s", sid, *failures[sid])


def _hand_back(ctx: WorkerContext, job, message: str) -> dict | Retry:
    """The job back to RQ for a later attempt, its samples untouched (they stay queued). Once its
    retries are spent RQ files the job as failed: `harvest requeue --all` puts it back."""
    done = (job.number_of_retries or 0) if job is not None else 0
    wait = ctx.retry_intervals[min(done, len(ctx.retry_intervals) - 1)]
    log.warning("job %s: Redis: %s; handing it back, retry %d of %d in %ds", job.id if job else "?", message,
                done + 1, ctx.retries, wait)
    return Retry(max=ctx.retries, interval=[wait])


def _retry_or_fail(ctx: WorkerContext, job, todo: list[Sample], reason: str, message: str,
                   interval: int | None = None) -> dict | Retry:
    done = (job.number_of_retries or 0) if job is not None else ctx.retries
    if job is not None and done < ctx.retries:
        wait = ctx.retry_intervals[min(done, len(ctx.retry_intervals) - 1)] if interval is None else interval
        log.warning("job %s: %s (%s); retry %d of %d in %ds", job.id, reason, message, done + 1, ctx.retries, wait)
        ctx.ledger.add_stats(job_retries=1)
        return Retry(max=ctx.retries, interval=[wait] if wait else 0)
    _fail(ctx, todo, {s.id: (reason, f"{message} (gave up after {done} retries)") for s in todo})
    return {"spooled": 0, "failed": len(todo), "skipped": 0}


def _process(ctx: WorkerContext, todo: list[Sample], rows: dict[str, str]) -> dict:
    """`rows`: each sample's payload row, kept with it while spooled (harvest.ops.reclaim)."""
    outages = ctx.outages()
    _wait_for_spool_room(ctx)
    attempts = ctx.ledger.next_attempts([s.id for s in todo])
    by_rid = {rid_for(s.id, a): s for s, a in zip(todo, attempts)}
    failures: dict[str, tuple[str, str]] = {}
    t0 = time.monotonic()
    try:
        results = ctx.engine.generate(list(by_rid), [s.input_ids.tolist() for s in todo])
    except EngineUnavailable as e:
        # Whatever the engine managed to dump for these rids is never claimed: clear it now.
        claim(ctx.dump_dir, ctx.claim_dir, {r: s.num_tokens for r, s in by_rid.items()}, timeout=0)
        _clear(ctx.claim_dir)
        raise SampleFailure(ENGINE_UNAVAILABLE, str(e), transient=True) from None
    observe(ctx.conn, ctx.cfg.run, "engine_seconds", time.monotonic() - t0)
    wanted: dict[str, int] = {}
    for r in results:
        s = by_rid[r.rid]
        if isinstance(r, Rejected):  # refused before any forward: nothing dumped, nothing to wait for
            failures[s.id] = (ENGINE_REJECTED, r.message)
            continue
        if r.prompt_tokens not in (-1, s.num_tokens):
            failures[s.id] = (PROMPT_LENGTH, f"engine saw {r.prompt_tokens} prompt tokens, sent {s.num_tokens}")
        elif r.cached_tokens:
            failures[s.id] = (
                PREFIX_CACHED,
                f"engine served {r.cached_tokens} prompt tokens from its prefix cache, so their hidden states were "
                "never computed: run SGLang with --disable-radix-cache, or a version that honours extra_key",
            )
        wanted[r.rid] = s.num_tokens
    claimed, missing = claim(ctx.dump_dir, ctx.claim_dir, wanted, ctx.dump_timeout)
    for rid, f in missing.items():
        failures.setdefault(by_rid[rid].id, (f.reason, f.message))
    spooled, tokens, nbytes, dump_bytes = [], 0, 0, 0
    storage_error = None
    batch = SpoolBatch(ctx.spool_dir, ctx.cfg.run)
    try:  # whatever stops the job here (its timeout, an error), no temporary spool file outlives it
        for rid, c in claimed.items():
            s = by_rid[rid]
            try:
                dump_bytes += sum(os.path.getsize(p) for p in c.paths)
                if s.id not in failures and storage_error is None:
                    sample = assemble(c, s, ctx.cfg.capture_points, ctx.cfg.torch_dtype, ctx.cfg.allow_nonfinite)
                    nbytes += batch.add(sample)
                    spooled.append(s.id)
                    tokens += s.num_tokens
            except SampleFailure as e:
                failures[s.id] = (e.reason, e.message)
            except OSError as e:  # the spool disk, not the sample: keep it queued and retry the job
                storage_error = f"{type(e).__name__}: {e}"
            finally:
                for p in c.paths:
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
        try:
            # Every file durable and in place before any is marked: a crash between leaves them queued.
            batch.commit()
        except OSError as e:
            storage_error = f"{type(e).__name__}: {e}"
            spooled, tokens, nbytes = [], 0, 0
    finally:
        batch.abort()  # after a commit: nothing left to remove
    if ctx.outages() != outages:  # Redis came back during the job: the ledger reconciled before the marks
        try:
            ctx.check_recovery(force=True)
        except Exception as e:
            if is_connection_error(e):
                raise
            raise SampleFailure(STORAGE_ERROR, f"reconciling the ledger after Redis came back: {type(e).__name__}: "
                                f"{e}", transient=True) from e
    owner = ctx.spool_id
    marked = ctx.ledger.mark_spooled(spooled, owner=owner, rows=[rows[i] for i in spooled])
    if failures:
        _fail(ctx, todo, failures)
    ctx.ledger.add_stats(samples_spooled=len(spooled), tokens_spooled=tokens, bytes_spooled=nbytes, dump_bytes=dump_bytes)
    if storage_error:
        raise SampleFailure(STORAGE_ERROR, f"writing the spool {ctx.spool_dir}: {storage_error}", transient=True)
    if len(marked) < len(spooled) and ctx.leases.is_revoked(owner):
        # The ledger refused a revoked owner: those samples are still queued, and this job retries
        # them under the spool's new id.
        ctx.renew_lease()
        raise SampleFailure(SPOOL_REVOKED, f"spool {owner} was reclaimed during the job; retrying as {ctx.spool_id}",
                            transient=True)
    return {"spooled": len(spooled), "failed": len(failures), "reasons": dict(Counter(r for r, _ in failures.values()))}


def _clear(claim_dir: str) -> None:
    for name in os.listdir(claim_dir):
        try:
            os.unlink(os.path.join(claim_dir, name))
        except FileNotFoundError:
            pass
