"""A process held to a share of one CPU core (a Linux CPU cgroup), for bench/fleet.py --redis-share.

Why. A Redis with spare capacity sleeps between requests and pays a wake-up for each round
trip (a context switch, and on a VM an inter-processor interrupt): on this project's VMs that is
a third of its CPU a sample at the simulated fleet's load, a few percent of a core. A saturated
Redis, which is what "the fleet size one Redis core carries" asks about, finds requests waiting
whenever it looks and pays no such wake-ups. The simulation cannot load a whole core (its 35
processes share the machine with it), so the server is held to a small share of one instead:
the fleet then waits on it, as a fleet of hundreds of nodes waits on a whole core, and what it
spends a sample is the cost at saturation.
"""

from __future__ import annotations

import math
import os

from harvest.errors import ConfigurationError

V1 = "/sys/fs/cgroup/cpu"
V2 = "/sys/fs/cgroup"
MIN_QUOTA_US = 1000  # the kernel's least CFS quota


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CpuShare:
    """A cgroup named `harvest-share-<pid>` whose tasks get `share` of one core."""

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise ConfigurationError(f"--redis-share {share}: give a share of one core, in (0, 1]")
        period = min(1_000_000, max(100_000, math.ceil(MIN_QUOTA_US / share)))
        quota = max(MIN_QUOTA_US, int(period * share))
        name = f"harvest-share-{os.getpid()}"
        if os.access(os.path.join(V1, "cgroup.procs"), os.W_OK):
            self.root, self.dir = V1, os.path.join(V1, name)
            os.makedirs(self.dir, exist_ok=True)
            _write(os.path.join(self.dir, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(self.dir, "cpu.cfs_quota_us"), str(quota))
        elif (
            os.access(os.path.join(V2, "cgroup.subtree_control"), os.W_OK)
            and "cpu" in open(os.path.join(V2, "cgroup.controllers")).read().split()
        ):
            self.root, self.dir = V2, os.path.join(V2, name)
            _write(os.path.join(V2, "cgroup.subtree_control"), "+cpu")
            os.makedirs(self.dir, exist_ok=True)
            _write(os.path.join(self.dir, "cpu.max"), f"{quota} {period}")
        else:
            raise ConfigurationError(
                "--redis-share needs a CPU cgroup this process may write (cgroup v1 at "
                f"{V1}, or v2 at {V2} with the cpu controller): run the bench as root on Linux"
            )
        self.share = quota / period

    def attach(self, pid: int) -> CpuShare:
        _write(os.path.join(self.dir, "cgroup.procs"), str(pid))
        return self

    def close(self) -> None:
        """Its processes back in the root group, the group removed."""
        try:
            with open(os.path.join(self.dir, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        _write(os.path.join(self.root, "cgroup.procs"), pid)
                    except OSError:  # gone meanwhile
                        pass
            os.rmdir(self.dir)
        except OSError:
            pass
