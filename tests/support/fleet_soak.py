"""The fleet soak (bench/fleet.py --soak): a simulated fleet (tests.support.fleet) of N nodes runs a
large run while workers, collectors and whole nodes are SIGKILLed at random, then every sample is
accounted for exactly as tests/support/chaos.py accounts for a trial (one copy in one committed
shard with its tokens, or one failure with a reason; no shard without index; nothing left on the
disks that came back).

A lost node's processes are all killed and its disk withheld: it comes back within the run's
spool grace, after it (its spool reclaimed meanwhile, so its late commits must be fenced), or
never. The producer runs in this process, bounded as `harvest produce` is (it waits while the
queue is full), while the kills happen.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import redis

from harvest.config import RunConfig
from harvest.ids import sample_id
from harvest.producer.enqueue import Enqueuer
from harvest.sample import Sample
from harvest.state.heartbeat import HEARTBEAT_TTL_S
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.chaos import RETURNS, Trial
from tests.support.chaos_result import TrialResult
from tests.support.cli import REPO
from tests.support.fleet import Fleet
from tests.support.ports import reserve_ports

KINDS = ("worker", "collector", "node")
GRACE_S = 15.0


def soak(
    conn: redis.Redis, server, root: str, nodes: int, samples: int, kills: int, seed: int, deadline_s: float = 1500
) -> int:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    run = f"soak{seed}"
    out = os.path.join(root, "out")
    cfg = publish_run(
        conn,
        RunConfig(
            run=run,
            model="synthetic",
            capture_points=[2, 4, 5, 8],
            hidden_size=4,
            out_url=out,
            storage_dtype="fp32",
            num_layers=8,
            spool_grace_s=GRACE_S,
            shard_bytes=1 << 20,
        ),
    )
    rows = [nrng.integers(5, 128_000, int(nrng.integers(16, 200))).tolist() for _ in range(samples)]
    rows += rows[: samples // 100]  # repeated rows: the same sample, to be stored once
    expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)): r for r in rows}
    ports = reserve_ports(nodes)  # tests.support.ports: held until the fleet stops
    fleet = Fleet(
        os.path.join(root, run),
        server.url,
        run,
        nodes,
        base_port=ports.first,
        collector_args=("--max-wait", "1", "--pack-workers", "1"),
    )
    res = TrialResult(seed, len(expected))
    down: dict[int, float | None] = {}
    never: set[int] = set()
    t0 = time.monotonic()
    produced = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            enq = Enqueuer(redis.Redis.from_url(server.url), cfg, max_queued=4000)
            for r in rows:
                enq.add(Sample.build(r))
            enq.flush()
        except BaseException as e:  # noqa: BLE001 - reported by the soak
            errors.append(e)
        finally:
            produced.set()

    fleet.start_all()
    threading.Thread(target=produce, name="producer", daemon=True).start()
    kill_at = sorted(rng.uniform(10.0, 10.0 + samples / 400) for _ in range(kills))
    led = Ledger(conn, run)
    last_kill = 0.0
    try:
        while True:
            now = time.monotonic() - t0
            if now > deadline_s or errors:
                res.error = f"{errors[0]!r}" if errors else f"not finished after {deadline_s:.0f}s: {led.counts()}"
                break
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                _kill(fleet, rng, res, nodes, down, never, now)
                last_kill = time.monotonic()
            _bring_back(fleet, res, down, now)
            _restart_exited(fleet, res)
            c = led.counts()
            if (
                produced.is_set()
                and not kill_at
                and not [a for a in down.values() if a is not None]
                and c["queued"] == 0
                and c["spooled"] == 0
                and c["done"] + c["failed"] == len(expected)
            ):
                break
            time.sleep(0.5)
    finally:
        fleet.stop()
        ports.close()
    seconds = time.monotonic() - t0
    if not res.error:
        _final_passes(fleet, run, server.url, nodes, never, last_kill)
        res.spools_reclaimed = led.stats().get("spools_reclaimed", 0)
        res.spools_revoked = conn.scard(Keys(run).revoked_spools)
        shim = SimpleNamespace(
            result=res,
            out=out,
            run=run,
            expected=expected,
            n_nodes=nodes,
            never=never,
            spool=fleet.spool,
            dump=fleet.dump,
        )
        shim._leftover = lambda c, path: Trial._leftover(shim, c, path)  # Trial's methods _account calls
        Trial._account(shim, conn)
    res.seconds = seconds
    print(res.summary())
    print(
        f"soak: {nodes} nodes, {len(expected)} distinct samples ({len(rows)} rows), {seconds:.0f}s to the last "
        f"sample settled ({len(expected) / seconds:.0f} samples/s), kills {dict(res.kills)}, nodes back "
        f"{dict(res.node_returns)}, restarts on exit {dict(res.restarts_on_exit)}, spools revoked "
        f"{res.spools_revoked} ({res.spools_reclaimed} with samples); done {res.done}, failed {res.failed} "
        f"{dict(res.failure_reasons)}; lost {len(res.lost)}, doubled {len(res.doubled)}, wrong tokens "
        f"{len(res.wrong_tokens)}, shards without index {len(res.shards_without_index)}, leftovers "
        f"{len(res.leftovers)} (and {res.killed_temps} spool files in flight of killed workers, removed after "
        f"an hour): {'OK' if res.ok else 'FAIL'}"
    )
    for line in res.timeline:
        print("  " + line)
    return 0 if res.ok else 1


def _kill(
    fleet: Fleet,
    rng: random.Random,
    res: TrialResult,
    nodes: int,
    down: dict[int, float | None],
    never: set[int],
    now: float,
) -> None:
    """One random kill: a worker or a collector (started again at once), or a whole node, lost with its
    disk until the moment `down` holds for it (None: never back, and added to `never`)."""
    kind = rng.choice(KINDS)
    res.kills[kind] += 1
    up = [n for n in range(nodes) if n not in down]
    if kind == "node" and len(up) > 1:
        n = rng.choice(up)
        back = rng.choice(RETURNS)
        res.node_returns[back] += 1
        for name in fleet.node_procs(n):
            fleet.kill(name)
            fleet.procs.pop(name, None)
        down[n] = {"within": now + 1.0, "after": now + GRACE_S + 10.0, "never": None}[back]
        never |= {n} if back == "never" else set()
        res.timeline.append(f"{now:.1f}s node{n} lost, back {back}")
    elif kind != "node":
        n = rng.choice(up)
        name = f"worker{n}.0" if kind == "worker" else f"collector{n}"
        fleet.kill(name)
        fleet.start(name)
        res.timeline.append(f"{now:.1f}s kill {name}")


def _bring_back(fleet: Fleet, res: TrialResult, down: dict[int, float | None], now: float) -> None:
    """Start again the processes of each lost node whose time to come back has come."""
    for n, at in list(down.items()):
        if at is not None and now >= at:
            del down[n]
            res.timeline.append(f"{now:.1f}s node{n} back")
            for name in fleet.node_procs(n):
                fleet.start(name)


def _restart_exited(fleet: Fleet, res: TrialResult) -> None:
    """A process that exited on its own: restarted, as a supervisor would."""
    for name, p in list(fleet.procs.items()):
        if p.poll() is not None:
            res.restarts_on_exit[name.rstrip("0123456789.")] += 1
            if name == "engine":
                fleet.start_engine()
            else:
                fleet.start(name)


def _final_passes(fleet: Fleet, run: str, redis_url: str, nodes: int, never: set[int], last_kill: float) -> None:
    """Once killed workers' heartbeats lapsed (their claim dirs may go), a last collect and janitor pass on
    each node that came back."""
    wait = max(2.5, last_kill + HEARTBEAT_TTL_S + 1 - time.monotonic())
    time.sleep(wait)  # claim dirs of killed workers go once their heartbeat lapsed
    for n in range(nodes):
        if n in never:
            continue
        for args in (
            ["collect", "--spool-dir", fleet.spool(n), "--node", f"node{n}", "--burst"],
            ["janitor", "--dump-dir", fleet.dump(n)],
        ):
            subprocess.run(
                [sys.executable, "-m", "harvest.cli", args[0], "--run", run, "--redis", redis_url, *args[1:]],
                cwd=REPO,
                capture_output=True,
                timeout=300,
                check=True,
            )
