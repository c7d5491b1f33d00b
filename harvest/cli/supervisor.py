"""The children of `harvest run`, kept alive as a process manager would.

`harvest run` owns its children (engine, workers, collector) for the whole run. A child that
dies is started again after a backoff (1 s, doubling, at most 30 s): every child's work is
crash-safe on its own (a worker's job goes back through the janitor, the collector resumes its
recorded shard, workers wait for the engine), so a restart is all the repair there is. Only a
child that keeps dying at start (`max_deaths` exits within `window_s`) ends the run, with its
last log lines. Stopping goes in dependency order: workers finish their job first, then the
collector commits what is spooled, then the engine; each step is a line in supervisor.log.

Every child runs in a session (and process group) of its own: a Ctrl-C in the runner's terminal
reaches the runner alone, which then stops them in that order (a SIGINT to every child at the
same instant would stop Redis first: workers would fail their jobs and leave spool files
uncommitted). A second Ctrl-C (`hurry`) hands the workers' jobs back at once (a worker's
second SIGTERM). As no terminal kills them, a child must not outlive a runner that
is SIGKILLed: each asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG), the
crash every child is built to survive; the next `harvest run` resumes.

The run's private redis-server is not one of these children: `poll` runs on the run's main
thread, which waits inside a Redis call while Redis is away, so harvest.cli.redisproc.RedisKeeper
restarts it from a thread of its own (and notes it in the same supervisor.log). A child that
meets an outage waits it out (harvest.state.connection); past the limit it exits with status 75
and is restarted like any other.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harvest.errors import OutputRefused, ServiceError

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
SECOND_SIGNAL_AFTER_S = 1.0  # a hurried stop's SIGTERMs come at least this long after the first, and repeat so
PR_SET_PDEATHSIG = 1  # linux/prctl.h
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
MAX_DEFERRED = 1000  # supervisor.log lines kept in memory while its disk is full; older ones are dropped
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def detached(death_signal: int = signal.SIGKILL) -> Callable[[], None]:
    """A Popen `preexec_fn`: the child gets a session of its own (a terminal's Ctrl-C does not
    reach it) and `death_signal` when the process that started it dies, however it dies. Only
    async-signal-safe calls run in the child (setsid, prctl through a function resolved here,
    getppid, kill)."""
    parent = os.getpid()
    prctl = _LIBC.prctl if _LIBC is not None else None

    def preexec() -> None:
        os.setsid()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: no signal would come
            os.kill(os.getpid(), death_signal)

    return preexec


def kill_group(pid: int) -> None:
    """SIGKILL the process group a detached child leads (what it started goes too)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ChildKeepsDying(ServiceError, RuntimeError):
    """A child died `max_deaths` times within `window_s`: restarting it again would not help."""

    def __init__(self, message: str, child: str = "") -> None:
        super().__init__(message)
        self.child = child  # its name


class ChildRefused(OutputRefused):
    """A child exited with `OutputRefused.exit_status`: the output refuses writes, so a restart
    meets the same wall. The run stops at once (in order) with the child's own line."""


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None
    proc: subprocess.Popen | None = None
    deaths: list[float] = field(default_factory=list)  # monotonic times of its exits
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again
    held: bool = False  # stopped for a while (a full disk): not restarted, its exit not counted
    stopped: bool = False  # stopped for good


