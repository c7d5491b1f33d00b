"""Heartbeats: short-lived Redis hashes that say a worker or a collector is alive and what it is doing.

RQ's own worker keys live for `job.timeout + 60` s while a SimpleWorker runs a job (about 11 min
for a default harvest job), far too long to notice a dead worker quickly. A harvest heartbeat
expires HEARTBEAT_TTL_S after the last beat, so "the key is gone" means "the process is gone"
within seconds; the janitor (harvest.ops.janitor, harvest.ops.liveness) acts on that, and
`harvest status` shows it.

Clocks. Liveness is the key's existence, and its TTL runs on Redis's clock, so no node's clock
decides whether another node is alive. The time stamps in the hash (`started`, `seen`,
`job_started`) are Redis's `TIME` too, taken inside the script that writes them, so every
heartbeat of the fleet is stamped by one clock; they are shown by `harvest status` and decide
nothing.

What a worker runs. `job` and `execution` name the RQ execution the worker is running (empty
when idle). harvest.workers.rqworker.HarvestWorker writes them in the same MULTI/EXEC in which RQ creates
the execution (`name_execution`), so there is no moment at which RQ's started registry holds an
execution of a live worker whose heartbeat names another; the janitor takes an execution back
when its live worker's heartbeat names another job for longer than a grace (a Redis that rolled
back under a running fleet). Because a rollback can also take back the heartbeat's own fields,
every beat writes them again from this process's memory: within one beat the hash tells the
truth again. `attempt` names the attempt of the job the worker runs (harvest.ids.new_attempt;
empty when idle), set before the engine gets a request of it: the janitor removes a dump file
whose attempt no live worker of its node named in two reads a heartbeat TTL apart, so a hash
rolled back with Redis's last second names it again (or expires) before the second read
(harvest.ops.janitor `UnnamedDumps`; while a new Redis holds reaping, nothing is removed for that
reason).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from harvest.node.spooldir import list_spooled
from harvest.state import scripts
from harvest.state.keys import Keys, worker_key
from harvest.state.roundtrip import ScriptCall, send_together

HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TTL_S = 15  # three missed beats: dead
COLLECTOR_BEAT_S = 2.0  # the spool backlog changes at every commit: refresh it more often

IDLE = "idle"
BUSY = "busy"
_NO_JOB = {"state": IDLE, "job_samples": "0", "attempt": ""}  # what a worker between jobs says of its job

_LIVE: dict[str, WorkerBeat] = {}  # this process's started heartbeats, by worker name


def _text(h: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


class WorkerBeat:
    """One worker's heartbeat hash `harvest:worker:<name>`: identity, engine, current job.

    Thread-safe: the job loop (job_started, job_ended, name_execution) and the heartbeat thread
    (beat) share it; what the worker is doing is kept here and written again at every beat."""

    def __init__(
        self, conn: redis.Redis, run: str, name: str, host: str, engine: str, ttl: int = HEARTBEAT_TTL_S
    ) -> None:
        self.conn, self.run, self.name, self.ttl = conn, run, name, ttl
        self.key = worker_key(name)
        self.keys = Keys(run)
        self.identity = {"name": name, "run": run, "host": host, "pid": str(os.getpid()), "engine": engine}
        self.doing = {"state": IDLE, "job": "", "execution": "", "job_samples": "0", "attempt": ""}
        self._lock = threading.Lock()
        self._beaten = time.monotonic()

    def _send(self, stamp: str = "", extra: dict[str, str] | None = None, join: bool = False) -> None:
        fields = {**self.identity, **self.doing, **(extra or {})}
        scripts.heartbeat(self.key, self.ttl, stamp, fields, (self.keys.workers, self.name) if join else None).run(
            self.conn
        )

    def start(self) -> None:
        """Announce the worker; must happen before it creates its claim dir (the janitor removes the
        claim dirs of workers without a heartbeat)."""
        with self._lock:
            self._send("started seen", {"job_started": "", "jobs_done": "0"}, join=True)
        _LIVE[self.name] = self

    def beat(self) -> None:
        """Keep the heartbeat alive and say again what this worker is doing (see the module docstring)."""
        with self._lock:
            self._send("seen")
            self._beaten = time.monotonic()

    def set_state(self, state: str) -> None:
        with self._lock:
            self.doing["state"] = state
            self._send()

    def name_execution(
        self, job_id: str, execution_id: str, pipe: redis.client.Pipeline, start: tuple[int, int] | None = None
    ) -> None:
        """Name the RQ execution this worker is starting, in `pipe`: the MULTI/EXEC in which RQ
        creates it (harvest.workers.rqworker.HarvestWorker.prepare_execution). `start`: (samples, attempt)
        of the job, named as `starting` names them, in the same transaction. No EVALSHA: a script
        called by its SHA in a transaction that meets a restarted Redis (no scripts loaded) fails
        the transaction; the job's start is an EVAL of the script's text (a few hundred bytes)."""
        with self._lock:
            self.doing.update(job=job_id, execution=execution_id)
            if start is None:
                pipe.hset(self.key, mapping=self._changing())
                pipe.expire(self.key, self.ttl)
                return
            self._start_call(*start).queue(pipe)

    def clear_execution(self, execution_id: str, pipe: redis.client.Pipeline) -> None:
        """Name no execution any more, in `pipe`: the MULTI/EXEC in which RQ removes `execution_id`
        (HarvestWorker.cleanup_execution) as it records the job's outcome, written again if RQ
        retries its transaction; the worker is idle, however the job ended (a job whose function
        raised before its end of job was named busy by its start: `name_execution`). This is the
        job's end of job too (`ending`): one job more done (where the execution was named), no job
        started. Nothing if the heartbeat names another one."""
        with self._lock:
            named = self.doing["execution"]
            if named not in (execution_id, ""):
                return
            pipe.hset(self.key, mapping={"name": self.name, **_NO_JOB, "job": "", "execution": "", "job_started": ""})
            if named == execution_id:
                pipe.hincrby(self.key, "jobs_done", 1)
            pipe.expire(self.key, self.ttl)
            self.doing.update(_NO_JOB, job="", execution="")

    def job_started(self, job_id: str, samples: int, attempt: int) -> None:
        send_together(self.conn, [self.starting(job_id, samples, attempt)])

    def starting(self, job_id: str, samples: int, attempt: int) -> ScriptCall:
        """`job_started`'s call, to be sent with the ledger's take of the job (one round trip,
        harvest.state.roundtrip); this process's own view of the job changes at once. `attempt`:
        the job's attempt number, the tail of its rids (harvest.ids.new_attempt), named until the
        job ends: the janitor removes a dump file whose attempt no live worker of its node named in
        two reads a heartbeat TTL apart (harvest.ops.janitor). Sent before the engine gets a
        request of it, so no dump file of the attempt exists before the heartbeat names it."""
        with self._lock:
            if self.doing["job"] != job_id:
                self.doing["execution"] = ""  # started outside HarvestWorker: the job alone names it
            self.doing["job"] = job_id
            return self._start_call(samples, attempt)

    def _start_call(self, samples: int, attempt: int) -> ScriptCall:
        """The heartbeat's write of a job's start (its samples and attempt, stamped `job_started`),
        with this process's view of the job changed; under the lock."""
        self.doing.update(state=BUSY, job_samples=str(samples), attempt=str(int(attempt)))
        return scripts.heartbeat(self.key, self.ttl, "job_started", self._changing())

    def _changing(self) -> dict[str, str]:
        """What a job's start and end write: what this worker is doing, and its name, which the
        janitor reads with the attempt (harvest.ops.janitor `_running_attempts`). The rest of its
        identity is written at its start and at every beat: a hash that Redis lost between two beats
        has it again within one (readers take a missing field for unknown)."""
        return {"name": self.name, **self.doing}

    def drop_start(self) -> None:
        """A job's start named in a transaction that failed (`name_execution`): this process's view
        is idle again, as the next beat writes."""
        with self._lock:
            self.doing.update(_NO_JOB)

    def job_ended(self) -> None:
        """The job function returned. An execution HarvestWorker named stays named, busy with its
        attempt, until RQ's transaction that removes it is sent (`clear_execution` ends the job
        there): RQ's started registry never holds it while the heartbeat says otherwise."""
        call = self.ending()
        if call is not None:
            send_together(self.conn, [call])

    def ending(self) -> ScriptCall | None:
        """`job_ended`'s call, to be sent with the ledger's settle of the job (one round trip);
        None for a job whose execution HarvestWorker named: RQ's outcome transaction ends it
        (`clear_execution`), a call a job less."""
        with self._lock:
            if self.doing["execution"]:
                return None
            self.doing.update(_NO_JOB, job="")
            return scripts.job_ended(self.key, self.ttl, {**self._changing(), "job_started": ""})

    def stop(self) -> None:
        """A clean exit: gone at once, nothing for the janitor to take back."""
        _LIVE.pop(self.name, None)
        with self._lock, self.conn.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.srem(self.keys.workers, self.name)
            pipe.execute()


