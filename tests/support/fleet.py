"""A simulated fleet on one machine: N nodes of real `harvest worker` and `harvest collect`
processes against one Redis, with the zero-cost engine (engines/synthetic.py) and the commands
each role sends counted on the client side. Used by bench/fleet.py.

Who sends what. Redis 7.0 counts commands per command (INFO commandstats) but not per client,
so every process of the fleet runs `python -m tests.support.fleet ROLE STATS_FILE -- harvest
args...`: this installs a counter in redis-py's command packer (every command a client sends
passes there once: plain calls, pipelines, transactions, scripts' EVALSHA), tags each command
with the activity that sent it (a worker's job, its RQ loop, its heartbeat thread, its janitor
pass; a collector's commit steps or its loop), and writes the counts to STATS_FILE every second
and at exit. Commands run inside Lua scripts are not sent, so they are not counted here; the
server's commandstats (`RedisStats`) count them.

Layout: node n has `<root>/dump<n>` (the engine's port n writes there, its workers claim from
there) and `<root>/spool<n>` (its workers' and its collector's); one engine process serves
every node, one port each (a node's engine is only a dump dir and a port here).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import redis

from tests.support.cli import REPO

_counts: Counter = Counter()  # (activity, COMMAND) -> commands sent
_lock = threading.Lock()
_tls = threading.local()


def activity() -> str:
    return getattr(_tls, "activity", None) or _default_activity()


def _default_activity() -> str:
    name = threading.current_thread().name
    return f"{_ROLE}.beat" if name == "harvest-heartbeat" else f"{_ROLE}.{_REST}"


_ROLE, _REST = "bench", "other"
TRIPS = "~trips"  # the pseudo-command counting round trips (sends), beside the commands


class tagged:
    """Commands sent inside this block count for `name` (on this thread)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        self.prev = getattr(_tls, "activity", None)
        _tls.activity = self.name

    def __exit__(self, *exc):
        _tls.activity = self.prev


def _wrap(fn, name: str):
    def wrapper(*a, **kw):
        with tagged(name):
            return fn(*a, **kw)

    wrapper.__wrapped__ = fn
    return wrapper


def install_counter(role: str, rest: str = "other") -> None:
    """Count every command this process's redis-py clients send, by activity."""
    global _ROLE, _REST
    _ROLE, _REST = role, rest
    from redis.connection import PythonRespSerializer

    classes = [PythonRespSerializer]
    try:
        from redis.connection import HiredisRespSerializer

        classes.append(HiredisRespSerializer)
    except ImportError:  # pragma: no cover - redis-py without hiredis support
        pass
    for cls in classes:
        if getattr(cls.pack, "_counted", False):
            continue
        orig = cls.pack

        def pack(self, *args, _orig=orig):
            cmd = args[0]
            name = (cmd.decode() if isinstance(cmd, bytes) else str(cmd)).split(" ")[0].upper()
            with _lock:
                _counts[(activity(), name)] += 1
            return _orig(self, *args)

        pack._counted = True
        cls.pack = pack
    from redis.connection import AbstractConnection

    if not getattr(AbstractConnection.send_packed_command, "_counted", False):
        orig_send = AbstractConnection.send_packed_command

        def send_packed_command(self, command, check_health=True):
            """One send is one round trip (a pipeline's commands go in one): counted as `~trips`."""
            with _lock:
                _counts[(activity(), TRIPS)] += 1
            return orig_send(self, command, check_health)

        send_packed_command._counted = True
        AbstractConnection.send_packed_command = send_packed_command


def counts() -> dict[str, dict[str, int]]:
    """activity -> command -> commands sent so far (this process)."""
    out: dict[str, dict[str, int]] = {}
    with _lock:
        for (act, cmd), n in _counts.items():
            out.setdefault(act, {})[cmd] = n
    return out


def sent_counts() -> Counter:
    """(activity, COMMAND) -> commands this process sent so far."""
    return Counter({(a, c): n for a, cmds in counts().items() for c, n in cmds.items()})


def _tag_roles(role: str) -> None:
    """Name the activities of a worker or a collector by wrapping their entry points."""
    if role == "worker":
        import harvest.workers.job
        import harvest.workers.worker

        harvest.workers.job.process_batch = _wrap(harvest.workers.job.process_batch, "worker.job")
        harvest.workers.worker.janitor_pass = _wrap(harvest.workers.worker.janitor_pass, "worker.janitor")
    elif role == "collector":
        from harvest.collector.collector import Collector

        Collector.step = _wrap(Collector.step, "collector.commit")


