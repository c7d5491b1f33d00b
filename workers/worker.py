"""`harvest worker`: an RQ worker bound to one run and one engine on this node.

Besides taking jobs, each worker keeps a heartbeat (harvest.state.heartbeat), writes its jobs'
stats and latencies (harvest.state.tally) and runs a janitor pass (harvest.ops.janitor) from a
background thread every few seconds, so as long as one worker of the run is alive, the job of a
worker that died is back on the queue within seconds, due retries are released, and dead
workers' claim dirs in this node's dump dir are removed.

SIGTERM (docker stop) is RQ's warm shutdown: the current job finishes, then the worker exits;
a second SIGTERM/SIGINT hands the current job back (see harvest.workers.job) and exits at once.

A Redis outage (harvest.state.connection) is waited out by every call, RQ's included: RQ 3.0's
SimpleWorker has no outage handling of its own beyond its dequeue loop (which retries
ConnectionError for ever, and quits on TimeoutError or anything else raised elsewhere in its
loop, leaving the job it held "started"), so the client does it for RQ. Past the limit the
client is latched, every call raises `RedisLost` (no ConnectionError, so RQ's dequeue loop lets
it through), RQ's loop quits, and `run_worker` re-raises it after leaving the heartbeat, the claim
dir and RQ's records as they are: the process is gone, so the janitor reaps its job. No janitor
pass runs until one heartbeat TTL after an outage ended, the time every live worker needs to
beat again: a heartbeat that expired while Redis was away is no sign of a dead worker.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable

import redis
import torch

from harvest.health import wait_healthy
from harvest.ids import check_id, node_name
from harvest.node.dumpdir import claim_dir as claim_dir_of
from harvest.node.modelcheck import check_engine
from harvest.node.paths import private_dir
from harvest.node.spooldir import clear_dead_temps
from harvest.ops.janitor import UnnamedDumps, janitor_pass
from harvest.ops.recovery import Recovery
from harvest.settings import WorkerSettings
from harvest.state.connection import RedisLost, is_connection_error, outage_of, redis_client
from harvest.state.heartbeat import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, WorkerBeat
from harvest.state.jobs import SERIALIZER, run_queue
from harvest.state.runstore import load_run
from harvest.workers.clients import make_engine
from harvest.workers.clients.base import Engine
from harvest.workers.job import WorkerContext, backoff_intervals, install
from harvest.workers.rqworker import HarvestWorker
from harvest.workers.safejob import HarvestJob

log = logging.getLogger("harvest.worker")

# RQ's own worker key TTL while idle; harvest's heartbeat, not this, decides liveness.
RQ_WORKER_TTL = 60


class _Background(threading.Thread):
    """Heartbeat and spool lease, then a janitor pass, every HEARTBEAT_INTERVAL_S until stopped."""

    def __init__(self, ctx: WorkerContext, beat: WorkerBeat, interval: float) -> None:
        super().__init__(name="harvest-heartbeat", daemon=True)
        self.ctx, self.conn, self.run_name, self.beat = ctx, ctx.conn, ctx.cfg.run, beat
        self.dump_dir, self.interval = ctx.dump_dir, interval
        self.unnamed = UnnamedDumps()  # the dump files its passes found no live worker naming
        self.stopped = threading.Event()

    def _flush(self) -> None:
        """The jobs' stats and latencies since the last beat (harvest.state.tally). A flush that
        fails is logged: it never holds up the recovery check and the janitor pass after it."""
        try:
            self.ctx.tally.flush()
        except RedisLost:
            raise
        except Exception:
            log.exception("writing the worker's stats failed (kept for the next beat, unless Redis ran part of it)")

    def run(self) -> None:
        outage = outage_of(self.conn)
        calm_at = 0.0  # monotonic time from which heartbeats can be trusted again
        while not self.stopped.wait(self.interval):
            try:
                self.beat.beat()  # first: after an outage, the beat that says this worker lives
                self.ctx.renew_lease()
                self._flush()
                t0 = time.monotonic()
                self.ctx.check_recovery()
                if time.monotonic() - t0 > self.interval:
                    # The ledger was being reconciled (here or elsewhere), and every process of the
                    # run waited for it without beating: their heartbeats may have lapsed meanwhile.
                    self.beat.beat()
                    calm_at = time.monotonic() + HEARTBEAT_TTL_S
                clear_dead_temps(self.ctx.spool_dir)  # spool files of jobs killed before their commit
                if time.monotonic() < calm_at or (outage is not None and outage.quiet_for() < HEARTBEAT_TTL_S):
                    self.unnamed.confirm(set())  # what its reads saw before proves nothing after
                    continue  # heartbeats lapsed while Redis was away: judge no worker dead yet
                # the run-wide part once per beat interval for the whole fleet, not once per worker's pass
                rep = janitor_pass(self.conn, self.run_name, self.dump_dir, hold_s=self.interval, unnamed=self.unnamed)
                if rep.any():
                    log.info("janitor: %s", rep.line())
            except RedisLost:
                return  # the job loop stops the worker; nothing here may reach Redis any more
            except Exception:  # an error of one pass must not kill the heartbeat for good
                log.exception("heartbeat/janitor pass failed")


class _NoTracebackForLost(logging.Filter):
    """RQ logs the exception that ends its loop with its traceback; for RedisLost that is a page of
    redis-py frames around the one line the CLI prints anyway (harvest.cli.errors)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RedisLost):
            record.msg, record.args = f"{record.getMessage()}: {record.exc_info[1]}", None
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_thread_exit(
    args: threading.ExceptHookArgs, default: Callable[[threading.ExceptHookArgs], object] = threading.excepthook
) -> None:
    """RQ's pubsub thread ends by raising RedisLost (after logging it): no traceback for that."""
    if not isinstance(args.exc_value, RedisLost):
        default(args)


