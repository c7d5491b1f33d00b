"""The RQ job: one batch of samples through the engine, the dump directory and the spool.

RQ calls `process_batch` with the JSON payload only; everything node-local (engine URL, dump
and spool directories) comes from the `WorkerContext` that `harvest worker` installs before it
starts taking jobs. Samples not in state `q` are skipped, so a duplicated or retried job
never spools a sample twice.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import redis

from harvest.config import RunConfig
from harvest.ids import rid_for
from harvest.ledger import QUEUED, Ledger
from harvest.payload import decode_batch
from harvest.spool import list_spooled, write_sample
from workers.claim import SampleFailure, assemble, claim
from workers.engine_client import EngineClient, EngineUnavailable, Rejected

log = logging.getLogger("harvest.worker")


@dataclass
class WorkerContext:
    conn: redis.Redis
    cfg: RunConfig
    engine: EngineClient
    dump_dir: str
    spool_dir: str
    claim_dir: str
    dump_timeout: float = 60.0
    max_spool_bytes: int = 64 << 30

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.conn, self.cfg.run)


_context: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    global _context
    _context = ctx


def _ctx() -> WorkerContext:
    if _context is None:
        raise RuntimeError("process_batch runs only inside `harvest worker` (no worker context installed)")
    return _context


def _wait_for_spool_room(ctx: WorkerContext) -> None:
    """Backpressure: a collector that falls behind makes workers wait, not fill the disk."""
    warned = False
    while sum(size for _, _, size in list_spooled(ctx.spool_dir)) > ctx.max_spool_bytes:
        if not warned:
            log.warning("spool %s above %d bytes: waiting for the collector", ctx.spool_dir, ctx.max_spool_bytes)
            warned = True
        time.sleep(0.5)


def process_batch(payload: dict) -> dict:
    ctx = _ctx()
    run, samples = decode_batch(payload)
    if run != ctx.cfg.run:
        raise ValueError(f"job of run {run!r} reached a worker of run {ctx.cfg.run!r}")
    ledger = ctx.ledger
    states = ledger.states([s.id for s in samples])
    todo = [s for s, st in zip(samples, states) if st == QUEUED]
    if not todo:
        return {"spooled": 0, "failed": 0, "skipped": len(samples)}
    _wait_for_spool_room(ctx)
    attempts = ledger.next_attempts([s.id for s in todo])
    by_rid = {rid_for(s.id, a): s for s, a in zip(todo, attempts)}
    failures: dict[str, tuple[str, str]] = {}
    try:
        results = ctx.engine.generate(list(by_rid), [s.input_ids.tolist() for s in todo])
    except EngineUnavailable as e:
        ledger.mark_failed({s.id: ("engine-unavailable", str(e)) for s in todo})
        claim(ctx.dump_dir, ctx.claim_dir, {r: s.num_tokens for r, s in by_rid.items()}, timeout=0)
        return {"spooled": 0, "failed": len(todo), "skipped": len(samples) - len(todo)}
    wanted: dict[str, int] = {}
    for r in results:
        s = by_rid[r.rid]
        if isinstance(r, Rejected):
            failures[s.id] = ("engine-rejected", r.message)
        elif r.prompt_tokens not in (-1, s.num_tokens):
            failures[s.id] = ("prompt-length", f"engine saw {r.prompt_tokens} prompt tokens, sent {s.num_tokens}")
        elif r.cached_tokens:
            failures[s.id] = (
                "prefix-cached",
                f"engine served {r.cached_tokens} prompt tokens from its prefix cache, so their hidden states were "
                "never computed: run SGLang with --disable-radix-cache, or a version that honours extra_key",
            )
        wanted[r.rid] = s.num_tokens
    claimed, missing = claim(ctx.dump_dir, ctx.claim_dir, wanted, ctx.dump_timeout)
    for rid, f in missing.items():
        failures.setdefault(by_rid[rid].id, (f.reason, f.message))
    spooled, tokens, nbytes = [], 0, 0
    for rid, c in claimed.items():
        s = by_rid[rid]
        try:
            if s.id not in failures:
                sample = assemble(c, s, ctx.cfg.capture_points, ctx.cfg.torch_dtype, ctx.cfg.allow_nonfinite)
                nbytes += write_sample(ctx.spool_dir, sample, ctx.cfg.run)
                spooled.append(s.id)
                tokens += s.num_tokens
        except SampleFailure as e:
            failures[s.id] = (e.reason, e.message)
        finally:
            for p in c.paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    ledger.mark_spooled(spooled)
    if failures:
        ledger.mark_failed(failures)
        for sid, (reason, msg) in failures.items():
            log.warning("sample %s failed: %s: %s", sid, reason, msg)
    ledger.add_stats(tokens_spooled=tokens, bytes_spooled=nbytes)
    return {"spooled": len(spooled), "failed": len(failures), "skipped": len(samples) - len(todo)}