def keep_alive() -> None:
    """Beat every heartbeat this process started that has not beaten for HEARTBEAT_INTERVAL_S. A
    long janitor step (harvest.ops.stranded's sweep) runs on the worker's heartbeat thread: the
    process is alive meanwhile, and must not look dead to the other janitors."""
    for b in list(_LIVE.values()):
        if time.monotonic() - b._beaten >= HEARTBEAT_INTERVAL_S:
            b.beat()


def live_beat(name: str) -> WorkerBeat | None:
    """The started heartbeat of this process's worker `name` (harvest.workers.rqworker finds its own)."""
    return _LIVE.get(name)


def read_workers(conn: redis.Redis, run: str) -> tuple[list[dict[str, str]], list[str]]:
    """(heartbeats of the live workers of the run, names announced whose heartbeat expired)."""
    names = sorted(n.decode() for n in conn.smembers(Keys(run).workers))
    pipe = conn.pipeline(transaction=False)
    for n in names:
        pipe.hgetall(worker_key(n))
    alive, dead = [], []
    for n, h in zip(names, pipe.execute(), strict=False):
        (alive.append(_text(h)) if h else dead.append(n))
    return alive, dead


@dataclass
class CollectorBeat:
    """A collector's heartbeat: its node's spool backlog, refreshed at most every COLLECTOR_BEAT_S
    (by the monotonic clock: a node clock stepped back must not stop the beats)."""

    conn: redis.Redis
    run: str
    node: str
    spool_dir: str
    ttl: int = HEARTBEAT_TTL_S
    _last: float | None = None

    def maybe_beat(self, shards_committed: int = 0, send: Callable[[ScriptCall], object] | None = None) -> bool:
        """Beat if COLLECTOR_BEAT_S passed since the last beat; True if it did. `send` sends the
        beat's write, read from the spool before it is called (the collector's: with its commits'
        stats in the same round trip, harvest.state.tally, so a beat that shows the spool empty
        comes with the counts of every commit that emptied it)."""
        now = time.monotonic()
        if self._last is not None and now - self._last < COLLECTOR_BEAT_S:
            return False
        self._last = now
        files = list_spooled(self.spool_dir)
        keys = Keys(self.run)
        fields = {
            "node": self.node,
            "pid": str(os.getpid()),
            "spool_files": str(len(files)),
            "spool_bytes": str(sum(size for _, _, size in files)),
            "shards_committed": str(shards_committed),
        }
        call = scripts.heartbeat(keys.collector(self.node), self.ttl, "seen", fields, (keys.collectors, self.node))
        if send is None:
            send_together(self.conn, [call])
        else:
            send(call)
        return True


def read_collectors(conn: redis.Redis, run: str) -> tuple[list[dict[str, str]], list[str]]:
    """(heartbeats of the live collectors of the run, nodes whose collector stopped beating)."""
    keys = Keys(run)
    nodes = sorted(n.decode() for n in conn.smembers(keys.collectors))
    pipe = conn.pipeline(transaction=False)
    for n in nodes:
        pipe.hgetall(keys.collector(n))
    alive, dead = [], []
    for n, h in zip(nodes, pipe.execute(), strict=False):
        (alive.append(_text(h)) if h else dead.append(n))
    return alive, dead
