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
import time
import traceback
from collections import Counter

import redis
from rq import Retry, get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

from harvest.errors import StorageError
from harvest.ids import new_attempt, rid_for
from harvest.node.spooldir import SpoolBatch
from harvest.sample import Sample
from harvest.state import jobcopy
from harvest.state.connection import give_up, is_connection_error
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
)
from harvest.state.ledger import QUEUED
from harvest.state.payload import decode_batch, inline, payload_row, payload_rows
from harvest.workers.claim import Claimed, assemble, clear_claims
from harvest.workers.claim import claim as claim_dumps
from harvest.workers.clients.base import EngineUnavailable, Rejected
from harvest.workers.context import DEFAULT_RETRIES, WorkerContext, backoff_intervals, current, install
from harvest.workers.regenerate import Regenerated
from harvest.workers.regenerate import regenerate as regenerate_turns
from harvest.workers.results import JobResult, Spooled

__all__ = ["DEFAULT_RETRIES", "BatchJob", "JobResult", "WorkerContext", "backoff_intervals", "install", "process_batch"]

log = logging.getLogger("harvest.worker")


def process_batch(payload: dict) -> dict | Retry:
    """The RQ job function (harvest.state.jobs.JOB_FUNCTION): `JobResult.to_rq()`, or `rq.Retry`."""
    out = BatchJob(current(), payload, get_current_job()).run()
    return out if isinstance(out, Retry) else out.to_rq()