def child_main(argv: list[str]) -> None:
    """`python -m tests.support.fleet ROLE STATS_FILE -- harvest args...`"""
    role, path, sep, *args = argv
    assert sep == "--", argv
    asked = threading.Event()
    seq = [0]
    signal.signal(signal.SIGUSR1, lambda *_: asked.set())  # first: the bench may ask before the imports end
    install_counter(role, "rq" if role == "worker" else "loop")
    _tag_roles(role)

    def dump() -> None:
        tmp = f"{path}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "seq": seq[0], "counts": counts()}, f)
        os.replace(tmp, path)

    def every_second() -> None:  # and at once when the bench asks (SIGUSR1): a snapshot of the whole fleet
        while True:
            if asked.wait(1.0):
                asked.clear()
                seq[0] += 1
            dump()

    atexit.register(dump)
    threading.Thread(target=every_second, name="fleet-stats", daemon=True).start()
    from harvest.cli import main

    sys.argv = ["harvest", *args]
    try:
        main()
    finally:
        dump()


@dataclass
class RedisStats:
    """What the server says of itself at one moment: commands by name (Lua's inner ones
    included), the main thread's CPU (and of it the kernel's: system calls, page faults), memory,
    bytes read from and written to clients."""

    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float
    memory: int
    sys_s: float = 0.0
    net_in: int = 0
    net_out: int = 0

    @classmethod
    def read(cls, conn: redis.Redis) -> RedisStats:
        """One `INFO all`: the next reading's delta holds this very INFO (counted once it ended)."""
        info = conn.info("all")
        cs = {k.removeprefix("cmdstat_"): v for k, v in info.items() if k.startswith("cmdstat_")}
        return cls(
            {k: v["calls"] for k, v in cs.items()},
            {k: v["usec"] for k, v in cs.items()},
            info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"],
            info["used_memory"],
            info["used_cpu_sys_main_thread"],
            info["total_net_input_bytes"],
            info["total_net_output_bytes"],
        )

    def since(self, before: RedisStats) -> RedisStats:
        calls = {k: v - before.calls.get(k, 0) for k, v in self.calls.items()}
        return RedisStats(
            {k: v for k, v in calls.items() if v},
            {k: v - before.usec.get(k, 0) for k, v in self.usec.items()},
            self.cpu_s - before.cpu_s,
            self.memory - before.memory,
            self.sys_s - before.sys_s,
            self.net_in - before.net_in,
            self.net_out - before.net_out,
        )

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/<pid>/stat); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


