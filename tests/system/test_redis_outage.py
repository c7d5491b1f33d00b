"""A Redis that is away for a while is a pause, not an error: its redis-server (AOF) SIGKILLed
while a job is in flight and kept away longer than a client's socket timeouts (~10 s), then
started again on the same port with the same data. Every process rides it out (none exits, none
is restarted), the run finishes by itself, no sample fails, and every input sample is in exactly
one committed shard (counted from the index files): none lost, none doubled.

(a) separate processes, as a fleet runs them (tests/support/chaos.py's harness: producer, two
    workers, a collector, the reference engine); the test starts Redis again.
(b) `harvest run`, whose private redis-server is its own child: the test holds the port for the
    outage with a socket that never answers (clients see a hung Redis, and `harvest run` cannot
    start it again until the port is free), and `harvest run` starts it again by itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections import Counter

import redis

from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.chaos import Trial
from tests.support.localrun import start_run
from tests.support.ops import wait_until

OUTAGE_S = 15.0  # longer than a client's socket timeouts (~10 s); each test stays well under 2 min


def _busy(conn: redis.Redis) -> bool:
    """A worker's heartbeat says it is in a job (harvest.state.heartbeat)."""
    return any(conn.hget(k, "state") == b"busy" for k in conn.scan_iter(match="harvest:worker:*"))


def _went_away_everywhere(logs: list[str]) -> bool:
    """Every process named noticed the outage (harvest.state.connection's first line of it)."""
    return all(" went away (" in open(p, errors="replace").read() for p in logs)


class OutageTrial(Trial):
    """The chaos harness with one fault: Redis killed while a job is in flight, kept away for
    `outage_s` once every worker and the collector noticed, then started again (same port, AOF)."""

    def __init__(self, *args, outage_s: float = OUTAGE_S, **kw) -> None:
        super().__init__(*args, kinds=("outage",), kills=1, on_commit=True, **kw)
        self.outage_s = outage_s
        self.in_flight_at_kill = False

    def _cmd(self, name: str) -> list[str]:
        """Jobs of 3 samples: several queued, both workers in one, when Redis goes."""
        return super()._cmd(name) + (["--batch-samples", "3"] if name == "producer" else [])

    def _commits(self) -> int:
        """The harness's `on_commit` trigger, made "half way, a job in flight": samples spooled or
        done, more queued, a worker in a job (a first commit may come only once all is spooled)."""
        conn = redis.Redis.from_url(self.redis.url)
        try:
            c = Ledger(conn, self.run).counts()
            return int(c["spooled"] + c["done"] >= 3 and c["queued"] > 0 and _busy(conn))
        except redis.RedisError:
            return 0
        finally:
            conn.close()

    def _kill_one(self, kind: str, now: float) -> None:
        if kind != "outage":
            return super()._kill_one(kind, now)
        self.result.kills[kind] += 1
        conn = redis.Redis.from_url(self.redis.url)
        try:  # strike while a job is in flight, so that its samples meet the outage
            self.in_flight_at_kill = bool(wait_until(lambda: _busy(conn), 10, "a worker in a job", poll=0.005))
        finally:
            conn.close()
        self.redis.kill()
        t0 = time.monotonic()
        self.result.timeline.append(f"{now:.1f}s redis killed")
        logs = [os.path.join(self.logs, f"{n}.log") for n in self._node_procs(0)[1:]]
        wait_until(lambda: _went_away_everywhere(logs), 30, "every worker and the collector noticed the outage")
        wait_until(lambda: time.monotonic() - t0 >= self.outage_s, self.outage_s + 1, "the outage's length")
        self.redis.start()
        self.result.timeline.append(f"{time.monotonic() - t0:.1f}s later redis back")