class BatchJob:
    """One execution of a job, in named steps: `load` (its samples, their rows read from storage),
    `reconcile` (a restarted Redis first), `choose` (the samples still queued), then under
    `attempt` (every failure mapped to a retry, a hand-back or failed samples): `generate` (the
    engine call), `claim` (the dumps), `spool` (assembled, durable, in place), `mark` (the
    ledger), `finish` (the result, or the transient failure)."""

    def __init__(self, ctx: WorkerContext, payload: dict, job: Job) -> None:
        self.ctx, self.payload, self.job = ctx, payload, job
        self.name = job.id if job else "?"
        self.samples: list[Sample] = []  # the payload's, from `load`
        self.todo: list[Sample] = []  # the job's samples still queued, as the payload holds them
        self.extract: list[Sample] = []  # what the engine prefills: `todo`, its conversations regenerated
        self.by_rid: dict[str, Sample] = {}
        self.failures: dict[str, tuple[str, str]] = {}  # sample -> (reason, message), failed at `mark`
        self.owner = ""  # the spool id the samples are marked with
        self.attempt_id: int | None = None  # this execution's random attempt number, the tail of its rids: `choose`
        self.generated: Regenerated | None = None  # the job's regeneration step, for its stats
        self.t0 = 0.0  # monotonic time the job was taken (`choose`)
        self.ended = False  # the heartbeat's end of job went (with the marks, `mark`)
        # the job's start made in the transaction that started its execution (harvest.workers.rqworker)
        self.started = ctx.started.pop(job.id, None) if job else None
        self.timed = False  # the job's duration went to the tally (at the marks)

    def run(self) -> JobResult | Retry:
        held = self.load() or self.reconcile()
        if held is not None:
            return held  # the heartbeat, which the job's start named busy, goes idle with RQ's outcome
        self.t0, todo = time.monotonic(), None
        try:
            todo = self.choose()
            if not todo:
                log.info("job %s: nothing to do, its %d samples are past queued", self.name, len(self.samples))
                return JobResult(skipped=len(self.samples))
            return self.attempt()
        finally:
            self.end(timed=bool(todo))

    def end(self, timed: bool) -> None:
        """The heartbeat's end of job, unless it went with the marks or RQ's outcome writes it
        (WorkerBeat.ending); the job's duration (`timed`: it had samples to do), unless the marks
        took it, to the worker's tally (harvest.state.tally). Nothing once Redis is lost."""
        ctx = self.ctx
        if ctx.redis_lost():
            return
        if timed and not self.timed:
            ctx.tally.observe("job_seconds", time.monotonic() - self.t0)
        if ctx.beat and not self.ended:
            ctx.beat.job_ended()

    def load(self) -> Retry | None:
        """The job's samples, their rows read from storage where the producer wrote them
        (harvest.formats.jobrows). A store that fails hands the job back; rows gone or changed
        (PayloadError) fail the job in RQ, and its queued samples, in no job that can run them,
        go to the stranded sweep (harvest.ops.stranded)."""
        try:
            self.payload = inline(self.payload)
        except StorageError as e:
            return self.hand_back(f"reading the job's rows: {e}")
        run, self.samples = decode_batch(self.payload)
        if run != self.ctx.cfg.run:
            raise ValueError(f"job of run {run!r} reached a worker of run {self.ctx.cfg.run!r}")
        return None

    def reconcile(self) -> Retry | None:
        """Before the ledger's states are read: a restarted Redis is reconciled first. A connection
        error stops the worker; any other hands the job back."""
        try:
            self.ctx.check_recovery()
        except Exception as e:
            if is_connection_error(e):
                raise give_up(self.ctx.conn, e) from e
            return self.hand_back(f"Redis: reconciling the ledger before the job: {type(e).__name__}: {e}")
        return None

    def choose(self) -> list[Sample]:
        """The job's samples still queued, read with the heartbeat's job line, which names the
        job's new attempt (a fresh rid a sample: harvest.ids.new_attempt), as sent in the
        transaction that started the job's execution (HarvestWorker.prepare_execution); sent in a
        round trip of their own (harvest.state.roundtrip; a connection error: nothing to undo)
        where the worker sent none, or the ledger was reconciled on a new Redis since (Recovery's
        generation)."""
        ctx, start = self.ctx, self.started
        if (
            start is not None
            and start.generation == ctx.recovery_generation()
            and all(s.id in start.states for s in self.samples)
        ):
            attempt, states = start.attempt, [start.states[s.id] for s in self.samples]
        else:
            attempt = new_attempt()
            also = [ctx.beat.starting(self.job.id if self.job else "", len(self.samples), attempt)] if ctx.beat else []
            states = ctx.ledger.take([s.id for s in self.samples], also=also)
        self.todo = [s for s, st in zip(self.samples, states, strict=False) if st == QUEUED]
        self.attempt_id = attempt
        return self.todo

    def attempt(self) -> JobResult | Retry:
        """The steps from the engine call on; what stops them decides the job's outcome."""
        ctx, todo, t0 = self.ctx, self.todo, self.t0
        try:
            out = self.work()
        except SampleFailure as e:  # only transient failures leave `work`: per-sample ones are recorded there
            return self.retry_or_fail(e.reason, e.message)
        except JobTimeoutException as e:  # RQ's limit for the job: a slow engine, not a bad sample
            return self.retry_or_fail(JOB_TIMEOUT, str(e))
        except (SystemExit, KeyboardInterrupt):
            # A second stop signal (cold shutdown) while working: hand the job back rather than let RQ
            # file it as failed with its samples still queued. Counts as one retry.
            log.warning("stopped during job %s: handing it back", self.name)
            return self.retry_or_fail(WORKER_STOPPED, "the worker was stopped during the job", interval=0)
        except redis.RedisError as e:  # Redis's condition, never the samples' (see the module docstring)
            if is_connection_error(e):
                log.error(
                    "job %s: Redis connection lost (%s): the worker stops; the janitor puts the job back", self.name, e
                )
                raise give_up(ctx.conn, e) from e
            log.exception("job %s: Redis answered with an error", self.name)
            return self.hand_back(f"Redis: {type(e).__name__}: {e}")
        except Exception as e:
            log.exception("job failed unexpectedly")
            self.fail({s.id: (WORKER_ERROR, f"{type(e).__name__}: {e} | {_where(e)}") for s in todo})
            return JobResult(failed=len(todo), skipped=len(self.samples) - len(todo))
        else:
            out.skipped = len(self.samples) - len(todo)
            log.info(
                "job %s: %d samples, %d tokens, %.2fs: spooled %d, failed %d%s",
                self.name,
                len(todo),
                sum(s.num_tokens for s in todo),
                time.monotonic() - t0,
                out.spooled,
                out.failed,
                "".join(f", {r} {n}" for r, n in sorted(out.reasons.items())),
            )
            return out

    def work(self) -> JobResult:
        rows = dict(
            zip((s.id for s in self.samples), payload_rows(self.payload), strict=False)
        )  # kept if failed, or no job to copy
        outages = self.ctx.outages()
        self.ctx.wait_for_spool_room()
        self.regenerate()
        claimed = self.claim(self.generate())
        spooled = self.spool(claimed)
        marked = self.mark(spooled, rows, outages)
        return self.finish(spooled, marked)

    def regenerate(self) -> None:
        """A --regenerate run's conversations written first (harvest.workers.regenerate); each is then
        extracted as the sample it has become. One that fails is noted in `failures`."""
        self.extract = [s for s in self.todo if s.conv is None]
        if convs := [s for s in self.todo if s.conv is not None]:
            self.generated = out = regenerate_turns(self.ctx.engine, convs, self.attempt_id, self.ctx.cfg, self.name)
            self.failures.update(out.failures)
            self.extract += [w.sample for w in out.written.values()]

    def generate(self) -> dict[str, int]:
        """Every queued sample through the engine under a new rid. Returns the rids whose dumps to
        claim (their token counts); refusals and mismatches are noted in `failures`."""
        ctx = self.ctx
        self.by_rid = by_rid = {rid_for(s.id, self.attempt_id): s for s in self.extract}
        if not by_rid:
            return {}
        t0 = time.monotonic()
        try:
            results = ctx.engine.generate(list(by_rid), [s.input_ids.tolist() for s in self.extract])
        except EngineUnavailable as e:
            # Whatever the engine managed to dump for these rids is never claimed: clear it now.
            claim_dumps(ctx.dump_dir, ctx.claim_dir, {r: s.num_tokens for r, s in by_rid.items()}, timeout=0)
            clear_claims(ctx.claim_dir)
            raise SampleFailure(ENGINE_UNAVAILABLE, str(e), transient=True) from None
        ctx.tally.observe("engine_seconds", time.monotonic() - t0)
        wanted: dict[str, int] = {}
        for r in results:
            s = by_rid[r.rid]
            if isinstance(r, Rejected):  # refused before any forward: nothing dumped, nothing to wait for
                self.failures[s.id] = (ENGINE_REJECTED, r.message)
                continue
            if r.prompt_tokens not in (-1, s.num_tokens):
                self.failures[s.id] = (
                    PROMPT_LENGTH,
                    f"engine saw {r.prompt_tokens} prompt tokens, sent {s.num_tokens}",
                )
            elif r.cached_tokens:
                self.failures[s.id] = (
                    PREFIX_CACHED,
                    (
                        f"engine served {r.cached_tokens} prompt tokens from its prefix cache, so their hidden states "
                        "were never computed: run SGLang with --disable-radix-cache, or a version that honours extra_key"
                    ),
                )
            wanted[r.rid] = s.num_tokens
        return wanted

    def claim(self, wanted: dict[str, int]) -> dict[str, Claimed]:
        """The dumps of `wanted` moved into this worker's claim dir (harvest.workers.claim)."""
        claimed, missing = claim_dumps(self.ctx.dump_dir, self.ctx.claim_dir, wanted, self.ctx.dump_timeout)
        for rid, f in missing.items():
            self.failures.setdefault(self.by_rid[rid].id, (f.reason, f.message))
        return claimed

    def spool(self, claimed: dict[str, Claimed]) -> Spooled:
        """Each claimed sample not failed assembled into the spool; every file durable and in place
        before any is marked (a crash between leaves them queued); the dumps deleted."""
        out = Spooled()
        batch = SpoolBatch(self.ctx.spool_dir, self.ctx.cfg.run)
        try:  # whatever stops the job here (its timeout, an error), no temporary spool file outlives it
            for rid, c in claimed.items():
                self._spool_one(batch, self.by_rid[rid], c, out)
            self._commit(batch, out)
        finally:
            batch.abort()  # after a commit: nothing left to remove
        return out

    def _spool_one(self, batch: SpoolBatch, s: Sample, c: Claimed, out: Spooled) -> None:
        cfg = self.ctx.cfg
        try:
            out.dump_bytes += sum(os.path.getsize(p) for p in c.paths)
            if s.id not in self.failures and out.error is None:
                spooled = assemble(c, s, cfg.capture_points, cfg.torch_dtype, cfg.allow_nonfinite)
                if self.generated and s.id in self.generated.written:  # the turns go with their states to the shard
                    spooled.generation = self.generated.written[s.id].entry()
                out.nbytes += batch.add(spooled)
                out.ids.append(s.id)
                out.tokens += s.num_tokens
        except SampleFailure as e:
            self.failures[s.id] = (e.reason, e.message)
        except OSError as e:  # the spool disk, not the sample: keep it queued and retry the job
            out.error = f"{type(e).__name__}: {e}"
        finally:
            for p in c.paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    @staticmethod
    def _commit(batch: SpoolBatch, out: Spooled) -> None:
        try:
            batch.commit()
        except OSError as e:
            out.error = f"{type(e).__name__}: {e}"
            out.ids, out.tokens, out.nbytes = [], 0, 0

    def mark(self, spooled: Spooled, rows: dict[str, str], outages: int) -> list[str]:
        """The ledger, in one call (Ledger.settle_job): the spooled samples `s` (with their payload
        rows, harvest.ops.reclaim), the failed ones `f` (with theirs, for requeue); the job's stats
        and duration go to the worker's tally (harvest.state.tally). Returns the samples this call
        marked spooled."""
        ctx = self.ctx
        if ctx.outages() != outages:  # Redis came back during the job: the ledger reconciled before the marks
            try:
                ctx.check_recovery(force=True)
            except Exception as e:
                if is_connection_error(e):
                    raise
                raise SampleFailure(
                    STORAGE_ERROR,
                    f"reconciling the ledger after Redis came back: {type(e).__name__}: {e}",
                    transient=True,
                ) from e
        self.owner = ctx.spool_id
        # Failed samples not in this job's payload keep no row (none to keep); a sample spooled
        # meanwhile by a duplicate of this job is not failed (the script moves only q or absent).
        # A spooled one keeps a ref to its first row in this job's copy (harvest.state.jobcopy).
        refs = (
            {s.id: jobcopy.ref(self.job.id, i) for i, s in reversed(list(enumerate(self.samples)))} if self.job else {}
        )
        ctx.tally.observe("job_seconds", time.monotonic() - self.t0)
        self.timed = True
        also = [c for c in [ctx.beat and ctx.beat.ending()] if c]  # end of job, unless RQ's outcome writes it
        try:
            marked, failed = ctx.ledger.settle_job(spooled.ids, self.owner, rows, self.failures, refs=refs, also=also)
        except redis.ResponseError:  # Redis answered: the end of job ran beside it
            self.ended = bool(also)
            raise
        self.ended = bool(also)
        ctx.tally.add(
            {
                "samples_spooled": len(spooled.ids),
                "tokens_spooled": spooled.tokens,
                "bytes_spooled": spooled.nbytes,
                "dump_bytes": spooled.dump_bytes,
                **(self.generated.stats() if self.generated else {}),
            }
        )
        for sid in failed:
            log.warning("sample %s failed: %s: %s", sid, *self.failures[sid])
        return marked

    def finish(self, spooled: Spooled, marked: list[str]) -> JobResult:
        """The job's result; a spool that failed to write, or was revoked meanwhile, retries the job."""
        ctx = self.ctx
        if spooled.error:
            raise SampleFailure(STORAGE_ERROR, f"writing the spool {ctx.spool_dir}: {spooled.error}", transient=True)
        if len(marked) < len(spooled.ids) and ctx.leases.is_revoked(self.owner):
            # The ledger refused a revoked owner: those samples are still queued, and this job retries
            # them under the spool's new id.
            ctx.renew_lease()
            raise SampleFailure(
                SPOOL_REVOKED,
                f"spool {self.owner} was reclaimed during the job; retrying as {ctx.spool_id}",
                transient=True,
            )
        return JobResult(
            spooled=len(spooled.ids),
            failed=len(self.failures),
            reasons=dict(Counter(r for r, _ in self.failures.values())),
        )

    def fail(self, failures: dict[str, tuple[str, str]]) -> None:
        """Fail those of `failures` still queued (a retried job may find some already spooled), or
        absent: a rollback forgot this job's enqueue, and this job holds their rows (Ledger.mark_failed)."""
        ctx = self.ctx
        rows = {s.id: payload_row(ctx.cfg.run, s) for s in self.todo if s.id in failures}
        _, changed = ctx.ledger.settle_job([], "", rows, failures)  # moves only q or absent, counts samples_failed
        for sid in changed:
            log.warning("sample %s failed: %s: %s", sid, *failures[sid])

    def hand_back(self, message: str) -> Retry:
        """The job back to RQ for a later attempt, its samples untouched (they stay queued). Once its
        retries are spent RQ files the job as failed: `harvest requeue --all` puts it back."""
        ctx, job = self.ctx, self.job
        done = (job.number_of_retries or 0) if job is not None else 0
        wait = ctx.retry_intervals[min(done, len(ctx.retry_intervals) - 1)]
        log.warning(
            "job %s: %s; handing it back, retry %d of %d in %ds", self.name, message, done + 1, ctx.retries, wait
        )
        return Retry(max=ctx.retries, interval=[wait])

    def retry_or_fail(self, reason: str, message: str, interval: int | None = None) -> JobResult | Retry:
        """A transient failure: the job retried later while its budget lasts, else its samples failed.
        The failure counts the job's attempts (its first run and RQ's retries of it) apart from what
        `message` counts (the engine client's own tries within this attempt: "failed 5 times"), so the
        two counts are never read as one."""
        ctx, job = self.ctx, self.job
        done = (job.number_of_retries or 0) if job is not None else 0  # retries RQ ran; none without a job
        if job is not None and done < ctx.retries:
            wait = ctx.retry_intervals[min(done, len(ctx.retry_intervals) - 1)] if interval is None else interval
            log.warning("job %s: %s (%s); retry %d of %d in %ds", job.id, reason, message, done + 1, ctx.retries, wait)
            ctx.ledger.add_stats(job_retries=1)
            return Retry(max=ctx.retries, interval=[wait] if wait else 0)
        retries = f"{done} {'retry' if done == 1 else 'retries'}"
        why = f"{message} (the job's attempt {done + 1} of {done + 1}: it gave up after {retries})"
        self.fail({s.id: (reason, why) for s in self.todo})
        return JobResult(failed=len(self.todo))


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
