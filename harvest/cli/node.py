"""One node of a run: its engines, their workers and its collector, under one Supervisor.

`Node` is the code both `harvest node` and `harvest run` run a node with. `harvest run` holds its
`Node` in its own process rather than starting `harvest node` as a child: the producer's
backpressure (`on_wait`) must start the consumers, the disk watch must hold and release the
workers, and the stop order must run after the producer, all on the run's one `Supervisor`; a
`harvest node` child would be a second supervisor above the same processes. `serve` is
`harvest node`'s own loop around a `Node`: it joins a run in a shared Redis, keeps the children
until the run is done, and stops them in order on SIGTERM.

The engines (harvest.cli.engineplan): the reference engine, or SGLang or vLLM servers with the
plugin or connector and the flags extraction needs (harvest.engines.sglang_launch, harvest.engines.vllm_launch),
`--dp` of them, each on its own `--tp` GPUs, each with its own dump dir and its `workers`
workers; or, with an engine URL, the server there. With one engine the names are those of a
single-engine node (`engine`, the dump dir itself); with more, `engine-1`... and `DUMPS/engine-1`...

Stopping goes workers first (each finishes its job: a second signal hands it back), then the
collector (it commits what is spooled), then the engines; each step is a line in supervisor.log.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from harvest.cli.diskwatch import DiskWatch
from harvest.cli.engineplan import EnginePlan
from harvest.cli.redisproc import free_port
from harvest.cli.supervisor import ChildKeepsDying, Supervisor
from harvest.config import RunConfig
from harvest.errors import ConfigurationError, ServiceError
from harvest.health import wait_healthy
from harvest.settings import EngineSettings, NodeSettings

HURRY_AT = 0.4  # of the stop grace: workers still on their job then hand it back


class EngineNotHealthy(ServiceError, RuntimeError):
    """An engine the node started did not answer /health in time (its log says why)."""


class EngineFailed(ConfigurationError, RuntimeError):
    """An engine the node started keeps exiting at start (a wrong model, a refused flag, no memory):
    the node's configuration, not something a restart mends."""


@dataclass
class EngineSlot:
    """One engine (started, or the server at `url`) with its dump dir and its workers."""

    name: str
    dump_dir: str
    workers: list[str]
    url: str | None = None
    health: str | None = None  # a started engine's URL until it answered /health once
    argv: list[str] = field(default_factory=list)


