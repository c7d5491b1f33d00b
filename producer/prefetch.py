"""Run a generator a few items ahead in a thread.

The producer's two heavy steps both release the GIL: the Rust tokenizer's `encode_batch` and
the zlib compression plus socket writes of an RQ enqueue. Tokenizing the next batch in a
thread while the current one is enqueued overlaps them, measured by bench/enqueue.py.
Order is kept; an exception in the generator is raised in the consumer at that point.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def prefetch(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Items of `items`, produced by a daemon thread at most `depth` ahead of the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((_END, e))

    th = threading.Thread(target=run, name="harvest-prefetch", daemon=True)
    th.start()
    try:
        while True:
            item, err = q.get()
            if item is _END:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()  # a consumer that stops early (--strict, an error) lets the thread end
