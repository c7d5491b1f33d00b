"""deploy/slurm on a real SLURM (tests/support/slurm.py: slurmctld, slurmd and munge of the test's
own): the head job (Redis with its AOF in the shared folder, the producer, metrics) and the node
jobs (an array, each task one `harvest node` with the CPU reference engine), submitted with
deploy/slurm/submit.sh as a user does, then struck mid-run:

- two node jobs, one of them told its time limit is near (USR1, as `--signal=B:USR1@180` does):
  it stops, requeues itself and comes back; every sample committed once;
- two node jobs struck mid-run with samples on their spools, one SIGKILLed (its node lost), one
  scancelled (it stops in order): a node submitted after takes over what they left (reclaimed
  after the run's spool grace); every sample committed once;
- a node job requeued (`scontrol requeue`, as a preemption does): it stops, comes back and
  finishes the run;
- the head's redis-server killed mid-run: the head starts it again from its AOF, the nodes wait
  for it and go on, none of them requeued.

The truth is the run's index files (every committed sample and how many times); each case prints
its figures (samples, committed, lost, doubled, wall time) on a `slurm case` line."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from harvest.ids import sample_id
from tests.support.chaos import make_rows
from tests.support.cli import REPO
from tests.support.localrun import committed
from tests.support.need import need
from tests.support.ports import reserve_ports
from tests.support.slurm import Slurm, missing, start_slurm
from tests.support.wait import wait_for

SLURM_DIR = os.path.join(REPO, "deploy", "slurm")
NODE_FLAGS = "--engine reference --workers 1 --stop-grace 30"


@pytest.fixture
def slurm(tmp_path):
    if missing():
        need(
            "slurm-wlm (slurmctld, slurmd, munge)",
            f"{', '.join(missing())} not on PATH (apt-get install slurm-wlm munge): the SLURM tests run a real cluster",
        )
    if os.geteuid() != 0:
        need("root", "slurmd runs the test's jobs as root (SlurmUser=root)")
    cluster = start_slurm(tmp_path / "slurm")
    yield cluster
    cluster.stop()


@dataclass
class Fleet:
    """A run submitted to the cluster: its head job, its node array, its files."""

    cluster: Slurm
    tmp: Path
    run: str
    expected: set[str]
    env: dict[str, str]
    head: str = ""
    nodes: str = ""
    t0: float = 0.0

    @property
    def shared(self) -> Path:
        return self.tmp / "shared"

    def submit(self, nodes: int) -> None:
        import subprocess

        self.t0 = time.monotonic()
        res = subprocess.run(
            [os.path.join(SLURM_DIR, "submit.sh"), str(nodes)],
            cwd=self.tmp,
            capture_output=True,
            text=True,
            env={**self.cluster.env(), **self.env},
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        ids = dict(w.split("=") for w in res.stdout.split())
        self.head, self.nodes = ids["head"], ids["nodes"]

    def add_node(self, task: int, flags: str) -> str:
        """One more node job, as a user adds one to a running run (its own flags)."""
        job = self.cluster.sbatch(
            "--chdir",
            str(self.tmp),
            f"--array={task}",
            "--job-name=extra",
            os.path.join(SLURM_DIR, "node.sbatch"),
            env={**self.env, "HARVEST_NODE_ARGS": flags},
        )
        return f"{job}_{task}"

    def redis(self) -> redis.Redis:
        url = wait_for(
            lambda: (self.shared / "redis.url").exists() and (self.shared / "redis.url").read_text().strip(),
            60,
            "the head's redis.url",
        )
        return redis.Redis.from_url(url)

    def log(self, job: str) -> str:
        name = f"slurm-{job}.out"
        p = self.tmp / name
        return p.read_text(errors="replace") if p.exists() else f"(no {name})"

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.tmp.glob("slurm-*.out"))
        )

    def finish(self, timeout: float = 150) -> dict[str, str]:
        """The head job's fields once it ended (it ends when the run is done and its nodes are gone)."""
        try:
            return self.cluster.wait_state(self.head, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}\n{self.cluster.run('squeue', check=False).stdout}") from None

    def figures(self, case: str) -> tuple[int, int]:
        """(lost, doubled) from the run's index files; prints the case's line."""
        copies = committed(self.tmp / "out" / self.run)
        lost = len(self.expected - set(copies))
        doubled = sum(n - 1 for n in copies.values() if n > 1)
        print(
            f"\nslurm case {case}: samples {len(self.expected)}, committed {len(copies)}, lost {lost}, "
            f"doubled {doubled}, stray {len(set(copies) - self.expected)}, wall {time.monotonic() - self.t0:.1f}s"
        )
        return lost, doubled