class Node:
    """The node's children, started once each, when there is work for them (`start_workers`, then
    `start_collector` once reconcile rebuilt the done-set); `tend` keeps them, `stop` stops them in order."""

    def __init__(
        self,
        children: Supervisor,
        cfg: RunConfig,
        settings: NodeSettings,
        plan: EnginePlan | None,
        redis_url: str,
        dumps: str,
        spool: str,
        disk: DiskWatch,
        model: str | None = None,
    ) -> None:
        self.children, self.cfg, self.settings, self.plan = children, cfg, settings, plan
        self.redis_url, self.dumps, self.spool, self.disk = redis_url, dumps, spool, disk
        self.model = model or cfg.model
        self.workers = self.collector = False
        n = 1 if plan is None else plan.dp
        per = settings.workers
        self.slots = [
            EngineSlot(
                "engine" if n == 1 else f"engine-{i + 1}",
                dumps if n == 1 else os.path.join(dumps, f"engine-{i + 1}"),
                [f"worker-{i * per + j + 1}" for j in range(per)],
                url=settings.engine_url,
            )
            for i in range(n)
        ]

    @property
    def names(self) -> list[str]:
        """The workers' names."""
        return [w for s in self.slots for w in s.workers]

    @property
    def started(self) -> bool:
        return self.workers

    def stop_order(self) -> list[list[str]]:
        """Workers finish their job first, then the collector commits what they spooled, then the engines."""
        return [self.names, ["collector"], [s.name for s in self.slots]]

    def _common(self) -> list[str]:
        common = ["--redis", self.redis_url, "--run", self.cfg.run]
        if self.settings.outage_s is not None:
            common += [
                "--redis-wait",
                str(self.settings.outage_s),
            ]  # the children wait for Redis as long as this process
        if self.settings.node:
            common += ["--node", self.settings.node]
        return common

    def _start_engine(self, i: int, slot: EngineSlot) -> None:
        os.makedirs(slot.dump_dir, mode=0o700, exist_ok=True)
        port = free_port()
        slot.url = slot.health = f"http://127.0.0.1:{port}"
        plan, cfg = self.plan, self.cfg
        chunk = self.settings.chunked_prefill_size
        if plan.engine == "reference":
            args = [
                "engine",
                "--model",
                self.model,
                "--dump-dir",
                slot.dump_dir,
                "--port",
                str(port),
                "--layers",
                ",".join(map(str, cfg.capture_points)),
                "--chunked-prefill-size",
                str(chunk),
            ]
            if plan.threads:
                args += ["--threads", str(plan.threads)]
            self.children.start(slot.name, args)
            return
        dtype = "float32" if cfg.storage_dtype == "fp32" else "auto"
        if plan.engine == "vllm":
            from harvest.engines.vllm_launch import launch_spec

            env, argv = launch_spec(
                self.model,
                cfg.capture_points,
                cfg.num_layers,
                dump_dir=slot.dump_dir,
                port=port,
                python=plan.python,
                dtype=dtype,
                enforce_eager=plan.device == "cpu",
                extra_args=["--tensor-parallel-size", str(plan.tp)] if plan.tp > 1 else (),
            )
        else:
            from harvest.engines.sglang_launch import launch_spec

            digest = cfg.model_fingerprint["digest"] if cfg.model_fingerprint else None
            env, argv = launch_spec(
                self.model,
                cfg.capture_points,
                cfg.num_layers,
                dump_dir=slot.dump_dir,
                port=port,
                device=plan.device,
                python=plan.python,
                dtype=dtype,
                tp_size=plan.tp,
                sglang_version=plan.version,
                fingerprint=digest,
                chunked_prefill_size=chunk or EngineSettings.sglang_chunked_prefill_size,
            )
        slot.argv = argv
        self.children.start(slot.name, [], cmd=argv, env={**env, **plan.env(i)})

    def start_workers(self) -> None:
        """The engines (unless given one) and the workers, which wait for its /health themselves.
        On a disk already full the workers are held, not started: a worker's first job would fill
        it further, and the first `tend` pauses the node (its line) and releases them later."""
        if self.workers:
            return
        for i, slot in enumerate(self.slots):
            if slot.url is None:
                self._start_engine(i, slot)
        held = self.disk.full()
        for slot in self.slots:
            for name in slot.workers:
                self.children.start(
                    name,
                    [
                        "worker",
                        *self._common(),
                        "--engine-url",
                        slot.url,
                        "--dump-dir",
                        slot.dump_dir,
                        "--spool-dir",
                        self.spool,
                        "--engine-wait",
                        f"{self.settings.worker_engine_wait_s:g}",
                    ],
                    held=held,
                )
        self.workers = True

    def start_collector(self) -> None:
        """After reconcile has rebuilt the done-set (a committed sample must not be taken for new)."""
        if not self.collector:
            self.children.start(
                "collector",
                ["collect", *self._common(), "--spool-dir", self.spool, "--max-wait", str(self.settings.max_wait_s)],
            )
            self.collector = True

    def wait_engine(self) -> None:
        """Until every engine it started answered /health once, keeping the children meanwhile."""
        for slot in self.slots:
            if slot.health:
                if not wait_healthy(
                    slot.health, self.settings.engine_start_s, interval=0.2, probe_timeout=2.0, check=self.poll
                ):
                    raise EngineNotHealthy(
                        f"{slot.name} at {slot.health} not healthy after "
                        f"{self.settings.engine_start_s:.0f}s (its log: {slot.name}.log)"
                    )
                slot.health = None

    def ensure(self) -> None:
        """Everything, now (the producer found work on a rerun that had none)."""
        self.start_workers()
        self.start_collector()
        self.wait_engine()

    def poll(self) -> None:
        """The supervisor's restarts; an engine that keeps dying at start is the node's configuration."""
        try:
            self.children.poll()
        except ChildKeepsDying as e:
            if e.child in {s.name for s in self.slots}:
                raise EngineFailed(
                    f"{e.child} keeps exiting at start: {self.children.last_error(e.child)} "
                    f"(its log: {os.path.join(self.children.log_dir, e.child + '.log')})"
                ) from e
            raise

    def tend(self) -> None:
        """One round of keeping the children: restarts due, and the disk's pause or resume."""
        change = self.disk.check()
        if change == "pause":
            self.children.tolerant = True
            self.children.hold(self.names)
            self.children.note(self.disk.pause_line())
            tqdm.write(self.disk.pause_line(), file=sys.stderr)
        elif change == "resume":
            self.children.release(self.names)
            self.children.tolerant = False
            self.children.note(self.disk.resume_line())
            tqdm.write(self.disk.resume_line(), file=sys.stderr)
        self.poll()

    def stop(self, grace: float | None = None) -> None:
        """In order (`stop_order`). `grace`: all within this many seconds, the workers handing their
        jobs back once HURRY_AT of it is gone; None: each group within a minute, jobs finished."""
        if grace is None:
            self.children.stop(self.stop_order())
            return
        timer = threading.Timer(grace * HURRY_AT, self.children.hurry)
        timer.daemon = True
        timer.start()
        try:
            self.children.stop(self.stop_order(), timeout=grace, deadline=time.monotonic() + grace)
        finally:
            timer.cancel()


def hurry_on_signals(children: Supervisor) -> None:
    """From now on Ctrl-C and SIGTERM hurry the stop (workers hand their jobs back at once)
    instead of interrupting it half-way."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: children.hurry())