def _wait_for_engine(engine: Engine, beat: WorkerBeat, seconds: float) -> None:
    """Take no job before the engine answers /health (an SGLang server loads for minutes): a job
    taken earlier would only spend its retry budget. After `seconds`, start anyway. A SIGTERM
    meanwhile ends the wait by its handler's SystemExit (run_worker's `_stop_before_work`)."""
    deadline = time.monotonic() + seconds
    if seconds <= 0 or engine.health():
        return
    beat.set_state("waiting for engine")
    log.warning("engine %s not healthy yet: waiting up to %.0fs before taking jobs", engine.url, seconds)
    wait_healthy(engine.url, deadline - time.monotonic(), interval=0.5, probe_timeout=5.0)
    beat.set_state("idle")


def _flush_last(ctx: WorkerContext) -> None:
    """A clean exit writes the tally's last seconds (harvest.state.tally); an error doing so is
    logged, not raised over the one that may be ending the worker."""
    try:
        ctx.tally.flush()
    except Exception as e:
        log.warning("the worker's last stats were not written: %s: %s", type(e).__name__, e)


def _first_check(ctx: WorkerContext) -> None:
    """A new Redis noticed before the first job, whose start is then read from a reconciled ledger
    (harvest.workers.rqworker `_start_of`). A check that fails otherwise than by the connection is the first
    job's to make again (it hands its job back if it fails too), not a reason to stop the worker."""
    try:
        ctx.check_recovery()
    except Exception as e:
        if ctx.redis_lost() or is_connection_error(e):
            raise
        log.warning("checking Redis for a restart before the first job: %s: %s", type(e).__name__, e)


def _stop_before_work(*_: object) -> None:
    raise SystemExit(0)


def run_worker(
    redis_url: str,
    run: str,
    engine_url: str,
    dump_dir: str,
    spool_dir: str,
    settings: WorkerSettings = WorkerSettings(),
    conn: redis.Redis | None = None,
) -> None:
    """`settings`: the worker's tunables (harvest.settings). `conn`: the client
    (harvest.state.connection.redis_client, already reached); made from `redis_url` when not
    given. Raises RedisLost when Redis stayed away past its limit."""
    # One intra-op thread: a worker's tensor work (the finiteness check, the dtype cast) is small
    # and memory-bound, and the cores belong to the engine and the other workers. With torch's
    # default (all cores) each such op waits for an OpenMP thread that the busy engine has
    # descheduled, several times its own time.
    torch.set_num_threads(1)
    host = check_id(settings.node, "node name") if settings.node else node_name()
    conn = conn if conn is not None else redis_client(redis_url)
    outage = outage_of(conn)
    cfg = load_run(conn, run)
    name = f"{host}-{os.getpid()}-{os.urandom(3).hex()}"
    beat = WorkerBeat(conn, run, name, host, engine_url)
    beat.start()  # before the claim dir exists: the janitor removes claim dirs of workers without one
    claim_dir = private_dir(claim_dir_of(private_dir(dump_dir, "dump dir"), name), "claim dir")
    ctx = WorkerContext(
        conn=conn,
        cfg=cfg,
        engine=make_engine(cfg, engine_url, dump_dir),
        dump_dir=dump_dir,
        spool_dir=private_dir(spool_dir, "spool dir"),
        claim_dir=claim_dir,
        dump_timeout=settings.dump_timeout_s,
        max_spool_bytes=settings.max_spool_bytes,
        retries=settings.retries,
        retry_intervals=backoff_intervals(settings.retry_backoff_s, settings.retries),
        beat=beat,
        node=host,
        recovery=Recovery(conn, cfg),
    )
    ctx.renew_lease()  # the spool is alive from now on (harvest.state.spools)
    install(ctx)
    queue = run_queue(conn, run, job_class=HarvestJob)
    worker = HarvestWorker(
        [queue],
        connection=conn,
        serializer=SERIALIZER,
        name=name,
        worker_ttl=RQ_WORKER_TTL,
        job_class=HarvestJob,
        beat=beat,
    )
    background = _Background(ctx, beat, HEARTBEAT_INTERVAL_S)
    background.start()
    logging.getLogger("rq.worker").addFilter(_NoTracebackForLost())
    threading.excepthook = _quiet_thread_exit
    log.info(
        "worker started: %s, run %s, node %s, engine %s at %s, spool %s (id %s), dump dir %s",
        name,
        run,
        host,
        cfg.engine,
        engine_url,
        ctx.spool_dir,
        ctx.spool_id,
        dump_dir,
    )
    try:
        # RQ installs its stop handlers only in work(): until then a SIGTERM (docker stop) must still
        # run the cleanup below, or the claim dir and heartbeat outlive the process.
        previous = signal.signal(signal.SIGTERM, _stop_before_work)
        try:
            _wait_for_engine(ctx.engine, beat, settings.engine_wait_s)
            check_engine(cfg, engine_url)  # another model than the run's: refused before any job
            _first_check(ctx)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if settings.burst:
            janitor_pass(conn, run, dump_dir)  # release due retries before a burst drains the queue
        worker.work(burst=settings.burst, logging_level="WARNING", max_jobs=settings.max_jobs)
        if outage is not None and outage.lost is not None:
            raise outage.lost  # RQ's loop quit on it (and logged it): the worker stops for that reason
    finally:
        background.stopped.set()
        background.join(timeout=10)
        if not ctx.redis_lost():
            _flush_last(ctx)
            beat.stop()
            shutil.rmtree(claim_dir, ignore_errors=True)
        # else: the heartbeat lapses by itself and the janitor removes the claim dir and reaps the job
        ctx.engine.close()
