"""Heartbeats: short-lived Redis hashes that say a worker or a collector is alive and what it is doing.

RQ's own worker keys live for `job.timeout + 60` s while a SimpleWorker runs a job (about 11 min
for a default harvest job), far too long to notice a dead worker quickly. A harvest heartbeat
expires HEARTBEAT_TTL_S after the last beat, so "the key is gone" means "the process is gone"
within seconds; the janitor (harvest.ops.janitor) acts on that, and `harvest status` shows it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis

from harvest.formats.spool import list_spooled
from harvest.state.keys import Keys, worker_key

HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TTL_S = 15  # three missed beats: dead
COLLECTOR_BEAT_S = 2.0  # the spool backlog changes at every commit: refresh it more often


def _text(h: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


class WorkerBeat:
    """One worker's heartbeat hash `harvest:worker:<name>`: identity, engine, current job."""

    def __init__(self, conn: redis.Redis, run: str, name: str, host: str, engine: str, ttl: int = HEARTBEAT_TTL_S) -> None:
        self.conn, self.run, self.name, self.ttl = conn, run, name, ttl
        self.key = worker_key(name)
        self.keys = Keys(run)
        self.identity = {"name": name, "run": run, "host": host, "pid": str(os.getpid()), "engine": engine,
                         "started": f"{time.time():.3f}"}

    def start(self) -> None:
        """Announce the worker; must happen before it creates its claim dir (the janitor removes the
        claim dirs of workers without a heartbeat)."""
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, mapping={**self.identity, "state": "idle", "job": "", "job_samples": "0",
                                         "job_started": "", "jobs_done": "0", "seen": f"{time.time():.3f}"})
            pipe.expire(self.key, self.ttl)
            pipe.sadd(self.keys.workers, self.name)
            pipe.execute()

    def beat(self) -> None:
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, "seen", f"{time.time():.3f}")
            pipe.expire(self.key, self.ttl)
            pipe.execute()

    def set_state(self, state: str) -> None:
        self.conn.hset(self.key, "state", state)

    def job_started(self, job_id: str, samples: int) -> None:
        self.conn.hset(self.key, mapping={"state": "busy", "job": job_id, "job_samples": str(samples),
                                          "job_started": f"{time.time():.3f}"})

    def job_ended(self) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, mapping={"state": "idle", "job": "", "job_samples": "0", "job_started": ""})
            pipe.hincrby(self.key, "jobs_done", 1)
            pipe.execute()

    def stop(self) -> None:
        """A clean exit: gone at once, nothing for the janitor to take back."""
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.srem(self.keys.workers, self.name)
            pipe.execute()


def worker_alive(conn: redis.Redis, name: str) -> bool:
    return bool(conn.exists(worker_key(name)))


def read_workers(conn: redis.Redis, run: str) -> tuple[list[dict[str, str]], list[str]]:
    """(heartbeats of the live workers of the run, names announced whose heartbeat expired)."""
    names = sorted(n.decode() for n in conn.smembers(Keys(run).workers))
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(worker_key(n))
    alive, dead = [], []
    for n, h in zip(names, pipe.execute()):
        (alive.append(_text(h)) if h else dead.append(n))
    return alive, dead


@dataclass
class CollectorBeat:
    """A collector's heartbeat: its node's spool backlog, refreshed at most every COLLECTOR_BEAT_S."""

    conn: redis.Redis
    run: str
    node: str
    spool_dir: str
    ttl: int = HEARTBEAT_TTL_S
    _last: float = 0.0

    def maybe_beat(self, shards_committed: int = 0) -> bool:
        """Beat if COLLECTOR_BEAT_S passed since the last beat; True if it did."""
        now = time.time()
        if now - self._last < COLLECTOR_BEAT_S:
            return False
        self._last = now
        files = list_spooled(self.spool_dir)
        keys = Keys(self.run)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.collector(self.node), mapping={
                "node": self.node, "pid": str(os.getpid()), "spool_files": str(len(files)),
                "spool_bytes": str(sum(size for _, _, size in files)), "shards_committed": str(shards_committed),
                "seen": f"{now:.3f}"})
            pipe.expire(keys.collector(self.node), self.ttl)
            pipe.sadd(keys.collectors, self.node)
            pipe.execute()
        return True


def read_collectors(conn: redis.Redis, run: str) -> tuple[list[dict[str, str]], list[str]]:
    """(heartbeats of the live collectors of the run, nodes whose collector stopped beating)."""
    keys = Keys(run)
    nodes = sorted(n.decode() for n in conn.smembers(keys.collectors))
    pipe = conn.pipeline(transaction=False)
    for n in nodes:
        pipe.hgetall(keys.collector(n))
    alive, dead = [], []
    for n, h in zip(nodes, pipe.execute()):
        (alive.append(_text(h)) if h else dead.append(n))
    return alive, dead
