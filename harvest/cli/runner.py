"""`harvest run`: the whole pipeline on one machine, as separate processes.

Part of the composition root (with the CLI): it starts a private Redis unless given one,
the reference engine (an SGLang or vLLM CPU server from its venv when the run's engine is
`sglang` or `vllm`)
unless given an engine URL, N workers and a collector as child processes of the `harvest`
CLI (kept alive by harvest.cli.supervisor), produces the dataset in-process, and waits until
every sample of the run is done or failed.

Redis away. Its Redis client (harvest.state.connection) waits an outage out inside each call, as
every child's does, and its private redis-server is restarted by `RedisKeeper` on the same port
with the same AOF, so a killed Redis costs the run a pause. (It used to stop the run: its client
was `Redis.from_url`'s, which retries nothing, so the monitor's first ledger read after the kill
raised ConnectionError, and nothing started the server again.) Each monitor iteration asks the
run's `Recovery` (harvest.ops.recovery) whether Redis came back with a new identity, which
reconciles the ledger from storage. Past `outage_s` the run stops (RedisLost, exit 75) with
everything kept for the next `harvest run` to resume.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from harvest.cli.errors import connect_service
from harvest.cli.redisproc import RedisKeeper, RedisServer, free_port
from harvest.cli.supervisor import Supervisor
from harvest.config import RunConfig
from harvest.errors import ServiceError
from harvest.health import wait_healthy
from harvest.node.dumpdir import default_dump_dir
from harvest.ops.recovery import Recovery
from harvest.settings import EngineSettings, RunnerSettings
from harvest.state.connection import RedisLost
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the engines' PYTHONPATH


@dataclass
class RunSummary:
    run: str
    out: str
    enqueued: int
    skipped: int
    bad_rows: int
    done: int
    failed: int
    tokens: int
    bytes: int
    seconds: float
    failure_reasons: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # child name -> times the supervisor restarted it
    produced: str = ""  # the producer's own summary line (rows, overlong, truncated...)

    @property
    def exit_status(self) -> int:
        """0 when every sample is done and every row was good; 1 when samples failed or rows were bad."""
        return 1 if self.failed or self.bad_rows else 0

    def lines(self) -> list[str]:
        bad = f"  bad rows: {self.bad_rows}"
        if self.bad_rows:
            bad += " (each reported above on stderr with its file and line)"
        out = [
            f"run {self.run} -> {self.out}",
            f"  samples: {self.done} done, {self.failed} failed ({self.enqueued} enqueued now, {self.skipped} already known)",
            bad,
            f"  tokens: {self.tokens}, bytes: {self.bytes}, seconds: {self.seconds:.1f}",
        ]
        if self.produced:
            out.append(f"  produced: {self.produced}")
        for reason, n in sorted(self.failure_reasons.items(), key=lambda kv: -kv[1]):
            out.append(f"  failed because {reason}: {n} (`harvest status --run {self.run}` lists them)")
        if self.restarts:
            out.append("  restarted: " + ", ".join(f"{n} {k}x" for n, k in sorted(self.restarts.items())))
        return out


def default_work_dir(run: str) -> str:
    base = os.environ.get("HARVEST_WORK") or os.path.join(os.path.expanduser("~"), ".cache", "harvest", "work")
    return os.path.join(base, run)


def _stop_order(workers: list[str]) -> list[list[str]]:
    """Workers finish their job first, then the collector commits what they spooled, then the engine."""
    return [workers, ["collector"], ["engine"]]


def _report_bad(row) -> None:
    tqdm.write(f"{row.kind} row {row}", file=sys.stderr)  # above the progress bar


class EngineNotHealthy(ServiceError, RuntimeError):
    """The engine `harvest run` started did not answer /health in time (its log says why)."""


def _wait_http(url: str, children: Supervisor, timeout: float) -> None:
    """Wait for the engine's /health, restarting it (or giving up) as the supervisor decides."""
    if not wait_healthy(url, timeout, interval=0.2, probe_timeout=2.0, check=children.poll):
        raise EngineNotHealthy(f"engine at {url} not healthy after {timeout:.0f}s")


def _start_vllm(children: Supervisor, cfg: RunConfig, dumps: str) -> str:
    """Start a vLLM CPU server from its own venv (engines/vllm_launch.py) and wait until it is healthy."""
    from engines.vllm_launch import launch_spec, venv_python

    os.makedirs(dumps, mode=0o700, exist_ok=True)
    port = free_port()
    env, argv = launch_spec(cfg.model, cfg.capture_points, cfg.num_layers, dump_dir=dumps, port=port,
                            python=venv_python(), dtype="float32" if cfg.storage_dtype == "fp32" else "auto",
                            enforce_eager=True)
    # This checkout's connector (engines/vllm_connector.py), whichever checkout the venv was built from.
    env["PYTHONPATH"] = _REPO
    children.start("engine", [], cmd=argv, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, children, timeout=900)  # about a minute on a small CPU machine, more when it is busy
    return url


