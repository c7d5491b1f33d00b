"""Bounded, idempotent enqueue of sample batches as RQ jobs.

A batch is checked against the ledger first, and only samples the ledger has never seen are
enqueued; the ledger update and the RQ job go in one MULTI/EXEC, so a kill at any moment
leaves either both or neither. The producer waits while the run has `max_queued` samples
queued or in flight, so Redis memory stays bounded whatever the dataset size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.config import RunConfig
from harvest.ids import job_id_for
from harvest.keys import JOB_FUNCTION, Keys
from harvest.ledger import Ledger
from harvest.payload import Sample, encode_batch

JOB_FAILURE_TTL = 7 * 24 * 3600


def job_timeout(num_tokens: int) -> int:
    """Generous: a job is an engine call plus file moves; RQ kills it past this."""
    return 600 + num_tokens // 50


@dataclass
class EnqueueStats:
    enqueued: int = 0
    skipped: int = 0  # already queued, in flight, done or failed
    jobs: int = 0
    tokens: int = 0


class Enqueuer:
    def __init__(
        self,
        conn: redis.Redis,
        cfg: RunConfig,
        max_queued: int = 20000,
        on_wait: Callable[[int], None] | None = None,
    ) -> None:
        self.conn, self.cfg = conn, cfg
        self.keys = Keys(cfg.run)
        self.ledger = Ledger(conn, cfg.run)
        self.queue = Queue(self.keys.queue_name, connection=conn, serializer=JSONSerializer)
        self.max_queued = max_queued
        self.on_wait = on_wait
        self.stats = EnqueueStats()
        self._buf: list[Sample] = []
        self._buf_tokens = 0
        self._seen: set[str] = set()

    def add(self, sample: Sample) -> None:
        if sample.id in self._seen:  # the same content twice in one dataset is one sample
            self.stats.skipped += 1
            return
        self._seen.add(sample.id)
        if self._buf and (
            len(self._buf) >= self.cfg.max_batch_samples or self._buf_tokens + sample.num_tokens > self.cfg.max_batch_tokens
        ):
            self.flush()
        self._buf.append(sample)
        self._buf_tokens += sample.num_tokens

    def flush(self) -> None:
        batch, self._buf, self._buf_tokens = self._buf, [], 0
        if not batch:
            return
        states = self.ledger.states([s.id for s in batch])
        new = [s for s, st in zip(batch, states) if st is None]
        self.stats.skipped += len(batch) - len(new)
        if not new:
            return
        self._wait_for_room(len(new))
        ids = [s.id for s in new]
        tokens = sum(s.num_tokens for s in new)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.multi()
            self.ledger.add_queued(ids, pipe=pipe)
            self.queue.enqueue_call(
                JOB_FUNCTION,
                args=(encode_batch(self.cfg.run, new),),
                job_id=job_id_for(self.cfg.run, ids),
                timeout=job_timeout(tokens),
                result_ttl=0,
                failure_ttl=JOB_FAILURE_TTL,
                pipeline=pipe,
            )
            pipe.execute()
        self.stats.enqueued += len(new)
        self.stats.jobs += 1
        self.stats.tokens += tokens

    def _wait_for_room(self, n: int) -> None:
        while True:
            queued = self.ledger.counts()["queued"]
            if queued + n <= self.max_queued or queued == 0:
                return
            if self.on_wait:
                self.on_wait(queued)
            time.sleep(0.2)
