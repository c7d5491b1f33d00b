"""Bounded read-ahead: the next samples' byte ranges fetched on a thread while the trainer works on
the current ones.

A trainer step and a ranged read of object storage each take milliseconds to seconds; one after
the other, the accelerator waits for every read. `ReadAhead` runs the fetches of a known sequence
of keys (a reader's planned samples, in order) on one thread, ahead of the consumer, and holds
what it fetched in a queue capped in bytes: the fetcher stops while the queue holds `cap_bytes`
or more, so memory stays under the cap plus the one sample being fetched, however slow the
consumer. Results come out in the keys' order. A fetch that raises (a corrupt sample, an
unreadable shard) is handed to the consumer in its place, as the exception, so the consumer
decides exactly as it would have reading in line. One thread: the readers it calls
(harvest.read.shard_reader) are used by that thread alone, never concurrently.

The training feed's keys are windows of its order, not single samples: each window's fetch reads
its samples with one ranged read per run of them adjacent in a shard (harvest.read.coalesce) and
returns them all, so the cap counts whole windows, and memory stays under the cap plus the window
being fetched (and the one being handed out).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
T = TypeVar("T")


class ReadAhead(Generic[K, T]):
    """`fetch(key)` for each of `keys`, in order, up to `cap_bytes` (by `size(value)`) ahead of the
    consumer; `cap_bytes` 0 fetches in line (no thread). Iterating yields `(key, value)`, where
    value is the exception the fetch raised if it did. `close()` (or leaving the loop) stops it."""

    def __init__(self, keys: Iterable[K], fetch: Callable[[K], T], size: Callable[[T], int], cap_bytes: int) -> None:
        self._keys, self._fetch, self._size, self.cap = keys, fetch, size, cap_bytes
        self._queue: deque[tuple[K, T | Exception, int]] = deque()
        self._queued = 0  # bytes in the queue
        self.peak = 0  # the most bytes the queue held at once (for tests and benchmarks)
        self.waits = 0  # times the consumer found the queue empty and waited for a fetch
        self._done = False
        self._stop = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def _get(self, key: K) -> tuple[T | Exception, int]:
        try:
            value = self._fetch(key)
        except Exception as e:  # noqa: BLE001 - handed to the consumer as the result, to decide there
            return e, 0
        return value, self._size(value)

    def _run(self) -> None:
        try:
            for key in self._keys:
                with self._cond:
                    while self._queued >= self.cap and self._queue and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                value, n = self._get(key)
                with self._cond:
                    self._queue.append((key, value, n))
                    self._queued += n
                    self.peak = max(self.peak, self._queued)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def __iter__(self) -> Iterator[tuple[K, T | Exception]]:
        if self.cap <= 0:
            for key in self._keys:
                yield key, self._get(key)[0]
            return
        self._thread = threading.Thread(target=self._run, name="harvest-readahead", daemon=True)
        self._thread.start()
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._done:
                        self.waits += 1
                    while not self._queue and not self._done:
                        self._cond.wait()
                    if not self._queue:
                        return
                    key, value, n = self._queue.popleft()
                    self._queued -= n
                    self._cond.notify_all()
                yield key, value
        finally:
            self.close()

    def close(self) -> None:
        """Stop fetching and drop what was fetched; waits for the thread's fetch in progress."""
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._queued = 0
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
