"""Fault-injection harness: real runs with processes SIGKILLed at random, then exact accounting.

One trial starts a private Redis (AOF), and per node the reference engine (chunked prefill),
workers and a collector with a spool and a dump dir of their own, plus the producer, as
separate processes, exactly as an operator would, over a dataset of pre-tokenized rows whose
sample ids are known in advance. At random moments it SIGKILLs one of them (worker, engine,
collector, producer or Redis) and starts it again; a process that exits on its own (a worker
whose Redis vanished) is restarted too, as a supervisor would. With several nodes, a `node`
fault kills every process of one node and withholds its disk: the node comes back within the
run's spool grace, after it (its spool reclaimed meanwhile), or never; a `freeze` fault stops a node
mid-commit and resumes it where it stopped (tests.support.chaos_freeze). When the producer has
finished and every sample is done or failed, it stops everything, runs each returned node's
collector and janitor once more, and accounts for every input sample:

- exactly one copy in exactly one committed shard (index file present), with its tokens, or
- exactly one failed entry with a reason;
- no shard without an index, no spool, dump or claim files left behind (on the disks that
  came back).

Used by tests/system/test_chaos.py (a few short trials) and bench/chaos.py (long soaks).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import redis

from harvest.cli.redisproc import RedisServer
from harvest.formats.dump import parse_chunk_name
from harvest.ids import parse_rid, sample_id
from harvest.state.heartbeat import HEARTBEAT_TTL_S
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.aof import AofHistory
from tests.support.chaos_freeze import Freezer
from tests.support.chaos_result import TrialResult, killed_writers_temp
from tests.support.cli import REPO
from tests.support.ops import reconcile_if_new
from tests.support.ports import reserve_ports

KINDS = ("worker", "engine", "collector", "producer", "redis", "rollback")
ROLLBACK_LAGS = (1.0, 2.0)  # what `appendfsync everysec` may lose on a kill or a power cut: its last second(s)
RETURNS = ("within", "after", "never")  # when a lost node comes back, against the spool grace


def make_rows(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(3, 160))] for _ in range(n)]


class Trial:
    def __init__(
        self,
        root: str,
        model: str,
        seed: int,
        samples: int = 60,
        workers: int = 2,
        kills: int = 4,
        chunk: int = 48,
        out_url: str | None = None,
        env: dict | None = None,
        deadline_s: float = 420,
        nodes: int = 1,
        grace_s: float | None = None,
        kinds: tuple[str, ...] | None = None,
        returns: tuple[str, ...] | None = None,
        on_commit: bool = False,
        rollback_lags: tuple[float, ...] = ROLLBACK_LAGS,
    ) -> None:
        """`kinds`: what may be killed (default: every kind, `node` too with several nodes);
        `returns`: the order in which lost nodes come back (default: at random); `on_commit`: the
        faults strike right after a collector commits a shard (an index file appears), not at
        random moments; `rollback_lags`: the seconds a `rollback` fault takes back from the AOF."""
        self.root, self.model, self.seed = root, model, seed
        self.rng = random.Random(seed)
        self.n, self.n_workers, self.n_kills, self.chunk = samples, workers, kills, chunk
        # Several nodes: a short grace, so that a lost node is reclaimed within the trial.
        self.n_nodes, self.grace_s = nodes, grace_s or (10.0 if nodes > 1 else 120.0)
        self.kinds = kinds or KINDS + (("node", "freeze") if nodes > 1 else ())
        self.returns = list(returns or ())
        self.down: dict[int, float | None] = {}  # lost node -> when it comes back (None: never)
        self.never: set[int] = set()
        self.out = out_url or os.path.join(root, "out")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.deadline_s = deadline_s
        self.run = f"chaos{seed}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = os.path.join(root, "logs")
        os.makedirs(self.logs, exist_ok=True)

        # Engines and Redis come back at the same address after a kill: reserved ports
        # (tests.support.ports), engine n at `self.port + n`, Redis after them.
        self.ports = reserve_ports(nodes + 1)
        self.port = self.ports.first
        self.redis = RedisServer(os.path.join(root, "redis"), port=self.port + nodes)
        self.aof = AofHistory(self.redis)
        self.result = TrialResult(seed, samples)
        self.freezer = Freezer(self.rng, self.grace_s, self.result.timeline)
        self.last_worker_kill = 0.0
        self.on_commit, self.rollback_lags = on_commit, rollback_lags

    # -- processes -------------------------------------------------------------------------
    # Names: producer; per node n: engine{n}, worker{n}.{j}, collector{n}.
    def dump(self, n: int) -> str:
        return os.path.join(self.root, f"dump{n}")

    def spool(self, n: int) -> str:
        return os.path.join(self.root, f"spool{n}")

    def _node_procs(self, n: int) -> list[str]:
        return [f"engine{n}", *(f"worker{n}.{j}" for j in range(self.n_workers)), f"collector{n}"]

    def _cmd(self, name: str) -> list[str]:
        h = [sys.executable, "-m", "harvest.cli", "-v"]
        url = self.redis.url
        kind, n = name.rstrip("0123456789."), int((name[len(name.rstrip("0123456789.")) :] or "0").split(".")[0])
        port = self.port + n
        if kind == "engine":
            return h + [
                "engine",
                "--model",
                self.model,
                "--dump-dir",
                self.dump(n),
                "--port",
                str(port),
                "--chunked-prefill-size",
                str(self.chunk),
            ]
        if kind == "worker":
            return h + [
                "worker",
                "--run",
                self.run,
                "--redis",
                url,
                "--engine-url",
                f"http://127.0.0.1:{port}",
                "--dump-dir",
                self.dump(n),
                "--spool-dir",
                self.spool(n),
                "--dump-timeout",
                "5",
                "--retry-backoff",
                "1",
                "--retries",
                "20",
                "--node",
                f"node{n}",
                "--engine-wait",
                "60",
            ]
        if kind == "collector":
            return h + [
                "collect",
                "--run",
                self.run,
                "--redis",
                url,
                "--spool-dir",
                self.spool(n),
                "--max-wait",
                "1",
                "--node",
                f"node{n}",
            ]
        if kind == "producer":
            return h + [
                "produce",
                self.data,
                "--run",
                self.run,
                "--redis",
                url,
                "--model",
                self.model,
                "--out",
                self.out,
                "--dtype",
                "fp32",
                "--max-queued",
                "16",
                "--no-progress",
                "--spool-grace",
                str(self.grace_s),
            ]
        raise ValueError(name)

    def _start(self, name: str) -> None:
        with open(os.path.join(self.logs, f"{name}.log"), "ab") as log:
            env = {**self.env, **self.freezer.env_for(name)}
            self.procs[name] = subprocess.Popen(
                self._cmd(name), cwd=REPO, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )

    def _restart(self, name: str) -> None:
        self._kill(name)
        self._start(name)

    def _kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def _up(self) -> list[int]:
        return [n for n in range(self.n_nodes) if n not in self.down and n not in self.freezer.held]

    def _names(self, kind: str) -> list[str]:
        up = self._up()
        if kind == "worker":
            return [f"worker{n}.{j}" for n in up for j in range(self.n_workers)]
        if kind in ("engine", "collector"):
            return [f"{kind}{n}" for n in up]
        return [kind]

    def _kill_one(self, kind: str, now: float) -> None:
        self.result.kills[kind] += 1
        if kind == "redis":
            self.redis.kill()
            self.redis.start()
            return
        if kind == "rollback":
            lag = self.rng.choice(self.rollback_lags)
            self.result.timeline.append(f"rollback {lag:.0f}s: {self.aof.rollback(lag)}")
            return
        if kind in ("node", "freeze"):
            self._lose_node(now) if kind == "node" else self.freezer.strike(now, self._up(), self._restart)
            return
        name = self.rng.choice(self._names(kind))
        if kind == "worker":
            self.last_worker_kill = time.monotonic()
        if name == "producer" and self.producer_done:
            return
        self._restart(name)

    def _commits(self) -> int:
        from harvest.storage import Location

        try:
            return len(Location.from_url(f"{self.out}/{self.run}").list("index", ".json"))
        except Exception:  # noqa: BLE001 - a store mid-restart: no news
            return 0

    def _wait_nodes_up(self, conn: redis.Redis, timeout: float = 120.0) -> None:
        """Until every node holds a spool lease (a node lost before has nothing to reclaim), bounded."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.procs["producer"].poll() in (None, 0):
            if len({v.decode() for v in conn.hvals(Keys(self.run).spool_nodes)}) >= self.n_nodes:
                return
            time.sleep(0.2)

    def _lose_node(self, now: float, n: int | None = None) -> None:
        """Every process of node `n` (or a random one) at once, its disk withheld; the last node up is never lost."""
        up = self._up()
        if len(up) < 2 or (n is not None and n not in up):
            return
        n = self.rng.choice(up) if n is None else n
        back = self.returns.pop(0) if self.returns else self.rng.choice(RETURNS)
        self.result.node_returns[back] += 1
        for name in self._node_procs(n):
            self._kill(name)
            self.procs.pop(name, None)
        self.last_worker_kill = time.monotonic()
        # "after": long enough past the grace that the live nodes' janitors (a pass every 5 s) revoke it
        self.down[n] = {"within": now + 0.5, "after": now + self.grace_s + 10.0, "never": None}[back]
        if back == "never":
            self.never.add(n)
        self.result.timeline.append(f"{now:.1f}s node{n} lost, back {back}")

    def _bring_back(self, now: float) -> None:
        for n, at in list(self.down.items()):
            if at is not None and now >= at:
                del self.down[n]
                self.result.timeline.append(f"{now:.1f}s node{n} back")
                for name in self._node_procs(n):
                    self._start(name)

    def _supervise(self) -> None:
        """Restart what exited on its own (a worker that lost Redis, say); note the producer's end."""
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            if name == "producer" and rc == 0:
                self.producer_done = True
                del self.procs[name]
                continue
            self.result.restarts_on_exit[name.rstrip("0123456789.")] += 1
            time.sleep(0.2)
            self._start(name)

    def _finished(self, conn: redis.Redis) -> bool:
        if not self.producer_done:
            return False
        try:
            c = Ledger(conn, self.run).counts()
        except redis.RedisError:
            return False
        return c["queued"] == 0 and c["spooled"] == 0 and c["done"] + c["failed"] == len(self.expected)

    # -- the trial ------------------------------------------------------------------------
    def _write_dataset(self, vocab: int) -> dict:
        """The dataset written to `self.data`; returns sample id -> its tokens (what `_account` compares)."""
        rows = make_rows(self.n, vocab, self.rng)
        rows += rows[: max(1, self.n // 10)]  # duplicate rows: the same sample, to be stored once
        with open(self.data, "w") as f:
            f.writelines(json.dumps({"input_ids": r}) + "\n" for r in rows)
        return {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)): r for r in rows}

    def execute(self) -> TrialResult:
        t0 = time.monotonic()
        from transformers import AutoConfig

        self.data = os.path.join(self.root, "data.jsonl")
        self.expected = self._write_dataset(AutoConfig.from_pretrained(self.model).vocab_size)
        self.producer_done = False
        self.redis.start()
        conn = redis.Redis.from_url(self.redis.url)
        try:
            self._start_pipeline(conn)
            self._drive(conn, t0)
        finally:
            self._stop_processes()
        try:
            if not self.result.error:
                self._final_passes(conn)
                self.result.spools_reclaimed = Ledger(conn, self.run).stats().get("spools_reclaimed", 0)
                self.result.spools_revoked = conn.scard(Keys(self.run).revoked_spools)
                self._account(conn)
        except Exception as e:  # noqa: BLE001 - the harness reports, the test asserts
            self.result.error = f"{type(e).__name__}: {e}"
        finally:
            self.redis.stop()
            self.ports.close()
            self.result.seconds = time.monotonic() - t0
        return self.result

    def _start_pipeline(self, conn: redis.Redis) -> None:
        """The engines and the producer, then each node's workers and collector once the run is published."""
        for n in range(self.n_nodes):
            self._start(f"engine{n}")
        self._start("producer")
        while not conn.exists(Keys(self.run).config) and self.procs["producer"].poll() is None:
            time.sleep(0.1)  # workers and collector read the run from Redis: let the producer publish it
        for n in range(self.n_nodes):
            for name in self._node_procs(n)[1:]:
                self._start(name)
        self._wait_nodes_up(conn)

    def _drive(self, conn: redis.Redis, t0: float) -> None:
        """Kill, bring back and supervise processes until the run is finished (or past the deadline:
        `result.error`)."""
        t_start = time.monotonic() - t0  # kill while the pipeline runs, not while it starts
        kill_at = sorted(t_start + self.rng.uniform(1.0, 15.0) for _ in range(self.n_kills))
        commits = 0
        while True:
            self.aof.note()
            if self.on_commit and kill_at:
                seen = self._commits()
                kill_at = [0.0] * len(kill_at) if seen > commits else [float("inf")] * len(kill_at)
                commits = seen
            now = time.monotonic() - t0
            if now > self.deadline_s:
                self.result.error = (
                    f"not finished after {self.deadline_s:.0f}s: ledger "
                    f"{Ledger(conn, self.run).counts()}, producer done {self.producer_done}"
                )
                return
            if kill_at and now >= kill_at[0]:
                kill_at.pop(0)
                kind = self.rng.choice(self.kinds)
                self.result.timeline.append(f"{now:.1f}s kill {kind}")
                self._kill_one(kind, now)
            self._bring_back(now)
            self.freezer.tick(now, self.procs, [self._node_procs(n) for n in range(self.n_nodes)])
            self._supervise()
            if (
                (not kill_at or self.on_commit)
                and not [a for a in self.down.values() if a is not None]
                and not self.freezer.held
                and self._finished(conn)
            ):
                return
            time.sleep(0.2)

    def _stop_processes(self) -> None:
        for name in list(self.procs):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a frozen one, too, ends as told
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _final_passes(self, conn: redis.Redis) -> None:
        """What the fleet's live processes would still do: reconcile a new Redis, then on each node that
        came back a last collect (several nodes) and janitor passes until its claim dirs are gone."""
        # A claim dir goes once its worker's heartbeat expired (15 s), stale files after 2 s: wait those out
        wait = 2.5
        back = [n for n in range(self.n_nodes) if n not in self.never]
        claims = any(
            x.startswith(".claimed-") for n in back if os.path.isdir(self.dump(n)) for x in os.listdir(self.dump(n))
        )
        if claims and self.last_worker_kill:
            wait = max(wait, self.last_worker_kill + HEARTBEAT_TTL_S + 1 - time.monotonic())
        reconcile_if_new(conn, self.run)  # a Redis killed last: no process of the run reconciled it
        time.sleep(wait)
        for n in back:
            if self.n_nodes > 1:  # a node that came back deletes its copies of samples others committed
                self._harvest("collect", "--spool-dir", self.spool(n), "--node", f"node{n}", "--burst")
            self._janitor(n)
            # A worker killed just before the end leaves a claim dir: more passes, as live workers run them
            for _ in range(HEARTBEAT_TTL_S // 3):
                if not os.path.isdir(self.dump(n)) or not any(
                    x.startswith(".claimed-") for x in os.listdir(self.dump(n))
                ):
                    break
                time.sleep(3)
                self._janitor(n)

    def _janitor(self, n: int) -> None:
        out = self._harvest("janitor", "--dump-dir", self.dump(n)).stdout.decode().strip()
        self.result.janitor_lines.append(f"{time.monotonic():.1f} node{n}: {out}")

    def _harvest(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "harvest.cli", args[0], "--run", self.run, "--redis", self.redis.url, *args[1:]],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            timeout=120,
            check=True,
        )

    def _account(self, conn: redis.Redis) -> None:
        from harvest.read.reader import RunReader
        from harvest.storage import Location

        res = self.result
        loc = Location.from_url(f"{self.out}/{self.run}")
        indexed = {os.path.basename(p).removesuffix(".json") for p in loc.list("index", ".json")}
        shards = {os.path.basename(p).removesuffix(".safetensors") for p in loc.list("shards", ".safetensors")}
        res.shards_without_index = sorted(shards - indexed)
        copies = Counter()
        for name in indexed:  # counted from the index files themselves: a reader would hide duplicates
            copies.update(loc.read_json(f"index/{name}.json")["samples"])
        try:
            reader = RunReader(f"{self.out}/{self.run}")
            for sid in copies:
                if reader.get(sid)["input_ids"].tolist() != self.expected.get(sid):
                    res.wrong_tokens.append(sid)
        except Exception as e:  # noqa: BLE001 - a run that cannot be read is the worst outcome: counted
            res.unreadable = f"{type(e).__name__}: {e}"
        failures = Ledger(conn, self.run).failures()
        res.done = sum(1 for sid in self.expected if copies[sid])
        res.failed = sum(1 for sid in self.expected if sid in failures and not copies[sid])
        for sid in self.expected:
            if copies[sid] > 1 or (copies[sid] and sid in failures):
                res.doubled.append(sid)
            elif not copies[sid] and sid not in failures:
                res.lost.append(sid)
        for sid, f in failures.items():
            if not f.get("reason"):
                res.failed_without_reason.append(sid)
            res.failure_reasons[f.get("reason", "")] += 1
        res.doubled += [sid for sid in copies if sid not in self.expected]
        for d in [f(n) for n in range(self.n_nodes) if n not in self.never for f in (self.spool, self.dump)]:
            if os.path.isdir(d):
                for dirpath, dirnames, files in os.walk(d):
                    left = [
                        os.path.join(dirpath, x)
                        for x in files + [n for n in dirnames if n.startswith(".claimed")]
                        if x not in (".spool-id", ".spool-id.lock")
                    ]
                    res.killed_temps += sum(map(killed_writers_temp, left))
                    res.leftovers += [self._leftover(conn, p) for p in left if not killed_writers_temp(p)]

    def _leftover(self, conn: redis.Redis, path: str) -> str:
        """A file left behind, with what tells why the janitor kept it: its age, and for a dump
        file its attempt number and its sample's state in the ledger."""
        try:
            age = f"{time.time() - os.stat(path).st_mtime:.1f}s old"
        except FileNotFoundError:
            age = "gone since"
        chunk = parse_chunk_name(os.path.basename(path))
        if chunk is None:
            return f"{path} ({age})"
        sid, attempt = parse_rid(chunk[0])
        ledger = Ledger(conn, self.run)
        return f"{path} ({age}, attempt {attempt}; ledger: state {ledger.states([sid])[0]})"
