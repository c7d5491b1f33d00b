"""Reclaiming a lost spool: its samples back on the queue, and none of them committed twice.

The janitor reclaims a spool whose lease lapsed for the run's grace period (harvest.state.spools);
`harvest requeue --spool ID / --node NAME` reclaims one at once for an operator who knows the node
is gone. In order:

1. The spool id is revoked. From here on no sample becomes spooled for it and no collector of it
   passes the commit fence, so the set of samples it owns only shrinks.
2. Samples of a shard whose commit was already decided (its index document is in a packing
   record, harvest.state.ledger.Ledger.fence_commit) are left alone: any collector finishes them.
3. The rest, in chunks, each in one MULTI/EXEC: the ledger moves them `s -> q` (only those the
   spool still owns) and RQ jobs are enqueued for them from the payload rows kept while they were
   spooled. A new attempt gives them new rids, so the lost node's late dumps are never claimed.
   A sample whose row was not kept fails as `spool-lost` (produce the dataset again to redo it).

A janitor killed between chunks leaves the rest owned by the revoked spool; the next pass
finishes them (the spool is revoked but still listed with samples).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from harvest.config import RunConfig
from harvest.ids import job_id_for
from harvest.sample import split_jobs
from harvest.state.failures import SPOOL_LOST
from harvest.state.heartbeat import keep_alive
from harvest.state.jobs import enqueue_samples, run_queue
from harvest.state.ledger import Ledger
from harvest.state.packing import PackingRecords
from harvest.state.payload import PAYLOAD_VERSION, PayloadError, decode_batch
from harvest.state.spools import SpoolLeases

log = logging.getLogger("harvest.janitor")

CHUNK = 1000  # samples per transaction


@dataclass
class ReclaimReport:
    spool: str
    node: str
    samples: list[str] = field(default_factory=list)  # moved back to queued
    jobs: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # failed: no payload row kept
    decided: list[str] = field(default_factory=list)  # in a shard whose commit was decided: left to finish


def reclaim_spool(conn: redis.Redis, cfg: RunConfig, spool: str) -> ReclaimReport:
    """Revoke `spool` and put the samples it owns back on the queue (see the module docstring)."""
    ledger, leases = Ledger(conn, cfg.run), SpoolLeases(conn, cfg.run)
    node = leases.node_of(spool)
    first = leases.revoke(spool)
    rep = ReclaimReport(spool, node)
    rep.decided = sorted(PackingRecords(conn, cfg.run).decided_samples(spool))
    skip = set(rep.decided)
    owned = [s for s in ledger.owned_by(spool, tick=keep_alive) if s not in skip]
    for i in range(0, len(owned), CHUNK):
        samples, job_ids, lost = enqueue_again(conn, cfg, spool, owned[i : i + CHUNK])
        rep.samples += samples
        rep.jobs += job_ids
        if lost:
            rep.lost += ledger.mark_failed(
                {
                    sid: (
                        SPOOL_LOST,
                        f"spool {spool} of node {node} was reclaimed and this "
                        "sample's tokens were not kept: produce the dataset again",
                    )
                    for sid in lost
                }
            )
    if rep.samples or rep.lost:  # a spool revoked empty (its node shut down cleanly) is no loss to count
        ledger.add_stats(spools_reclaimed=int(first), samples_reclaimed=len(rep.samples))
        log.warning(
            "spool %s of node %s reclaimed: %d samples back on the queue in %d jobs, %d lost, %d left to a "
            "decided commit",
            spool,
            node,
            len(rep.samples),
            len(rep.jobs),
            len(rep.lost),
            len(rep.decided),
        )
    return rep


def enqueue_again(
    conn: redis.Redis,
    cfg: RunConfig,
    spool: str,
    ids: list[str],
    also: Callable[[redis.client.Pipeline], None] | None = None,
) -> tuple[list[str], list[str], list[str]]:
    """Those of `ids` that `spool` owns moved `s -> q`, with new jobs built from their kept payload
    rows, in one MULTI/EXEC (with what `also` adds to it). Returns (the samples with a row, the
    jobs' ids, the samples without a row: left as they are)."""
    ledger = Ledger(conn, cfg.run)
    samples, lost = [], []
    for sid, row in zip(ids, ledger.spooled_payloads(ids), strict=False):
        try:
            _, (s,) = decode_batch({"v": PAYLOAD_VERSION, "run": cfg.run, "samples": [json.loads(row)]})
            samples.append(s)
        except (TypeError, ValueError, PayloadError):  # no row kept (None), or not one we can read
            lost.append(sid)
    batches = split_jobs(samples, cfg.max_batch_samples, cfg.max_batch_tokens)
    job_ids = [f"{job_id_for(cfg.run, [s.id for s in b])}-x{time.time_ns()}" for b in batches]
    queue = run_queue(conn, cfg.run)
    with conn.pipeline(transaction=True) as pipe:
        pipe.multi()
        ledger.reclaim(spool, [s.id for s in samples], pipe=pipe)
        for b, job_id in zip(batches, job_ids, strict=False):
            enqueue_samples(queue, cfg.run, b, job_id, pipe)
        if also is not None:
            also(pipe)
        pipe.execute()
    return [s.id for s in samples], job_ids, lost


def reclaim_lost_spools(conn: redis.Redis, cfg: RunConfig) -> list[ReclaimReport]:
    """The janitor's part: every spool silent for the run's grace period, and any revoked spool
    that still owns samples (a reclaim cut short)."""
    leases = SpoolLeases(conn, cfg.run)
    spools = set(leases.silent_since(cfg.spool_grace_s))
    counts = leases.sample_counts()
    spools |= {s for s in leases.revoked(list(counts)) if counts[s] > 0}
    return [reclaim_spool(conn, cfg, s) for s in sorted(spools)]
