"""Helpers for the operations tests: real `harvest` processes (engine, workers, collector,
exporter) on a real redis-server, started as a user would and always stopped afterwards."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import redis

from harvest.cli.redisproc import free_port
from harvest.config import RunConfig
from harvest.health import healthy
from harvest.ids import job_id_for
from harvest.sample import Sample
from harvest.state.jobs import enqueue_samples, run_queue
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.cli import REPO
from tests.support.wait import wait_for

wait_until = wait_for  # the operations tests' name for tests.support.wait.wait_for


class Procs:
    """`harvest` subprocesses with logs in `log_dir`; `close()` stops every one it started."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        p = subprocess.Popen(
            [sys.executable, "-m", "harvest.cli", "-v", *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env} if env else None,
        )
        log.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def engine(self, name: str, model: str, dump_dir: str, layers: str = "eagle3", port: int | None = None) -> str:
        port = port or free_port()
        p = self.start(
            name, "engine", "--model", model, "--dump-dir", dump_dir, "--port", str(port), "--layers", layers
        )
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert p.poll() is None, self.log(name)
            return healthy(url, 1)

        wait_until(up, 120, f"engine {name} healthy")
        return url

    def wait(self, name: str, timeout: float = 120) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout}s:\n{self.log(name)[-3000:]}") from None

    def stop(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        for name in list(self.procs):
            p = self.procs[name]
            if p.poll() is None:
                p.kill()
                p.wait()


def new_run(
    conn: redis.Redis, run: str, model: str, out: str, batch: int = 4, dtype: str = "fp32", spool_grace_s: float = 120.0
) -> RunConfig:
    """Publish a run whose jobs hold `batch` samples (several jobs from a small dataset)."""
    from harvest.config import build_config

    cfg = dataclasses.replace(
        build_config(run, model, out, "eagle3", dtype, spool_grace_s=spool_grace_s), max_batch_samples=batch
    )
    return publish_run(conn, cfg)


def enqueue(conn: redis.Redis, cfg: RunConfig, samples: list[Sample]) -> str:
    """Enqueue a batch the way the producer does (ledger + RQ job in one MULTI): used to inject
    samples no producer makes, such as token ids beyond the vocabulary."""
    ids = [s.id for s in samples]
    job_id = job_id_for(cfg.run, ids)
    with conn.pipeline(transaction=True) as pipe:
        pipe.multi()
        Ledger(conn, cfg.run).add_queued(ids, pipe=pipe)
        enqueue_samples(run_queue(conn, cfg.run), cfg.run, samples, job_id, pipe)
        pipe.execute()
    return job_id


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def reconcile_if_new(conn: redis.Redis, run: str) -> None:
    """The run's ledger reconciled on a server no process of the run reconciled it on, as a process
    would (the operator's janitor holds reaping, and keeps dead workers' claim dirs, until one does).
    For a harness whose processes are all stopped: the hold that takes protects no live heartbeat,
    so it is lifted."""
    from harvest.ops.recovery import Recovery, reconciled_on, server_id
    from harvest.state.keys import Keys
    from harvest.state.runstore import load_run

    if not reconciled_on(conn, run, server_id(conn)):
        Recovery(conn, load_run(conn, run)).reconcile_now()
        conn.delete(Keys(run).reap_after)