@dataclass
class Fleet:
    """N simulated nodes of run `run`: one engine process, per node `workers` workers and a collector."""

    root: str
    redis_url: str
    run: str
    nodes: int
    base_port: int  # node n's engine port is base_port + n: tests.support.ports.reserve_ports
    workers: int = 1
    hidden: int = 4
    capture: str = "2,4,5,8"
    collector_args: tuple[str, ...] = ("--max-wait", "1", "--pack-workers", "1")
    worker_args: tuple[str, ...] = ()
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    cpu_gone: Counter = field(default_factory=Counter)  # role -> CPU s of processes that exited

    def dump(self, n: int) -> str:
        return os.path.join(self.root, f"dump{n}")

    def spool(self, n: int) -> str:
        return os.path.join(self.root, f"spool{n}")

    def stats_file(self, name: str) -> str:
        return os.path.join(self.root, "stats", f"{name}.json")

    def node_procs(self, n: int) -> list[str]:
        return [*(f"worker{n}.{j}" for j in range(self.workers)), f"collector{n}"]

    def _popen(self, name: str, argv: list[str]) -> None:
        os.makedirs(os.path.join(self.root, "logs"), exist_ok=True)
        with open(os.path.join(self.root, "logs", f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def start_engine(self) -> None:
        serve = [x for n in range(self.nodes) for x in ("--serve", f"{self.base_port + n}={self.dump(n)}")]
        self._popen(
            "engine",
            [
                sys.executable,
                "-m",
                "harvest.engines.synthetic",
                *serve,
                "--capture",
                self.capture,
                "--hidden",
                str(self.hidden),
            ],
        )

    def start(self, name: str) -> None:
        os.makedirs(os.path.join(self.root, "stats"), exist_ok=True)
        role = name.rstrip("0123456789.")
        n = int(name[len(role) :].split(".")[0])
        common = ["--run", self.run, "--redis", self.redis_url, "--node", f"node{n}"]
        if role == "worker":
            args = [
                "worker",
                *common,
                "--engine-url",
                f"http://127.0.0.1:{self.base_port + n}",
                "--dump-dir",
                self.dump(n),
                "--spool-dir",
                self.spool(n),
                "--dump-timeout",
                "10",
                "--retry-backoff",
                "1",
                "--retries",
                "20",
                "--engine-wait",
                "60",
                *self.worker_args,
            ]
        else:
            args = ["collect", *common, "--spool-dir", self.spool(n), *self.collector_args]
        self._popen(name, [sys.executable, "-m", "tests.support.fleet", role, self.stats_file(name), "--", *args])

    def start_all(self) -> None:
        self.start_engine()
        for n in range(self.nodes):
            for name in self.node_procs(n):
                self.start(name)

    def kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            cpu = proc_cpu_s(p.pid)
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.cpu_gone[name.rstrip("0123456789.")] += cpu

    def stop(self, timeout: float = 30) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def cpu(self) -> Counter:
        """role -> CPU seconds of the role's live processes (plus those killed)."""
        out = Counter(self.cpu_gone)
        for name, p in self.procs.items():
            if p.poll() is None:
                out[name.rstrip("0123456789.")] += proc_cpu_s(p.pid)
        return out

    def _read_stats(self) -> dict[str, dict]:
        out = {}
        d = os.path.join(self.root, "stats")
        for f in os.listdir(d) if os.path.isdir(d) else []:
            if f.endswith(".json"):
                try:
                    with open(os.path.join(d, f)) as fh:
                        out[f.removesuffix(".json")] = json.load(fh)
                except (OSError, ValueError):
                    continue
        return out

    def sent(self, timeout: float = 5.0) -> Counter:
        """(activity, COMMAND) -> commands sent so far by the fleet's processes: each live one is
        asked (SIGUSR1) for its counts now, and waited for."""
        before = {k: v.get("seq", 0) for k, v in self._read_stats().items()}
        live = [n for n, p in self.procs.items() if n != "engine" and p.poll() is None]
        for n in live:
            os.kill(self.procs[n].pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while True:
            stats = self._read_stats()
            if all(stats.get(n, {}).get("seq", 0) > before.get(n, 0) for n in live) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out: Counter = Counter()
        for data in stats.values():
            for act, cmds in data["counts"].items():
                for cmd, n in cmds.items():
                    out[(act, cmd)] += n
        return out


def rq_cost(conn: redis.Redis, root: str, cfg, jobs: int, base_us_s: float, make_samples) -> dict:
    """One worker in this process (harvest's RQ worker, burst) runs `jobs` jobs of the run `cfg`'s
    size (`make_samples(n)`) against the synthetic engine: Redis CPU per job (less an idle server's
    own, `base_us_s`), and how much of it is harvest's scripts (commandstats' EVALSHA time, their
    inner calls included) and how much the rest, RQ's own."""
    import threading

    from harvest.cli.redisproc import free_port
    from harvest.engines.reference import serve
    from harvest.engines.synthetic import SyntheticEngine
    from harvest.node.dumpdir import claim_dir
    from harvest.node.paths import private_dir
    from harvest.state.heartbeat import WorkerBeat
    from harvest.state.jobs import SERIALIZER, run_queue
    from harvest.workers.clients.sglang import SGLangClient
    from harvest.workers.context import WorkerContext, install
    from harvest.workers.rqworker import HarvestWorker
    from harvest.workers.safejob import HarvestJob
    from tests.support.ops import enqueue

    job = cfg.max_batch_samples
    dump = private_dir(os.path.join(root, f"{cfg.run}-dump"), "dump dir")
    port = free_port()
    httpd = serve(SyntheticEngine(dump, cfg.capture_points, cfg.hidden_size), "127.0.0.1", port)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    beat = WorkerBeat(conn, cfg.run, "bench-1-aaaaaa", "bench", f"http://127.0.0.1:{port}")
    beat.start()
    claims = private_dir(claim_dir(dump, beat.name), "claim dir")
    install(
        WorkerContext(
            conn=conn,
            cfg=cfg,
            engine=SGLangClient(f"http://127.0.0.1:{port}"),
            dump_dir=dump,
            spool_dir=os.path.join(root, f"{cfg.run}-spool"),
            claim_dir=claims,
            beat=beat,
            node="bench",
        )
    )

    def work(n: int) -> tuple[RedisStats, float, int]:
        with tagged("bench.rq"):
            for _ in range(n):
                enqueue(conn, cfg, make_samples(job))
        r0, t0, sends = RedisStats.read(conn), time.monotonic(), counts().get("bench.rqwork", {}).get(TRIPS, 0)
        with tagged("bench.rqwork"):
            HarvestWorker(
                [run_queue(conn, cfg.run, job_class=HarvestJob)],
                connection=conn,
                serializer=SERIALIZER,
                name=beat.name,
                job_class=HarvestJob,
                beat=beat,
            ).work(burst=True, logging_level="WARNING")
        sends = counts()["bench.rqwork"].get(TRIPS, 0) - sends
        return RedisStats.read(conn).since(r0), time.monotonic() - t0, sends

    work(2)  # scripts loaded
    r, seconds, sends = work(jobs)
    httpd.shutdown()
    cpu = (r.cpu_s * 1e6 - base_us_s * seconds) / jobs
    scripts = r.usec.get("evalsha", 0) / jobs
    return {
        "job": job,
        "cpu_us": cpu,
        "scripts_us": scripts,
        "rq_us": cpu - scripts,
        "commands": (r.total - 1) / jobs,
        "trips": sends / jobs,
    }


if __name__ == "__main__":
    child_main(sys.argv[1:])
