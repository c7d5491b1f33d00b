"""Bounded, idempotent enqueue of sample batches as RQ jobs.

Samples are buffered and sent in groups. For a group, the ledger is read (one HMGET) and only
samples it has never seen are kept (and those it failed as `job-lost` or `spool-lost`: their
tokens were kept nowhere, and this dataset holds them again, so they move `f -> q`); they are cut into jobs bounded by count and tokens, and
as many jobs as the queue has room for go in one MULTI/EXEC: for each job the ledger's
absent -> `q` move (Lua) and RQ's job hash and queue push. A kill at any moment therefore
leaves either a job and its ledger entries, or neither: nothing lost (a sample marked `q`
always has a job) and nothing doubled (a rerun skips every `q`).

Two producers on one run: each transaction also increments a per-run counter that both WATCH
before they read the ledger, so when two race on the same samples one transaction aborts and
its producer reads the ledger again. Workers and collectors never touch that counter, so their
ledger moves do not abort producers.

The samples' tokens do not go into Redis: before the transaction, the rows of the samples it is
about to enqueue (all those pending, so the next transactions of this group find theirs written)
go to storage as one object (harvest.formats.jobrows), and each job names its rows there. A
transaction that aborts leaves an object no job names: harmless, and written again by the same
bytes under the same name if the same samples are sent.

The producer waits while `queued + next job > max_queued`, so the samples held in Redis (the
queue and in flight) never exceed the bound, whatever the dataset size.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from harvest.config import RunConfig
from harvest.formats import jobrows
from harvest.formats.runfile import run_location
from harvest.ids import job_id_for
from harvest.sample import Sample, split_jobs
from harvest.settings import ProducerSettings
from harvest.state.failures import JOB_LOST, SPOOL_LOST
from harvest.state.jobs import enqueue_samples, run_queue
from harvest.state.keys import Keys
from harvest.state.ledger import QUEUED, Ledger
from harvest.state.payload import payload_row

DEFAULT_MAX_QUEUED = ProducerSettings.max_queued
TOKENS_LOST = (JOB_LOST, SPOOL_LOST)  # failures the producer undoes: it holds the tokens again
GROUP_SAMPLES = 1024  # samples per ledger read and per transaction (at most)
_WAIT_MIN_S, _WAIT_MAX_S = 0.005, 0.25


@dataclass
class EnqueueStats:
    enqueued: int = 0
    skipped: int = 0  # already queued, in flight, spooled, done or failed (or twice in this dataset)
    jobs: int = 0
    tokens: int = 0
    waits: int = 0  # times the producer waited for room in the queue


class Enqueuer:
    def __init__(
        self,
        conn: redis.Redis,
        cfg: RunConfig,
        max_queued: int = DEFAULT_MAX_QUEUED,
        on_wait: Callable[[int], None] | None = None,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {max_queued}")
        self.conn, self.cfg = conn, cfg
        self.keys = Keys(cfg.run)
        self.counter = self.keys.enqueues
        self.ledger = Ledger(conn, cfg.run)
        self.queue = run_queue(conn, cfg.run)
        self.max_queued = max_queued
        self.job_samples = max(1, min(cfg.max_batch_samples, max_queued))  # a job never exceeds the bound alone
        self.group = max(self.job_samples, min(GROUP_SAMPLES, max_queued))
        self.on_wait = on_wait
        self.stats = EnqueueStats()
        self._pending: dict[str, Sample] = {}  # insertion-ordered; a repeat within the group is one sample
        self._revive: set[str] = set()  # failed samples whose tokens were lost: enqueued again (f -> q)
        self._run_loc = run_location(cfg.out_url, cfg.run)
        self._rows: dict[str, jobrows.RowsObject] = {}  # pending sample -> the object its row was written to

    def add(self, sample: Sample) -> None:
        if sample.id in self._pending:
            self.stats.skipped += 1
            return
        self._pending[sample.id] = sample
        if len(self._pending) >= self.group:
            self.flush()

    def flush(self) -> None:
        """Enqueue everything pending (waiting for room as needed)."""
        wait = _WAIT_MIN_S
        while self._pending:
            if self._try_send():
                wait = _WAIT_MIN_S
                continue
            self.stats.waits += 1
            time.sleep(wait)
            wait = min(wait * 2, _WAIT_MAX_S)

    def _jobs(self, samples: list[Sample]) -> list[list[Sample]]:
        return split_jobs(samples, self.job_samples, self.cfg.max_batch_tokens)

    def _try_send(self) -> bool:
        """One transaction's worth. False when the queue is full (the caller waits)."""
        with self.conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.counter)
                ids = list(self._pending)
                states = pipe.hmget(self.keys.state, ids)
                failed = [i for i, st in zip(ids, states, strict=False) if st == b"f"]
                reasons = pipe.hmget(self.keys.failed, failed) if failed else []
                # failed because their tokens were kept nowhere: this dataset has them again
                self._revive |= {
                    i for i, r in zip(failed, reasons, strict=False) if r and json.loads(r).get("reason") in TOKENS_LOST
                }
                known = [i for i, st in zip(ids, states, strict=False) if st is not None and i not in self._revive]
                for i in known:
                    del self._pending[i]
                self.stats.skipped += len(known)
                if not self._pending:
                    return True
                queued = int(pipe.hget(self.keys.counts, QUEUED) or 0)
                room = self.max_queued - queued
                sending: list[list[Sample]] = []
                for job in self._jobs(list(self._pending.values())):
                    if len(job) > room:
                        break
                    sending.append(job)
                    room -= len(job)
                if not sending:
                    if self.on_wait:
                        self.on_wait(queued)
                    return False
                refs = self._refs(sending)
                pipe.multi()
                pipe.incr(self.counter)
                self._move(pipe, [s.id for job in sending for s in job])
                for job, ref in zip(sending, refs, strict=False):
                    enqueue_samples(
                        self.queue, self.cfg.run, job, job_id_for(self.cfg.run, [s.id for s in job]), pipe, rows=ref
                    )
                pipe.execute()
            except redis.WatchError:
                return True  # another producer enqueued meanwhile: read the ledger again
        for job in sending:
            for s in job:
                del self._pending[s.id]
                self._rows.pop(s.id, None)
            self.stats.enqueued += len(job)
            self.stats.jobs += 1
            self.stats.tokens += sum(s.num_tokens for s in job)
        return True

    def _refs(self, jobs: list[list[Sample]]) -> list[dict]:
        """Where each job's rows are in storage: one object of every pending sample is written when
        any of these jobs has a sample not yet written (so a group's later transactions, and a
        transaction read again after a race, reuse it), and a job names one object only."""
        if any(self._rows.get(s.id) is None for job in jobs for s in job):
            written = jobrows.write(
                self._run_loc, ((s.id, payload_row(self.cfg.run, s)) for s in self._pending.values())
            )
            self._rows = dict.fromkeys(self._pending, written)
        return [self._rows[job[0].id].ref([s.id for s in job]) for job in jobs]  # a write maps all pending at once

    def _move(self, pipe: redis.client.Pipeline, ids: list[str]) -> None:
        """The ledger's moves of a transaction's samples, one script call for all its jobs (a
        call's cost is mostly the call: one a job had been the producer's largest part of Redis's
        CPU, bench/fleet.py --by-script)."""
        self.ledger.add_queued(ids, pipe=pipe)
        if revive := [i for i in ids if i in self._revive]:
            self.ledger.requeue(revive, pipe=pipe)
