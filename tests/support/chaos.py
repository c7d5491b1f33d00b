"""Fault-injection harness: real runs with processes SIGKILLed at random, then exact accounting.

One trial starts a private Redis (AOF), the reference engine (chunked prefill), workers, a
collector and the producer as separate processes, exactly as an operator would, over a
dataset of pre-tokenized rows whose sample ids are known in advance. At random moments it
SIGKILLs one of them (worker, engine, collector, producer or Redis) and starts it again; a
process that exits on its own (a worker whose Redis vanished) is restarted too, as a
supervisor would. When the producer has finished and every sample is done or failed, it
stops everything, runs the janitor, and accounts for every input sample:

- exactly one copy in exactly one committed shard (index file present), with its tokens, or
- exactly one failed entry with a reason;
- no shard without an index, no spool, dump or claim files left behind.

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
from dataclasses import dataclass, field

import numpy as np
import redis

from harvest.cli.redisproc import RedisServer
from harvest.ids import sample_id
from harvest.state.heartbeat import HEARTBEAT_TTL_S
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from tests.support.cli import REPO

KINDS = ("worker", "engine", "collector", "producer", "redis")


@dataclass
class TrialResult:
    seed: int
    samples: int
    kills: Counter = field(default_factory=Counter)
    restarts_on_exit: Counter = field(default_factory=Counter)
    done: int = 0
    failed: int = 0
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    wrong_tokens: list[str] = field(default_factory=list)
    failed_without_reason: list[str] = field(default_factory=list)
    failure_reasons: Counter = field(default_factory=Counter)
    shards_without_index: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not (self.error or self.lost or self.doubled or self.wrong_tokens or self.failed_without_reason
                    or self.shards_without_index or self.leftovers)

    def summary(self) -> str:
        return (f"seed {self.seed}: {'OK' if self.ok else 'FAIL'} {self.samples} samples, done {self.done}, failed "
                f"{self.failed} {dict(self.failure_reasons)}, kills {dict(self.kills)}, exits {dict(self.restarts_on_exit)}, "
                f"lost {len(self.lost)}, doubled {len(self.doubled)}, wrong {len(self.wrong_tokens)}, "
                f"unexplained failures {len(self.failed_without_reason)}, shards without index "
                f"{len(self.shards_without_index)}, leftovers {self.leftovers[:5]}, {self.seconds:.0f}s"
                + (f"; error: {self.error}" if self.error else ""))


def make_rows(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(3, 160))] for _ in range(n)]


class Trial:
    def __init__(self, root: str, model: str, seed: int, samples: int = 60, workers: int = 2, kills: int = 4,
                 chunk: int = 48, out_url: str | None = None, env: dict | None = None, deadline_s: float = 240) -> None:
        self.root, self.model, self.seed = root, model, seed
        self.rng = random.Random(seed)
        self.n, self.n_workers, self.n_kills, self.chunk = samples, workers, kills, chunk
        self.out = out_url or os.path.join(root, "out")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.deadline_s = deadline_s
        self.run = f"chaos{seed}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = os.path.join(root, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.dump = os.path.join(root, "dump")
        self.spool = os.path.join(root, "spool")
        self.redis = RedisServer(os.path.join(root, "redis"))
        self.port = 32000 + (os.getpid() * 7 + seed) % 2000
        self.result = TrialResult(seed, samples)
        self.last_worker_kill = 0.0

    # -- processes -------------------------------------------------------------------------
    def _cmd(self, name: str) -> list[str]:
        h = [sys.executable, "-m", "harvest.cli", "-v"]
        url = self.redis.url
        if name == "engine":
            return h + ["engine", "--model", self.model, "--dump-dir", self.dump, "--port", str(self.port),
                        "--chunked-prefill-size", str(self.chunk)]
        if name.startswith("worker"):
            return h + ["worker", "--run", self.run, "--redis", url, "--engine-url", f"http://127.0.0.1:{self.port}",
                        "--dump-dir", self.dump, "--spool-dir", self.spool, "--dump-timeout", "5",
                        "--retry-backoff", "1", "--retries", "20"]
        if name == "collector":
            return h + ["collect", "--run", self.run, "--redis", url, "--spool-dir", self.spool, "--max-wait", "1",
                        "--node", "node0"]
        if name == "producer":
            return h + ["produce", self.data, "--run", self.run, "--redis", url, "--model", self.model,
                        "--out", self.out, "--dtype", "fp32", "--max-queued", "16", "--no-progress"]
        raise ValueError(name)

    def _start(self, name: str) -> None:
        log = open(os.path.join(self.logs, f"{name}.log"), "ab")
        self.procs[name] = subprocess.Popen(self._cmd(name), cwd=REPO, env=self.env, stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def _kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def _names(self, kind: str) -> list[str]:
        if kind == "worker":
            return [f"worker{i}" for i in range(self.n_workers)]
        return [kind]

    def _kill_one(self, kind: str) -> None:
        self.result.kills[kind] += 1
        if kind == "redis":
            self.redis.kill()
            self.redis.start()
            return
        name = self.rng.choice(self._names(kind))
        if kind == "worker":
            self.last_worker_kill = time.monotonic()
        if name == "producer" and self.producer_done:
            return
        self._kill(name)
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
            self.result.restarts_on_exit[name.rstrip("0123456789")] += 1
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
    def execute(self) -> TrialResult:
        t0 = time.monotonic()
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(self.model).vocab_size
        rows = make_rows(self.n, vocab, self.rng)
        rows += rows[: max(1, self.n // 10)]  # duplicate rows: the same sample, to be stored once
        self.expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)): r for r in rows}
        self.data = os.path.join(self.root, "data.jsonl")
        with open(self.data, "w") as f:
            for r in rows:
                f.write(json.dumps({"input_ids": r}) + "\n")
        self.producer_done = False
        self.redis.start()
        conn = redis.Redis.from_url(self.redis.url)
        try:
            self._start("engine")
            self._start("producer")
            while not conn.exists(Keys(self.run).config) and self.procs["producer"].poll() is None:
                time.sleep(0.1)  # workers and collector read the run from Redis: let the producer publish it
            for i in range(self.n_workers):
                self._start(f"worker{i}")
            self._start("collector")
            t_start = time.monotonic() - t0  # kill while the pipeline runs, not while it starts
            kill_at = sorted(t_start + self.rng.uniform(1.0, 15.0) for _ in range(self.n_kills))
            while True:
                now = time.monotonic() - t0
                if now > self.deadline_s:
                    c = Ledger(conn, self.run).counts()
                    self.result.error = f"not finished after {self.deadline_s:.0f}s: ledger {c}, producer done {self.producer_done}"
                    break
                if kill_at and now >= kill_at[0]:
                    kill_at.pop(0)
                    kind = self.rng.choice(KINDS)
                    self.result.timeline.append(f"{now:.1f}s kill {kind}")
                    self._kill_one(kind)
                self._supervise()
                if not kill_at and self._finished(conn):
                    break
                time.sleep(0.2)
        finally:
            for name in list(self.procs):
                p = self.procs[name]
                if p.poll() is None:
                    p.terminate()
            for p in self.procs.values():
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        try:
            if not self.result.error:
                # The janitor removes a claim dir only once its worker's heartbeat has expired
                # (15 s TTL), and files the ledger proves stale after a 2 s grace: wait those out.
                wait = 2.5
                if any(n.startswith(".claimed-") for n in os.listdir(self.dump)) and self.last_worker_kill:
                    wait = max(wait, self.last_worker_kill + HEARTBEAT_TTL_S + 1 - time.monotonic())
                time.sleep(wait)
                subprocess.run([sys.executable, "-m", "harvest.cli", "janitor", "--run", self.run, "--redis",
                                self.redis.url, "--dump-dir", self.dump], cwd=REPO, env=self.env,
                               capture_output=True, timeout=120, check=True)
                self._account(conn)
        except Exception as e:  # noqa: BLE001 - the harness reports, the test asserts
            self.result.error = f"{type(e).__name__}: {e}"
        finally:
            self.redis.stop()
            self.result.seconds = time.monotonic() - t0
        return self.result

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
        reader = RunReader(f"{self.out}/{self.run}")
        for sid in copies:
            if reader.get(sid)["input_ids"].tolist() != self.expected.get(sid):
                res.wrong_tokens.append(sid)
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
        for d in (self.spool, self.dump):
            if os.path.isdir(d):
                for dirpath, dirnames, files in os.walk(d):
                    res.leftovers += [os.path.join(dirpath, x) for x in files + [n for n in dirnames if n.startswith(".claimed")]
                                      if x != ".spool-id"]
