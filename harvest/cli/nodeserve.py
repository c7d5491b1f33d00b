"""`harvest node`: one node joins a run in a shared Redis, extracts until the run is done, and
exits with a status its scheduler (SLURM, Kubernetes) can act on.

It waits up to `join_wait_s` for Redis to answer and for the run to be in it (a node job may
start before the head job's Redis), starts its engines, workers and collector
(harvest.cli.node.Node, as `harvest run` does), keeps them, and reconciles the ledger when Redis
comes back as a new server (harvest.ops.recovery). The run is done when a producer finished its
pass over the dataset (harvest.state.passes) and nothing is queued or spooled, judged on a ledger
reconciled on the server answering.

Exit statuses (`NODE_EXIT`, docs/reference/exit-codes.md):

- 0: the run is done;
- 75: stopped by SIGTERM or SIGINT (workers first, then the collector commits what is spooled,
  all within the stop grace), or Redis away past the join wait: requeue the node; its spool is
  kept for the next start on this work dir, or reclaimed by the run's other nodes;
- 77: the output refuses writes;
- 78: a configuration error: a bad flag, an engine refused (package, version, GPUs) or failing
  at start, the model not the run's;
- 2: anything else the last line names.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import click

from harvest.cli.diskwatch import DiskWatch
from harvest.cli.engineplan import EnginePlan, plan_engines
from harvest.cli.errors import CONFIG_EXIT, connect_service, redact
from harvest.cli.node import EngineNotHealthy, Node, hurry_on_signals
from harvest.cli.supervisor import Supervisor
from harvest.cli.workdir import RunnerLocks, default_work_dir
from harvest.config import RunConfig
from harvest.errors import ConfigurationError, HarvestError, ServiceError
from harvest.ids import safe_id
from harvest.ops.recovery import Recovery
from harvest.settings import NodeSettings, RunnerSettings
from harvest.state.connection import REDIS_LOST_EXIT

if TYPE_CHECKING:
    import redis

DONE_EXIT = 0
REQUEUE_EXIT = REDIS_LOST_EXIT  # 75: a signal, or Redis away past the join wait (77: harvest.errors.OutputRefused)
JOIN_POLL_S = 2.0
LOOP_S = 0.5


class JoinTimedOut(ServiceError, TimeoutError):
    """Redis did not answer, or the run was not in it, within the join wait: the scheduler should
    start the node again later."""

    exit_status = REQUEUE_EXIT


def node_exit_status(err: HarvestError) -> int:
    """`harvest node`'s exit status for an error: a configuration error (an engine that fails at
    start included) is CONFIG_EXIT, so that the scheduler fails the job instead of requeueing it."""
    if isinstance(err, (ConfigurationError, EngineNotHealthy)):
        return CONFIG_EXIT
    return err.exit_status


def join(redis_url: str, run: str, wait_s: float) -> tuple[object, RunConfig]:
    """The Redis client and the run, once Redis answers and holds the run; JoinTimedOut past `wait_s`."""
    import redis

    from harvest.state.keys import Keys
    from harvest.state.runstore import load_run

    deadline = time.monotonic() + wait_s
    told = None
    while True:
        try:
            conn = connect_service(redis_url, wait_s)
            if conn.exists(Keys(run).config):
                return conn, load_run(conn, run)
            why = f"run {run} is not in Redis at {redact(redis_url)} yet"
        except redis.exceptions.AuthenticationError:
            raise
        except redis.exceptions.ConnectionError as e:
            why = f"Redis at {redact(redis_url)} does not answer ({' '.join(str(e).split())[:120]})"
        if time.monotonic() > deadline:
            raise JoinTimedOut(
                f"{why} after --join-wait {wait_s:.0f}s: start the node again once the run's Redis "
                "is up and the run is produced into it"
            )
        if why != told:
            click.echo(f"harvest node: waiting up to {wait_s:.0f}s: {why}", err=True)
            told = why
        time.sleep(JOIN_POLL_S)


def _done(conn: redis.Redis, run: str) -> bool:
    from harvest.state.ledger import Ledger
    from harvest.state.passes import produced

    c = Ledger(conn, run).counts()
    return c["queued"] == 0 and c["spooled"] == 0 and produced(conn, run)


def _check_engine(cfg: RunConfig, engine: str | None, model: str, plan: EnginePlan | None) -> None:
    from harvest.cli.checks import check_model
    from harvest.node.modelcheck import check_model_dir

    if engine is not None and engine != cfg.engine:
        raise ConfigurationError(
            f"--engine {engine}: run {cfg.run} extracts with {cfg.engine}; pass --engine "
            f"{cfg.engine} or leave --engine out"
        )
    if plan is not None:
        check_model(model, local_only=plan.engine == "reference")
        if os.path.isdir(model):
            check_model_dir(cfg, model, "--model")


def serve(
    run: str,
    redis_url: str,
    settings: NodeSettings,
    engine: str | None = None,
    model: str | None = None,
    work: str | None = None,
) -> int:
    """Join `run` and extract until it is done (DONE_EXIT) or a signal stops the node (REQUEUE_EXIT);
    errors raise (their status: `node_exit_status`)."""
    early = plan_engines(engine, settings.tp_size, settings.dp_size, settings.engine_url) if engine else None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return _serve(run, redis_url, settings, engine, model, work, early)
    except KeyboardInterrupt:  # before any child started
        return REQUEUE_EXIT


def _serve(
    run: str,
    redis_url: str,
    settings: NodeSettings,
    engine: str | None,
    model: str | None,
    work: str | None,
    early: EnginePlan | None,
) -> int:
    from harvest.cli.checks import check_output
    from harvest.node.dumpdir import default_dump_dir

    conn, cfg = join(redis_url, run, settings.join_wait_s)
    plan = early if engine else plan_engines(cfg.engine, settings.tp_size, settings.dp_size, settings.engine_url)
    model = model or cfg.model
    _check_engine(cfg, engine, model, plan)
    check_output(cfg.out_url, reach=False)  # credentials, before a worker reads a job's rows
    if _done(conn, run):
        click.echo(f"harvest node: run {run} is done: nothing queued or spooled, its producer finished its pass")
        return DONE_EXIT
    work = os.path.abspath(work or default_work_dir(run))
    dumps = default_dump_dir(run)
    if settings.node:  # one dump dir per node: several nodes may share a host (a SLURM test, a node per GPU)
        dumps = os.path.join(dumps, safe_id(settings.node, "node"))
    locks = RunnerLocks(work, dumps, run).acquire(run=run, redis=redact(redis_url))
    try:
        return _serve_locked(conn, cfg, redis_url, settings, plan, model, work, dumps)
    finally:
        locks.release()


def _serve_locked(
    conn: redis.Redis,
    cfg: RunConfig,
    redis_url: str,
    settings: NodeSettings,
    plan: EnginePlan | None,
    model: str,
    work: str,
    dumps: str,
) -> int:
    logs, spool = os.path.join(work, "logs"), os.path.join(work, "spool")
    os.makedirs(logs, exist_ok=True)
    children = Supervisor(logs)
    disk = DiskWatch(work, spool, None, RunnerSettings.min_free_bytes)
    node = Node(children, cfg, settings, plan, redis_url, dumps, spool, disk, model)
    recovery = Recovery(conn, cfg)
    stopped = False
    try:
        children.note(f"node {settings.node or ''} joins run {cfg.run} at {redact(redis_url)}".replace("  ", " "))
        node.start_workers()
        recovery.check(force=True)  # a Redis that came back empty is reconciled before the collector packs
        node.start_collector()
        node.wait_engine()
        click.echo(f"harvest node: extracting run {cfg.run} (logs: {logs})", err=True)
        while True:
            recovery.check()
            if _done(conn, cfg.run):
                if recovery.unchanged() and _done(conn, cfg.run):  # judged on a reconciled ledger
                    break
                continue
            node.tend()
            time.sleep(LOOP_S)
        children.note(f"run {cfg.run} is done: stopping")
        click.echo(f"harvest node: run {cfg.run} is done: nothing queued or spooled, its producer finished its pass")
        return DONE_EXIT
    except KeyboardInterrupt:
        hurry_on_signals(children)
        stopped = True
        children.note(
            f"stopping within {settings.stop_grace_s:.0f}s (a signal): workers, then the collector, then the engines"
        )
        node.stop(settings.stop_grace_s)
        click.echo(
            f"harvest node: stopped by a signal; the spool in {spool} is kept: start the node again to go on", err=True
        )
        return REQUEUE_EXIT
    finally:
        if not stopped:
            hurry_on_signals(children)
            node.stop(settings.stop_grace_s)
        sys.stdout.flush()
