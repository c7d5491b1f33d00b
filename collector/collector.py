"""One collector per node packs the node's spool into shards and commits them.

Commit order is the contract readers rely on: record the shard's sample set in Redis, write
the shard, write its index file (the commit), mark the samples done, delete their spool
files, clear the record. A collector killed anywhere in that sequence finds the record on
restart and finishes the same shard (same samples, same order, same bytes, same id), so no
sample is packed twice and none is lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable

import redis

from harvest.config import RunConfig
from harvest.ledger import DONE, Ledger
from harvest.runstore import run_location
from harvest.shard import build_shard, index_file, shard_file
from harvest.spool import list_spooled, read_sample, spool_path

log = logging.getLogger("harvest.collector")


def node_name() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "node"


class Collector:
    def __init__(
        self,
        conn: redis.Redis,
        cfg: RunConfig,
        spool_dir: str,
        node: str | None = None,
        shard_bytes: int | None = None,
        max_wait: float = 60.0,
    ) -> None:
        self.conn, self.cfg, self.spool_dir = conn, cfg, spool_dir
        self.ledger = Ledger(conn, cfg.run)
        self.packing_key = self.ledger.keys.packing(node or node_name())
        self.shard_bytes = shard_bytes or cfg.shard_bytes
        self.max_wait = max_wait
        self.out = run_location(cfg.out_url, cfg.run)
        self.shards_committed = 0

    def resume(self) -> None:
        """Finish the shard a previous incarnation of this collector was committing."""
        raw = self.conn.get(self.packing_key)
        if raw is None:
            return
        rec = json.loads(raw)
        log.info("resuming shard %s (%d samples)", rec["shard_id"], len(rec["sample_ids"]))
        self._commit(rec["sample_ids"], resumed_shard=rec["shard_id"])

    def step(self, force: bool = False) -> int:
        """Commit one shard if one is due; returns the number of samples committed."""
        files = list_spooled(self.spool_dir)
        if not files:
            return 0
        states = self.ledger.states([sid for sid, _, _ in files])
        ready = []
        for (sid, path, size), st in zip(files, states):
            if st == DONE:  # a duplicate of a committed sample: the shard already holds it
                _unlink(path)
            else:
                ready.append((sid, path, size))
        if not ready:
            return 0
        chosen, total = [], 0
        for sid, _, size in ready:
            if chosen and total + size > self.shard_bytes:
                break
            chosen.append(sid)
            total += size
        full = total >= self.shard_bytes or len(chosen) < len(ready)
        oldest_age = time.time() - os.stat(ready[0][1]).st_mtime
        idle = self.ledger.counts()["queued"] == 0
        if not (force or full or idle or oldest_age >= self.max_wait):
            return 0
        return self._commit(chosen)

    def _commit(self, sample_ids: list[str], resumed_shard: str | None = None) -> int:
        paths = [spool_path(self.spool_dir, s) for s in sample_ids]
        present = [os.path.exists(p) for p in paths]
        if resumed_shard and not all(present):
            # Spool files are deleted only after the index was written and the ledger updated.
            if self.out.exists(index_file(resumed_shard)):
                self.ledger.mark_done(sample_ids)
                for p in paths:
                    _unlink(p)
                self.conn.delete(self.packing_key)
                return 0
            raise RuntimeError(
                f"shard {resumed_shard} was being packed but {present.count(False)} of its spool files are gone "
                "and it has no index file: the spool was modified outside harvest"
            )
        samples = [read_sample(p) for p in paths]
        shard_id, data, index = build_shard(samples, self.cfg.run, self.cfg.capture_points)
        if resumed_shard and shard_id != resumed_shard:
            raise RuntimeError(f"re-packed shard id {shard_id} differs from the recorded {resumed_shard}")
        self.conn.set(self.packing_key, json.dumps({"shard_id": shard_id, "sample_ids": sample_ids}))
        if not self.out.exists(index_file(shard_id)):
            self.out.write_atomic(shard_file(shard_id), data)
            self.out.write_atomic(index_file(shard_id), json.dumps(index, indent=1).encode())
        changed = self.ledger.mark_done(sample_ids)
        tokens = {s.id: s.num_tokens for s in samples}
        self.ledger.add_stats(tokens_done=sum(tokens[i] for i in changed), bytes_done=len(data), shards=1)
        for p in paths:
            _unlink(p)
        self.conn.delete(self.packing_key)
        self.shards_committed += 1
        log.info("committed shard %s: %d samples, %d bytes", shard_id, len(samples), len(data))
        return len(samples)

    def run(self, should_stop: Callable[[], bool] = lambda: False, poll: float = 0.5) -> None:
        self.resume()
        while not should_stop():
            if self.step() == 0:
                time.sleep(poll)
        while self.step(force=True):
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
