"""The ledger reconciled with storage, both ways: the index files are the truth of what is done.

Redis is a fast cache of that truth and can lose it: a wipe, the last second of an AOF, a
failover to a replica that was behind (harvest.ops.recovery notices those and calls this before
work goes on); an index file can also be lost or dropped (a corrupt sample excluded by
`harvest reconcile --verify`). So:

- every sample an index commits is marked done (`mark_done` from any state);
- a sample the ledger has done that no index commits goes back to the queue: its tokens are
  read back from the shard that still holds them (an unindexed shard, or an indexed one that
  excludes it), and its content hash re-derived from them, then it is enqueued as a new job in
  the same transaction as its move d -> q. Where no shard holds its tokens it is forgotten
  (d -> absent), so the producer enqueues it again at its next run.

Order matters against collectors committing meanwhile: the ledger's done-set is read first and
the index files listed after, and a collector writes its index before it marks its samples
done, so a sample done at the scan has its index in the listing: no live commit is mistaken
for a lost one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import redis

from harvest.config import RunConfig
from harvest.formats.index import INDEX, committed_samples, parse_index
from harvest.formats.runfile import read_run_json, run_location
from harvest.formats.shard import SHARDS
from harvest.formats.stformat import FormatError, TensorSpan, header_length, parse_header, tensor_from_bytes
from harvest.ids import job_id_for
from harvest.sample import Sample, SampleError, split_jobs
from harvest.state.jobs import enqueue_samples, run_queue
from harvest.state.ledger import DONE, Ledger
from harvest.state.runstore import publish_run
from harvest.storage import Location, retry

log = logging.getLogger("harvest.reconcile")

CHUNK = 1000  # samples per ledger call / transaction


@dataclass
class ReconcileReport:
    committed: int = 0  # samples the index files commit
    marked_done: int = 0  # of those, moved to done by this call
    requeued: list[str] = field(default_factory=list)  # done without an index: back on the queue
    forgotten: list[str] = field(default_factory=list)  # done without an index, tokens nowhere: absent
    jobs: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"marked {self.marked_done} samples done from storage"
            + (
                f"; {len(self.requeued)} done in the ledger but committed by no index went back to the queue"
                if self.requeued
                else ""
            )
            + (
                f"; {len(self.forgotten)} done in the ledger whose tokens are in no shard were forgotten (run the "
                "producer again to enqueue them)"
                if self.forgotten
                else ""
            )
        )


def restore_run(conn: redis.Redis, run: str, out_url: str) -> RunConfig:
    """The run's configuration from `<out_url>/<run>/run.json`, published to Redis (a no-op if
    Redis still holds it; refused if Redis holds a different one)."""
    loc = run_location(out_url, run)
    cfg = retry(lambda: read_run_json(loc), f"reading {loc.path('run.json')}")
    return publish_run(conn, cfg)


def reconcile(conn: redis.Redis, cfg: RunConfig, keepalive: Callable[[], None] | None = None) -> ReconcileReport:
    """Bring the ledger in line with the index files, both ways (see the module docstring)."""
    loc = run_location(cfg.out_url, cfg.run)
    ledger = Ledger(conn, cfg.run)
    done_before = {k.decode() for k, v in conn.hscan_iter(ledger.keys.state, count=10_000) if v == DONE.encode()}
    rep = ReconcileReport()
    committed: set[str] = set()
    indexed: dict[str, dict] = {}
    for name in retry(lambda: loc.list(INDEX, ".json"), f"listing {loc.path(INDEX)}"):
        raw = retry(partial(loc.read_json, f"{INDEX}/{name}"), f"reading {loc.path(INDEX, name)}")
        doc = parse_index(raw, loc.path(INDEX, name))
        indexed[doc["shard_id"]] = doc
        committed.update(committed_samples(doc))
        if keepalive:
            keepalive()
    rep.committed = len(committed)
    todo = sorted(committed - done_before)
    for i in range(0, len(todo), CHUNK):
        rep.marked_done += len(ledger.mark_done(todo[i : i + CHUNK]))
    lost = done_before - committed
    if lost:
        found = _tokens_of(loc, lost, indexed, keepalive)
        _requeue(conn, cfg, ledger, [found[s] for s in sorted(found)], rep)
        gone = sorted(lost - set(found))
        for i in range(0, len(gone), CHUNK):
            rep.forgotten += ledger.forget_done(gone[i : i + CHUNK])
    if rep.requeued or rep.forgotten:
        log.warning(
            "run %s: %d samples were done in the ledger but committed by no index: %d back on the queue, %d forgotten",
            cfg.run,
            len(lost),
            len(rep.requeued),
            len(rep.forgotten),
        )
    return rep


def _requeue(conn: redis.Redis, cfg: RunConfig, ledger: Ledger, samples: list[Sample], rep: ReconcileReport) -> None:
    queue = run_queue(conn, cfg.run)
    for i in range(0, len(samples), CHUNK):
        batches = split_jobs(samples[i : i + CHUNK], cfg.max_batch_samples, cfg.max_batch_tokens)
        job_ids = [f"{job_id_for(cfg.run, [s.id for s in b])}-r{time.time_ns()}" for b in batches]
        with conn.pipeline(transaction=True) as pipe:
            pipe.multi()
            ledger.requeue_done([s.id for b in batches for s in b], pipe=pipe)
            for b, job_id in zip(batches, job_ids, strict=False):
                enqueue_samples(queue, cfg.run, b, job_id, pipe)
            pipe.execute()
        rep.requeued += [s.id for b in batches for s in b]
        rep.jobs += job_ids


def _tokens_of(
    loc: Location, wanted: set[str], indexed: dict[str, dict], keepalive: Callable[[], None] | None
) -> dict[str, Sample]:
    """The samples of `wanted` whose tokens a stored shard still holds (unindexed, or indexed
    but excluding them), each checked against its id (the hash of its tokens and mask)."""
    found: dict[str, Sample] = {}
    names = retry(lambda: loc.list(SHARDS, ".safetensors"), f"listing {loc.path(SHARDS)}")
    for name in names:
        shard_id = name.removesuffix(".safetensors")
        doc = indexed.get(shard_id)
        if doc is not None and not (set(doc.get("excluded") or {}) & wanted):
            continue
        try:
            samples = retry(
                partial(_read_tokens, loc, f"{SHARDS}/{name}"), f"reading the tokens of {loc.path(SHARDS, name)}"
            )
        except (FormatError, SampleError, ValueError, KeyError) as e:
            log.warning("%s: unreadable (%s); its samples cannot be rebuilt from it", loc.path(SHARDS, name), e)
            continue
        for sid, s in samples.items():
            if sid in wanted and s.id == sid:
                found[sid] = s
        if keepalive:
            keepalive()
    return found


def _header(loc: Location, name: str) -> tuple[dict[str, TensorSpan], dict[str, str]]:
    n = header_length(loc.read_range(name, 0, 8), name)
    return parse_header(loc.read_range(name, 8, 8 + n), name)


def shard_sample_ids(loc: Location, name: str) -> list[str]:
    """The sample ids a stored shard's header lists (two small ranged reads; an unreadable
    header lists none)."""
    try:
        return list(json.loads(_header(loc, name)[1]["sample_ids"]))
    except (FormatError, ValueError, KeyError):
        return []


def _read_tokens(loc: Location, name: str) -> dict[str, Sample]:
    """A shard's samples rebuilt from its `input_ids`, `loss_mask` and `offsets` (a few bytes a
    token: the hidden states are not read), keyed by the id its header lists for each."""
    tensors, meta = _header(loc, name)
    ids = json.loads(meta["sample_ids"])
    cols = {}
    for t in ("input_ids", "loss_mask", "offsets"):
        span = tensors[t]
        cols[t] = tensor_from_bytes(loc.read_range(name, span.begin, span.end), span.dtype, span.shape).numpy()
    off = cols["offsets"]
    out = {}
    for i, sid in enumerate(ids):
        a, b = int(off[i]), int(off[i + 1])
        out[sid] = Sample.build(cols["input_ids"][a:b].astype(np.int64), cols["loss_mask"][a:b])
    return out
