"""The chaos harness's `freeze` fault (tests.support.chaos): a node frozen mid-commit, as a paused VM,
a long stall or a partition that heals, then resumed where it stopped.

Arming a node restarts its collector with `HARVEST_COLLECTOR_CRASH_AT=<random point>:<n>:stop`
(harvest.collector.faults), so it stops itself (SIGSTOP) at a random commit step. Once it has, the node's
other processes (engine, workers) are stopped too, so its spool lease goes silent; all are resumed
(SIGCONT) at a random time, within the spool grace or past it (then its spool is revoked and its
samples re-extracted and committed elsewhere meanwhile). Nothing is restarted: the processes carry
on from where they stopped.
"""

from __future__ import annotations

import random
import signal
import subprocess
from collections.abc import Callable

from harvest.collector.faults import CRASH_ENV, CRASH_POINTS
from tests.support.freeze import process_state


class Freezer:
    def __init__(self, rng: random.Random, grace_s: float, log: list[str]) -> None:
        self.rng, self.grace_s, self.log = rng, grace_s, log
        self.armed: dict[int, str] = {}  # node -> its collector's stop spec, until it stops
        self.held: dict[int, float] = {}  # frozen node -> when it resumes

    def env_for(self, name: str) -> dict[str, str]:
        """The environment a process of the trial starts with: an armed node's collector stops itself."""
        n = int(name.removeprefix("collector")) if name.startswith("collector") else None
        return {CRASH_ENV: self.armed[n]} if n in self.armed else {}

    def strike(self, now: float, up: list[int], restart: Callable[[str], None]) -> None:
        """A random node of `up` (never the last one) has its collector restarted to stop at a random step."""
        if len(up) < 2:
            return
        n = self.rng.choice(up)
        self.armed[n] = f"{self.rng.choice(CRASH_POINTS)}:1:stop"  # at its next commit
        self.log.append(f"{now:.1f}s node{n} to freeze at {self.armed[n]}")
        restart(f"collector{n}")

    def tick(self, now: float, procs: dict[str, subprocess.Popen], node_procs: list[list[str]]) -> None:
        """Freeze the rest of a node whose collector stopped itself; resume the nodes whose time came."""
        for n in list(self.armed):
            p = procs.get(f"collector{n}")
            if p is None or p.poll() is not None:
                del self.armed[n]  # killed or exited meanwhile: the fault is spent
            elif process_state(p.pid) == "T":
                del self.armed[n]
                self._signal(procs, node_procs[n], signal.SIGSTOP)
                self.held[n] = now + self.rng.choice((0.5 * self.grace_s, self.grace_s + 10.0))
                self.log.append(f"{now:.1f}s node{n} frozen, resumes at {self.held[n]:.1f}s")
        for n, at in list(self.held.items()):
            if now >= at:
                self.resume(n, procs, node_procs[n])
                self.log.append(f"{now:.1f}s node{n} resumed")

    def resume(self, n: int, procs: dict[str, subprocess.Popen], names: list[str]) -> None:
        self.held.pop(n, None)
        self._signal(procs, names, signal.SIGCONT)

    @staticmethod
    def _signal(procs: dict[str, subprocess.Popen], names: list[str], sig: int) -> None:
        for name in names:
            p = procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(sig)