def test_separate_processes_ride_out_a_redis_outage(tiny_model, tmp_path):
    trial = OutageTrial(str(tmp_path), tiny_model, seed=24, samples=30, workers=2, chunk=16, deadline_s=150)
    res = trial.execute()
    assert res.ok, res.summary()
    assert trial.in_flight_at_kill, res.timeline
    assert res.kills == Counter({"outage": 1}), res.summary()
    assert res.restarts_on_exit == Counter(), res.summary()  # no process stopped for it
    assert (res.done, res.failed, dict(res.failure_reasons)) == (len(trial.expected), 0, {}), res.summary()
    for name in ("worker0.0", "worker0.1", "collector0"):
        log = open(os.path.join(trial.logs, f"{name}.log"), errors="replace").read()
        assert " went away (" in log and " is back after " in log, (name, log[-3000:])
        assert "lost Redis" not in log and "worker-error" not in log, (name, log[-3000:])


def _private_redis(p: subprocess.Popen) -> tuple[int, int] | None:
    """(pid, port) of the redis-server `harvest run` started (its child; Redis titles itself host:port)."""
    try:
        children = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
    except FileNotFoundError:
        return None
    for c in children:
        try:
            title = open(f"/proc/{c}/cmdline").read()
        except FileNotFoundError:
            continue
        m = re.search(r"redis-server[^:]*:(\d+)", title)
        if m:
            return int(c), int(m.group(1))
    return None


def _hold_port(port: int, pid: int) -> socket.socket:
    """SIGKILL the server, then listen on its port as soon as it let it go, never answering: clients
    meet a Redis that hangs (their reads time out; closing the socket resets them), and `harvest
    run`'s restarts of it fail (the port is taken) until the socket is closed. SO_REUSEADDR, as
    Redis's own: the killed server's connections linger in TIME_WAIT on that port."""
    os.kill(pid, signal.SIGKILL)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 5
    while True:
        try:
            s.bind(("127.0.0.1", port))
            s.listen(64)
            return s
        except OSError:
            if time.monotonic() > deadline:
                s.close()
                raise
            time.sleep(0.001)


def test_harvest_run_restarts_its_redis_and_finishes(tiny_model, tmp_path):
    run = start_run(tiny_model, tmp_path, "outage", 30, 24)
    p, work = run.proc, run.work
    try:
        pid, port = wait_until(lambda: _private_redis(p), 60, "harvest run's redis-server")
        conn = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
        logs = [str(work / "logs" / f"{n}.log") for n in ("worker-1", "worker-2", "collector")]

        def mid_run() -> dict | None:
            assert p.poll() is None, run.stderr()
            c = {k.decode(): int(v) for k, v in conn.hgetall(Keys("outage").counts).items()}
            return c if c.get("s", 0) + c.get("d", 0) >= 2 and c.get("q", 0) > 0 and _busy(conn) else None

        at_kill = wait_until(mid_run, 120, "the run half way with a job in flight", poll=0.01)
        conn.close()
        hold = _hold_port(port, pid)
        t0 = time.monotonic()
        try:
            wait_until(lambda: _went_away_everywhere(logs), 30, "every worker and the collector noticed the outage")
            wait_until(lambda: time.monotonic() - t0 >= OUTAGE_S, OUTAGE_S + 1, "the outage's length")
        finally:
            hold.close()
        rc, text, err = run.finish(150)
    finally:
        run.kill()
    assert rc == 0, text + err
    assert at_kill["q"] > 0  # the outage struck mid-run
    n = len(run.expected)
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in text, text + err
    assert "restarted:" not in text, text  # no child exited
    assert run.committed() == Counter({sid: 1 for sid in run.expected})
    sup = (work / "logs" / "supervisor.log").read_text()
    assert f"redis-server on port {port} exited with status -9: starting it again with its data" in sup, sup
    assert f"redis-server is running again on port {port} (restart 1)" in sup, sup
    assert "did not start again (redis-server exited with 1" in sup, sup  # the port was held meanwhile
    assert err.count(" went away (") >= 1 and " is back after " in err, err
    for path in logs:
        log = open(path, errors="replace").read()
        assert " is back after " in log and "lost Redis" not in log and "worker-error" not in log, (path, log[-3000:])