def new_fleet(cluster: Slurm, tmp: Path, tiny_model: str, run: str, samples: int, *, spool_grace: float = 120) -> Fleet:
    from transformers import AutoConfig

    rows = make_rows(samples, AutoConfig.from_pretrained(tiny_model).vocab_size, random.Random(samples))
    expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)) for r in rows}
    (tmp / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    block = reserve_ports(2)
    redis_port, metrics_port = block.ports
    block.close()
    env = {
        "HARVEST": f"{sys.executable} -m harvest",
        "PYTHONPATH": REPO,
        "HARVEST_RUN": run,
        "HARVEST_SHARED": str(tmp / "shared"),
        "HARVEST_DATASET": str(tmp / "data.jsonl"),
        "HARVEST_MODEL": tiny_model,
        "HARVEST_OUT": str(tmp / "out"),
        "HARVEST_PRODUCE_ARGS": f"--dtype fp32 --batch-samples 2 --spool-grace {spool_grace:g}",
        "HARVEST_NODE_ARGS": f"{NODE_FLAGS} --model {tiny_model}",
        "HARVEST_NODE_WORK": str(tmp / "nodes"),
        "HARVEST_REDIS_PORT": str(redis_port),
        "HARVEST_METRICS_PORT": str(metrics_port),
        "HARVEST_HEAD_POLL": "2",
        "HARVEST_HEAD_LINGER": "60",
        "HARVEST_JOIN_WAIT": "120",
    }
    return Fleet(cluster, tmp, run, expected, env)


def test_a_run_over_two_node_jobs_commits_every_sample_once_one_requeued_at_its_time_limit(slurm, tmp_path, tiny_model):
    from harvest.state.ledger import Ledger

    fleet = new_fleet(slurm, tmp_path, tiny_model, "sl-two", 16)
    fleet.submit(2)
    conn = fleet.redis()
    wait_for(
        lambda: Ledger(conn, fleet.run).counts()["spooled"] + Ledger(conn, fleet.run).counts()["done"],
        120,
        "the nodes extracting",
    )
    # what `--signal=B:USR1@180` sends the batch script before the time limit
    timed_out = f"{fleet.nodes}_1"
    slurm.run("scancel", "--batch", "--signal=USR1", timed_out)
    head = fleet.finish()
    assert (head["JobState"], head["ExitCode"]) == ("COMPLETED", "0:0"), fleet.logs()
    assert fleet.figures("two node jobs, one requeued at its time limit") == (0, 0)
    jobs = slurm.jobs()
    assert [(j["JobState"], j["ExitCode"], j["Restarts"]) for j in (jobs[f"{fleet.nodes}_0"], jobs[timed_out])] == [
        ("COMPLETED", "0:0", "0"),
        ("COMPLETED", "0:0", "1"),
    ], fleet.logs()
    log = fleet.log(timed_out)
    assert "SIGUSR1: stopping harvest node" in log and "harvest node exited 75" in log, log
    assert f"requeueing job {timed_out}" in log and f"job {timed_out} (restart 1)" in log, log
    assert (fleet.shared / "done").read_text().split() == ["16", "16", "0"]
    assert "run sl-two done: 16 committed, 0 failed of 16" in fleet.log(fleet.head)
    assert not (fleet.shared / "redis.url").exists()  # the head stopped its Redis


def test_node_jobs_cancelled_or_killed_mid_run_have_their_spools_taken_over(slurm, tmp_path, tiny_model):
    from harvest.state.ledger import Ledger
    from harvest.state.spools import SpoolLeases

    # Two nodes until both hold samples on their spools (a collector commits a partial shard only
    # when nothing is queued, or after a minute); then node 0's processes are SIGKILLed (its node
    # lost: nothing is committed on the way out) and node 1 is scancelled (SIGTERM: it stops in
    # order). Node 2, submitted after, takes over what they left once the spool grace (3 s) passed.
    fleet = new_fleet(slurm, tmp_path, tiny_model, "sl-cancel", 32, spool_grace=3)
    fleet.submit(2)
    conn = fleet.redis()
    names = {f"{fleet.nodes}_{t}": f"{slurm.host}-{t}" for t in (0, 1)}

    def on_spools() -> dict[str, int]:
        by_node = {v.node: v.samples for v in SpoolLeases(conn, fleet.run).list() if not v.revoked}
        return {job: by_node.get(name, 0) for job, name in names.items()}

    def both_spooled() -> bool:
        c = Ledger(conn, fleet.run).counts()
        if c["total"] and not c["queued"]:
            raise AssertionError("the queue ran dry before the nodes were struck: more samples")
        return all(on_spools().values())

    wait_for(both_spooled, 120, "samples on both nodes' spools")
    lost_node, cancelled = names
    spooled = on_spools()[lost_node]  # its collector commits none of them before the queue runs dry
    pids = [
        int(line.split()[0])
        for line in slurm.run("scontrol", "listpids", slurm.jobs()[lost_node]["JobId"]).stdout.splitlines()[1:]
    ]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    slurm.run("scancel", cancelled)
    assert slurm.wait_state(lost_node, {"FAILED", "CANCELLED", "COMPLETED"}, 90)["JobState"] == "FAILED"
    assert slurm.wait_state(cancelled, {"FAILED", "CANCELLED", "COMPLETED"}, 90)["JobState"] == "CANCELLED"
    fleet.add_node(2, NODE_FLAGS + f" --model {tiny_model}")
    # the run is not done before node 0's spool is reclaimed: this holds while the head waits on
    reclaimed = wait_for(
        lambda: Ledger(conn, fleet.run).stats().get("samples_reclaimed", 0), 120, "node 0's spool reclaimed"
    )
    head = fleet.finish()
    assert (head["JobState"], head["ExitCode"]) == ("COMPLETED", "0:0"), fleet.logs()
    assert fleet.figures(
        f"node 0 killed with {spooled} samples spooled, node 1 scancelled: {reclaimed} samples taken over"
    ) == (0, 0)
    assert "SIGTERM: stopping harvest node" in fleet.log(cancelled)


def test_a_requeued_node_job_stops_comes_back_and_finishes_the_run(slurm, tmp_path, tiny_model):
    from harvest.state.ledger import Ledger

    fleet = new_fleet(slurm, tmp_path, tiny_model, "sl-requeue", 24)
    fleet.submit(1)
    conn = fleet.redis()
    task = f"{fleet.nodes}_0"

    def started() -> bool:
        c = Ledger(conn, fleet.run).counts()
        assert c["queued"] or not c["total"], "the queue ran dry before the requeue: more samples"
        return c["spooled"] + c["done"] > 0

    wait_for(started, 120, "node 0 extracting")
    slurm.run("scontrol", "requeue", task)
    slurm.wait_state(task, {"RUNNING"}, 60)  # back after the cluster's cred_expire (10 s)
    head = fleet.finish()
    assert (head["JobState"], head["ExitCode"]) == ("COMPLETED", "0:0"), fleet.logs()
    assert fleet.figures("scontrol requeue of the node job") == (0, 0)
    job = slurm.jobs()[task]
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), fleet.logs()
    log = fleet.log(task)
    assert "SIGTERM: stopping harvest node" in log and "harvest node exited 75" in log, log
    assert "(restart 1)" in log and "harvest node exited 0" in log, log