class Supervisor:
    def __init__(
        self, log_dir: str, max_deaths: int = 5, window_s: float = 60.0, backoff_s: tuple[float, ...] = BACKOFF_S
    ) -> None:
        self.log_dir = log_dir
        self.max_deaths, self.window_s, self.backoff_s = max_deaths, window_s, backoff_s
        self.children: dict[str, Child] = {}
        self.hurried = False  # a second Ctrl-C: workers hand their jobs back at once
        self.tolerant = False  # while the run is paused, a child that keeps dying does not end it
        self._deferred: list[str] = []  # supervisor.log lines a full disk refused, written at the next note
        self._dropped = 0
        self._note_lock = threading.Lock()  # the Redis keeper notes from its own thread

    def start(
        self,
        name: str,
        args: list[str],
        cmd: list[str] | None = None,
        env: dict[str, str] | None = None,
        held: bool = False,
    ) -> subprocess.Popen | None:
        """`harvest <args>` as a child; or `cmd` (a whole argv, e.g. the vLLM server) with `env` added.
        `held`: known but not started until `release` (a work dir whose disk is full at the start)."""
        child = Child(name, cmd or [sys.executable, "-m", "harvest.cli", *args], env, held=held)
        self.children[name] = child
        return None if held else self._spawn(child)

    def _spawn(self, child: Child) -> subprocess.Popen:
        try:
            log = open(os.path.join(self.log_dir, f"{child.name}.log"), "ab")
        except OSError as e:  # a full disk: the child runs all the same, its output lost until its restart
            if e.errno not in DISK_FULL:
                raise
            log = open(os.devnull, "wb")
            self.note(f"{child.name}: its log cannot be opened ({e.strerror}): its output is dropped until it restarts")
        child.proc = subprocess.Popen(
            child.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **child.env} if child.env else None,
            preexec_fn=detached(signal.SIGKILL),
        )
        log.close()
        child.restart_at = None
        return child.proc

    def poll(self) -> None:
        """Restart the children that died and are due; raise ChildKeepsDying for one that keeps dying."""
        now = time.monotonic()
        for child in self.children.values():
            if child.stopped or child.held:
                continue
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                if child.proc.returncode == OutputRefused.exit_status:
                    said = self.last_error(child.name).removeprefix(f"{child.name} stopped: ")
                    raise ChildRefused(f"the run stopped because its {child.name} stopped: {said}")
                child.deaths = [t for t in child.deaths if now - t < self.window_s] + [now]
                if self.tolerant:
                    child.deaths = child.deaths[-(self.max_deaths - 1) :]
                if len(child.deaths) >= self.max_deaths:
                    raise ChildKeepsDying(
                        f"{child.name} died {len(child.deaths)} times within {self.window_s:.0f}s (last exit status "
                        f"{child.proc.returncode}); last lines of its log:\n{self.tail(child.name)}",
                        child.name,
                    )
                wait = self.backoff_s[min(len(child.deaths) - 1, len(self.backoff_s) - 1)]
                child.restart_at = now + wait
                self.note(f"{child.name} exited with status {child.proc.returncode}: restarting it in {wait:.0f}s")
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)

    def hold(self, names: list[str]) -> None:
        """Stop these children for a while (SIGTERM: a worker finishes its job), without waiting
        and without restarting them, until `release`."""
        for n in names:
            child = self.children.get(n)
            if child is None or child.held or child.stopped:
                continue
            child.held, child.restart_at = True, None
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def release(self, names: list[str]) -> None:
        """Start held children again (one still finishing its job is restarted once it exited)."""
        for n in names:
            child = self.children.get(n)
            if child is None or not child.held:
                continue
            child.held = False
            if child.proc is not None and child.proc.poll() is None:
                child.restart_at = None  # its exit, when it comes, is a death like any (restarted after 1 s)
            else:
                self._spawn(child)

    def hurry(self) -> None:
        """A second Ctrl-C (or SIGTERM) while stopping: the workers hand their jobs back now. Only
        sets a flag: called from a signal handler; `stop` acts on it."""
        self.hurried = True

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

    def last_error(self, name: str) -> str:
        """The child's own `harvest: error:` line (the CLI's one line for its failure), else its last line."""
        lines = [x.strip() for x in self.tail(name, 50).splitlines() if x.strip()]
        errors = [x.removeprefix("harvest: error: ") for x in lines if x.startswith("harvest: error: ")]
        return (errors or lines or [f"exit status {OutputRefused.exit_status}, no output"])[-1]

    def note(self, line: str) -> None:
        """One timestamped line in supervisor.log (the run's Redis keeper writes there too). On a full
        disk (ENOSPC, EDQUOT) the line is kept in memory and written, with its own time, before the
        next line that fits (the run pauses meanwhile: harvest.cli.diskwatch): a log is never what
        stops a run. Past MAX_DEFERRED kept lines the oldest are dropped, and the count is written."""
        with self._note_lock:
            self._note(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def _note(self, line: str) -> None:
        self._deferred.append(line)
        if len(self._deferred) > MAX_DEFERRED:
            self._dropped += len(self._deferred) - MAX_DEFERRED
            del self._deferred[:-MAX_DEFERRED]
        text = "".join(self._deferred)
        if self._dropped:
            text = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} ({self._dropped} lines dropped: the disk was full)\n" + text
        try:
            with open(os.path.join(self.log_dir, "supervisor.log"), "a") as f:
                f.write(text)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            return  # a part may have been written: written again later, a line twice rather than none
        self._deferred, self._dropped = [], 0

    def stop(self, order: list[list[str]] | None = None, timeout: float = 60.0, deadline: float | None = None) -> None:
        """SIGTERM the children group by group (`order`: e.g. workers, then the collector, then the
        engine), waiting for each group to exit before the next; the rest go last. Each step is a
        line in supervisor.log. Once `hurry` was called, a group still running gets a second
        SIGTERM (a worker hands its job back); past `timeout`, or past `deadline` (a monotonic
        time, for all the groups together), a group is SIGKILLed."""
        named = [n for group in order or [] for n in group]
        groups = [[n for n in g if n in self.children] for g in order or []]
        groups.append([n for n in self.children if n not in named])
        for group in groups:
            live = []
            for n in group:
                child = self.children[n]
                child.stopped, child.held, child.restart_at = True, False, None  # never restarted again
                if child.proc is not None and child.proc.poll() is None:
                    live.append(n)
            if not live:
                continue
            self.note(f"stopping {', '.join(live)}")
            for n in live:
                self.children[n].proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            until = sent + timeout if deadline is None else min(sent + timeout, deadline)
            hurried_before = self.hurried  # hurried before this group's first SIGTERM: that one alone
            next_at, repeated = sent + SECOND_SIGNAL_AFTER_S, False
            while time.monotonic() < until and any(self.children[n].proc.poll() is None for n in live):
                # Not within a second of the first: two SIGTERMs that arrive before the child's
                # handler ran are one (signals do not queue), and the job would not be handed back.
                # Repeated until the group exits: RQ ignores a second signal within 1 s of the
                # moment its handler ran the first, which a loaded machine delays past our send
                # (a worker honours one cold stop only: harvest.workers.rqworker).
                if self.hurried and not hurried_before and time.monotonic() >= next_at:
                    running = [n for n in live if self.children[n].proc.poll() is None]
                    if not repeated:
                        self.note(f"stopping {', '.join(running)} at once (a second interrupt)")
                    for n in running:
                        self.children[n].proc.send_signal(signal.SIGTERM)
                    next_at, repeated = time.monotonic() + SECOND_SIGNAL_AFTER_S, True
                time.sleep(0.05)
            for n in live:
                p = self.children[n].proc
                if p.poll() is None:
                    self.note(f"{n} did not stop within {until - sent:.0f}s: killing it")
                    kill_group(p.pid)
                    p.wait()
                else:
                    kill_group(p.pid)  # whatever it started and left behind
                self.note(f"{n} stopped (exit status {p.returncode})")
