"""The engine side's dump writer: chunk files written off the forward loop, never dropped.

Runs inside the engine process (the SGLang plugin's TP rank 0, the reference engine); the file
format is `harvest.formats.dump`.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from harvest.formats.dump import Chunk, write_chunk

if TYPE_CHECKING:
    import logging


class DumpWriter:
    """Writes chunks off the forward loop: device-to-host copies are started at submit time
    (into pinned memory, on the current stream, so later kernels cannot overwrite the rows
    first) and a background thread waits for them and writes the files. The queue is
    bounded: when the disk falls behind, `submit` blocks and the forward waits rather than
    dropping a chunk."""

    FULL_POLL_S = 0.2

    def __init__(
        self,
        dump_dir: str,
        capture_points: Sequence[int],
        model: str,
        max_pending: int = 64,
        full_wait_s: float = 600.0,
    ) -> None:
        import queue
        import threading

        self.dump_dir, self.capture_points, self.model = dump_dir, list(capture_points), model
        self.errors = 0
        self.full_waits = 0
        self.full_wait_s = full_wait_s
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="harvest-dump-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def _to_host(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t.clone()  # the engine may reuse its batch buffers after this forward
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    def submit(self, chunks: Sequence[Chunk]) -> None:
        if not chunks:
            return
        staged = [
            Chunk(c.rid, c.start, c.end, self._to_host(c.input_ids), self._to_host(c.hidden_states)) for c in chunks
        ]
        event = None
        if any(c.hidden_states.device.type == "cuda" for c in chunks):
            event = torch.cuda.Event()
            event.record()
        self._q.put((event, staged))

    def _run(self) -> None:
        import logging

        log = logging.getLogger("harvest.dump")
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                event, staged = item
                if event is not None:
                    event.synchronize()
                for c in staged:
                    self._write(c, log)
            finally:
                self._q.task_done()

    def _write(self, c: Chunk, log: logging.Logger) -> None:
        """Write one chunk; while the dump dir is full, wait for workers to claim files (the
        bounded queue then blocks `submit`, so the engine's forward pauses instead of losing
        chunks), up to `full_wait_s`."""
        waited = 0.0
        while True:
            try:
                write_chunk(self.dump_dir, c, self.capture_points, self.model)
                if waited:
                    log.warning("harvest: dump dir %s has room again after %.0fs", self.dump_dir, waited)
                return
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT) and waited < self.full_wait_s:
                    if not waited:
                        log.warning("harvest: dump dir %s is full: pausing until workers claim files", self.dump_dir)
                    self.full_waits += 1
                    time.sleep(self.FULL_POLL_S)
                    waited += self.FULL_POLL_S
                    continue
                self.errors += 1
                log.exception("harvest: could not write dump chunk %s [%d, %d)", c.rid, c.start, c.end)
                return

    def flush(self) -> None:
        """Block until every submitted chunk is on disk (or failed)."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
