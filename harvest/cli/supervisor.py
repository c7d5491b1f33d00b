"""The children of `harvest run`, kept alive as a process manager would.

`harvest run` owns its children (engine, workers, collector) for the whole run. A child that
dies is started again after a backoff (1 s, doubling, at most 30 s): every child's work is
crash-safe on its own (a worker's job goes back through the janitor, the collector resumes its
recorded shard, workers wait for the engine), so a restart is all the repair there is. Only a
child that keeps dying at start (`max_deaths` exits within `window_s`) ends the run, with its
last log lines. Stopping goes in dependency order: workers finish their job first, then the
collector commits what is spooled, then the engine.

The run's private redis-server is not one of these children: `poll` runs on the run's main
thread, which waits inside a Redis call while Redis is away, so harvest.cli.redisproc.RedisKeeper
restarts it from a thread of its own (and notes it in the same supervisor.log). A child that
meets an outage waits it out (harvest.state.connection); past the limit it exits with status 75
and is restarted like any other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from harvest.errors import ServiceError

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class ChildKeepsDying(ServiceError, RuntimeError):
    """A child died `max_deaths` times within `window_s`: restarting it again would not help."""


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen | None = None
    deaths: list[float] = field(default_factory=list)  # monotonic times of its exits
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again


class Supervisor:
    def __init__(self, log_dir: str, max_deaths: int = 5, window_s: float = 60.0,
                 backoff_s: tuple[float, ...] = BACKOFF_S) -> None:
        self.log_dir = log_dir
        self.max_deaths, self.window_s, self.backoff_s = max_deaths, window_s, backoff_s
        self.children: dict[str, Child] = {}

    def start(self, name: str, args: list[str], cmd: list[str] | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """`harvest <args>` as a child; or `cmd` (a whole argv, e.g. the vLLM server) with `env` added."""
        child = Child(name, cmd or [sys.executable, "-m", "harvest.cli", *args], env)
        self.children[name] = child
        return self._spawn(child)

    def _spawn(self, child: Child) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{child.name}.log"), "ab")
        child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **child.env} if child.env else None)
        log.close()
        child.restart_at = None
        return child.proc

    def poll(self) -> None:
        """Restart the children that died and are due; raise ChildKeepsDying for one that keeps dying."""
        now = time.monotonic()
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                child.deaths = [t for t in child.deaths if now - t < self.window_s] + [now]
                if len(child.deaths) >= self.max_deaths:
                    raise ChildKeepsDying(
                        f"{child.name} died {len(child.deaths)} times within {self.window_s:.0f}s (last exit status "
                        f"{child.proc.returncode}); last lines of its log:\n{self.tail(child.name)}")
                wait = self.backoff_s[min(len(child.deaths) - 1, len(self.backoff_s) - 1)]
                child.restart_at = now + wait
                self.note(f"{child.name} exited with status {child.proc.returncode}: restarting it in {wait:.0f}s")
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)

    def alive(self, name: str) -> subprocess.Popen | None:
        """The child's running process, or None while it is dead (waiting for its restart)."""
        child = self.children[name]
        return child.proc if child.restart_at is None and child.proc and child.proc.poll() is None else None

    def restarts(self) -> dict[str, int]:
        return {c.name: c.restarts for c in self.children.values() if c.restarts}

    def tail(self, name: str, n: int = 20) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def note(self, line: str) -> None:
        """One timestamped line in supervisor.log (the run's Redis keeper writes there too)."""
        with open(os.path.join(self.log_dir, "supervisor.log"), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def stop(self, order: list[list[str]] | None = None, timeout: float = 30.0) -> None:
        """SIGTERM the children group by group (`order`: e.g. workers, then the collector, then the
        engine), waiting for each group to exit before the next; the rest go last."""
        named = [n for group in order or [] for n in group]
        groups = [[n for n in g if n in self.children] for g in order or []]
        groups.append([n for n in self.children if n not in named])
        for group in groups:
            procs = [self.children[n].proc for n in group if self.children[n].proc is not None]
            for n in group:
                self.children[n].restart_at = None  # a stopped child is not restarted
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