def _start_sglang(children: Supervisor, cfg: RunConfig, dumps: str, chunked_prefill_size: int) -> str:
    """Start an SGLang CPU server from its own venv (engines/sglang_launch.py) and wait until it is healthy."""
    from engines.sglang_launch import cpu_pythonpath, launch_spec, venv_python

    os.makedirs(dumps, mode=0o700, exist_ok=True)
    port = free_port()
    env, argv = launch_spec(cfg.model, cfg.capture_points, cfg.num_layers, dump_dir=dumps, port=port, device="cpu",
                            python=venv_python(), dtype="float32" if cfg.storage_dtype == "fp32" else "auto",
                            chunked_prefill_size=chunked_prefill_size or EngineSettings.sglang_chunked_prefill_size)
    env["PYTHONPATH"] = cpu_pythonpath(_REPO)  # this checkout's plugin, whichever built the venv
    children.start("engine", [], cmd=argv, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, children, timeout=600)  # about 20 s on a small CPU machine, more when it is busy
    return url


def run_all(cfg: RunConfig, dataset: str, settings: RunnerSettings = RunnerSettings(),
            produce_kw: dict | None = None) -> RunSummary:
    """`settings`: where and how (harvest.settings.RunnerSettings; its `outage_s`: how long this
    process and its children wait for a Redis that went away, None: the default,
    harvest.state.connection.outage_limit); `produce_kw`: the producer's options
    (`harvest.cli.options.producer_kwargs`). Raises RedisLost past the outage limit."""
    t0 = time.monotonic()
    redis_url, engine_url, outage_s = settings.redis_url, settings.engine_url, settings.outage_s
    chunked_prefill_size = settings.chunked_prefill_size
    work = settings.work_dir or default_work_dir(cfg.run)
    os.makedirs(work, mode=0o700, exist_ok=True)
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    spool = os.path.join(work, "spool")
    dumps = settings.dump_dir or default_dump_dir(cfg.run)
    server = keeper = None
    children = Supervisor(logs)
    names: list[str] = []
    try:
        if redis_url is None:
            server = RedisServer(os.path.join(work, "redis")).start()
            redis_url = server.url
            keeper = RedisKeeper(server, note=children.note)
            keeper.start()
        conn = connect_service(redis_url, outage_s)
        cfg = publish_run(conn, cfg)
        recovery = Recovery(conn, cfg)
        engine = False
        if engine_url is None and cfg.engine == "vllm":
            engine_url = _start_vllm(children, cfg, dumps)
        elif engine_url is None and cfg.engine == "sglang":
            engine_url = _start_sglang(children, cfg, dumps, chunked_prefill_size)
        elif engine_url is None:
            port = free_port()
            engine_url = f"http://127.0.0.1:{port}"
            layers = ",".join(map(str, cfg.capture_points))
            engine = True
            children.start(
                "engine",
                ["engine", "--model", cfg.model, "--dump-dir", dumps, "--port", str(port), "--layers", layers,
                 "--chunked-prefill-size", str(chunked_prefill_size)],
            )
        # Start-up is mostly imports (torch) and the engine's model load: overlap them. Workers
        # start now and wait for the engine's /health themselves; this process imports what
        # reconcile and the producer need meanwhile; the collector starts once reconcile has
        # rebuilt the done-set from the index files (it must not take a committed sample for new).
        common = ["--redis", redis_url, "--run", cfg.run]
        if outage_s is not None:
            common += ["--redis-wait", str(outage_s)]  # the children wait for Redis as long as this process
        names = [f"worker-{i + 1}" for i in range(settings.workers)]
        for name in names:
            children.start(name, ["worker", *common, "--engine-url", engine_url, "--dump-dir", dumps,
                                  "--spool-dir", spool, "--engine-wait", f"{settings.worker_engine_wait_s:g}"])
        from harvest.ops.reconcile import reconcile

        reconcile(conn, cfg)
        children.start("collector", ["collect", *common, "--spool-dir", spool, "--max-wait", str(settings.max_wait_s)])
        if engine:
            _wait_http(engine_url, children, timeout=300)
        from producer.producer import produce

        summary = produce(conn, cfg, dataset, max_queued=settings.max_queued, progress=settings.progress,
                          on_bad=_report_bad, on_wait=lambda _: children.poll(), **(produce_kw or {}))
        ledger = Ledger(conn, cfg.run)
        bar = tqdm(total=ledger.counts()["total"], desc="extract", unit=" samples", disable=not settings.progress)
        while True:
            recovery.check()  # rate-limited by itself: one INFO every few seconds
            c = ledger.counts()
            bar.total = c["total"]
            bar.n = c["done"] + c["failed"]
            bar.set_postfix_str(f"queued {c['queued']} spooled {c['spooled']} failed {c['failed']}")
            bar.refresh()
            if c["queued"] == 0 and c["spooled"] == 0:
                break
            children.poll()
            time.sleep(0.1)
        bar.close()
        children.stop(_stop_order(names))
        c, stats = ledger.counts(), ledger.stats()
        reasons = Counter(f["reason"] for f in ledger.failures().values())
        return RunSummary(
            run=cfg.run,
            out=cfg.out_url,
            enqueued=summary.enqueued,
            skipped=summary.skipped,
            bad_rows=summary.bad,
            done=c["done"],
            failed=c["failed"],
            tokens=stats.get("tokens_done", 0),
            bytes=stats.get("bytes_done", 0),
            seconds=time.monotonic() - t0,
            failure_reasons=dict(reasons),
            restarts=children.restarts(),
            produced=summary.text(),
        )
    except RedisLost as e:
        if keeper is not None and keeper.last_error:
            e.hint = f"its private redis-server did not start again: {keeper.last_error}"
        raise
    finally:
        children.stop(_stop_order(names))
        if keeper is not None:
            keeper.stop()  # before the server: a server stopped on purpose is not restarted
        if server is not None:
            server.stop()
