"""A private, real SLURM cluster for a test: Debian's slurm-wlm (slurmctld and slurmd) and munge,
started from a folder of the test's own and stopped after it.

Everything is the cluster's own: a munge key and socket (slurm.conf's `AuthInfo=socket=`), ports
below the ephemeral range (tests/support/ports.py), state, spool, logs and pid files under the
folder. So a test's cluster never meets the machine's (if any) or another test's. One node: this
machine (`hostname -s`), with its CPUs, shared by up to 4 jobs at once (`OverSubscribe=FORCE:4`),
so the tasks of a job array stand in for nodes. Process tracking by parent pid
(`proctrack/linuxproc`) and no task plugin: nothing here needs cgroups or systemd.
`cred_expire=10`: a requeued job may start again after 10 s instead of 120.

The commands (`sbatch`, `squeue`, `scontrol`, `scancel`) reach it through `env()` (SLURM_CONF).
The daemons run in the foreground (`-D`) as this process's children, so they are stopped by their
own pids, never by name.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import reserve_ports
from tests.support.wait import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "sacct")


def missing() -> list[str]:
    """The programs of slurm-wlm and munge not on PATH (apt-get install slurm-wlm munge)."""
    return [p for p in (*DAEMONS, *COMMANDS[:4]) if shutil.which(p) is None]


def _memory_mib() -> int:
    with open("/proc/meminfo") as f:
        kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return max(kib // 1024 - 1024, 512)


@dataclass
class Slurm:
    """A running private cluster; `run` calls its commands, `stop` ends it."""

    root: Path
    host: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {res.returncode}: {res.stdout}{res.stderr}")
        return res

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> str:
        """Submit; the job id (`--parsable`)."""
        res = subprocess.run(
            ["sbatch", "--parsable", *argv],
            capture_output=True,
            text=True,
            env={**self.env(), **(env or {})},
            timeout=60,
        )
        if res.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(argv)}: exit {res.returncode}: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def jobs(self) -> dict[str, dict[str, str]]:
        """{job id as squeue prints it (ARRAY_TASK for a task of an array): its `scontrol show job`
        fields (JobState, Restarts, ExitCode...)} of the jobs the controller holds (a finished one
        for MinJobAge seconds)."""
        res = self.run("scontrol", "show", "job", "--oneliner", check=False)
        out = {}
        for line in res.stdout.splitlines():
            kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
            if "JobId" not in kv:
                continue
            task = kv.get("ArrayTaskId", "")
            out[f"{kv['ArrayJobId']}_{task}" if task.isdigit() else kv["JobId"]] = kv
        return out

    def state(self, job: str) -> str:
        return self.jobs().get(job, {}).get("JobState", "GONE")

    def wait_state(self, job: str, states: set[str], timeout: float) -> dict[str, str]:
        """The job's fields once its state is one of `states`."""
        return wait_for(
            lambda: (j := self.jobs().get(job)) and j["JobState"] in states and j,
            timeout,
            f"job {job} in {sorted(states)} (now {self.state(job)})",
            poll=0.5,
        )

    def log(self, name: str) -> str:
        p = self.root / "log" / name
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        """Cancel what is left, then the daemons, last started first, by their pids."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                ["scancel", "--full", "--signal=KILL", "--user=root"], env=self.env(), capture_output=True, timeout=30
            )
            subprocess.run(["scancel", "--user=root"], env=self.env(), capture_output=True, timeout=30)
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _config(root: Path, host: str, ports: list[int], cpus: int) -> str:
    return f"""\
ClusterName=hv{ports[0]}
SlurmctldHost={host}
SlurmUser=root
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
MinJobAge=300
KillWait=30
MessageTimeout=10
SlurmdTimeout=30
InactiveLimit=0
NodeName={host} CPUs={cpus} RealMemory={_memory_mib()} State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def start_slurm(root: Path, timeout: float = 60) -> Slurm:
    """munged, slurmctld and slurmd on a config of their own under `root`; returns once the node is
    idle. Raises (stopping what it started) if a daemon exits or the node does not come up."""
    host = socket.gethostname().split(".")[0]
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir(parents=True, exist_ok=True)
    block = reserve_ports(2)
    ports = block.ports
    block.close()  # slurmctld and slurmd bind them next; nothing else takes them below the ephemeral range
    root.joinpath("slurm.conf").write_text(_config(root, host, ports, os.cpu_count() or 1))
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    os.chmod(root / "munge", 0o700)
    cluster = Slurm(root, host)
    logs = root / "log"
    try:
        cluster.procs["munged"] = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={root}/munge/munge.socket",
                f"--key-file={key}",
                f"--log-file={logs}/munged.log",
                f"--pid-file={root}/munge/munged.pid",
                f"--seed-file={root}/munge/munged.seed",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(logs / "munged.err", "w"),
            start_new_session=True,
        )
        wait_for(
            lambda: (root / "munge" / "munge.socket").exists() or cluster.procs["munged"].poll() is not None,
            timeout,
            "munged's socket",
        )
        for name in ("slurmctld", "slurmd"):
            argv = [name, "-D", "-f", str(cluster.conf)] + (["-i"] if name == "slurmctld" else [])
            cluster.procs[name] = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=open(logs / f"{name}.err", "w"),
                env=cluster.env(),
                start_new_session=True,
            )

        def idle() -> bool:
            for name, p in cluster.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited {p.returncode}: {(logs / f'{name}.err').read_text()}"
                        f"{cluster.log(f'{name}.log')[-3000:]}"
                    )
            res = cluster.run("sinfo", "-h", "-o", "%t", check=False)
            return res.returncode == 0 and res.stdout.strip() == "idle"

        deadline = time.monotonic() + timeout
        while not idle():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the node is not idle within {timeout:.0f}s: "
                    f"{cluster.run('sinfo', check=False).stdout}{cluster.log('slurmctld.log')[-3000:]}"
                )
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster
