"""Tokenization in worker processes, for machines where it pays.

Chat-template rendering and per-sample work are Python and hold the GIL; the Rust tokenizer
already spreads one `encode_batch` over all cores. So extra processes pay only with cores to
spare beyond what the tokenizer's threads fill (measure with bench/enqueue.py --processes N;
on a 2-core machine they do not). Batches are submitted through a bounded window, so the
reader never runs more than a few batches ahead of the enqueue (memory stays flat), and
results come back in dataset order.

A row is judged as in one process (harvest.producer.rows): each worker runs the same RowTokenizer. A
batch the pool cannot take or give back (a row nested too deep to pickle, say) is tokenized in
this process instead, by the same rules, so such a row is the same bad row as without
--processes; an exception of harvest's own code is then raised here, with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from harvest.producer.rows import BadRow, Row
from harvest.producer.tokenize import RowTokenizer
from harvest.sample import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_worker: RowTokenizer | None = None


def _init(tokenizer: PreTrainedTokenizerBase, kwargs: dict) -> None:
    global _worker
    _worker = RowTokenizer(tokenizer, **kwargs)


def _work(batch: list[Row | BadRow]) -> tuple[list[Sample | BadRow], int]:
    before = _worker.truncated
    out = _worker(batch)
    return out, _worker.truncated - before


class ProcessTokenizer:
    """Like RowTokenizer over a stream of batches, but in `processes` worker processes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, processes: int, **kwargs: Any) -> None:
        # Built here first: a bad template or tokenizer fails in the parent; and it tokenizes any
        # batch the pool could not.
        self.local = RowTokenizer(tokenizer, **kwargs)
        ctx = mp.get_context("spawn")  # no fork of a process holding Redis connections and threads
        self.pool = ctx.Pool(processes, initializer=_init, initargs=(tokenizer, kwargs))
        self.window = 2 * processes
        self.truncated = 0

    def map(self, batches: Iterable[list[Row | BadRow]]) -> Iterator[tuple[list, list[Sample | BadRow]]]:
        pending: deque = deque()
        it = iter(batches)
        try:
            while True:
                while len(pending) < self.window:
                    batch = next(it, None)
                    if batch is None:
                        break
                    pending.append((batch, self.pool.apply_async(_work, (batch,))))
                if not pending:
                    return
                batch, res = pending.popleft()
                try:
                    out, truncated = res.get()
                except Exception:  # noqa: BLE001 - pickling the batch, or a worker's failure: redone here
                    before = self.local.truncated
                    out = self.local(batch)
                    truncated = self.local.truncated - before
                self.truncated += truncated
                yield batch, out
        finally:
            self.pool.terminate()
            self.pool.join()