def test_the_heads_redis_restarted_mid_run_the_nodes_wait_and_go_on(slurm, tmp_path, tiny_model):
    from harvest.state.ledger import Ledger

    fleet = new_fleet(slurm, tmp_path, tiny_model, "sl-redis", 24)
    fleet.submit(2)
    conn = fleet.redis()
    wait_for(lambda: Ledger(conn, fleet.run).counts()["spooled"] > 0, 120, "samples spooled")
    assert Ledger(conn, fleet.run).counts()["done"] < 24  # mid-run
    pid = int((fleet.shared / "redis" / "redis.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    head = fleet.finish()
    assert (head["JobState"], head["ExitCode"]) == ("COMPLETED", "0:0"), fleet.logs()
    assert fleet.figures("the head's redis-server killed mid-run") == (0, 0)
    assert "redis-server exited" in fleet.log(fleet.head)
    for task in ("0", "1"):
        job = slurm.jobs()[f"{fleet.nodes}_{task}"]
        assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), fleet.logs()


def test_the_head_looks_for_the_producers_pass_under_its_key():
    from harvest.state.keys import Keys

    with open(os.path.join(SLURM_DIR, "head.sbatch")) as f:
        script = f.read()
    assert Keys("RUN").produced.replace("RUN", "$HARVEST_RUN") in script
