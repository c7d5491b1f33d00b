"""The dump directory contract between an engine and the workers (DESIGN 4.3).

For every prefill chunk of a request whose rid starts with `hv-`, the engine writes
`<dump_dir>/<rid>.<start>-<end>.safetensors` holding `hidden_states` `[end-start, K, H]`
(engine dtype) and `input_ids` `[end-start]`, with the capture points and model name in
the metadata. Both the reference engine and the SGLang plugin cut their flat forward batch
into these files with `cut_batch` + `write_chunk`, so the CPU tests run the production code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open

from harvest.ids import RID_PREFIX, parse_rid
from harvest.paths import check_regular_file
from harvest.stformat import encode

FORMAT = "harvest-dump-1"
_NAME = re.compile(r"(hv-[0-9a-f]{32}-[0-9]+)\.([0-9]+)-([0-9]+)\.safetensors")


class DumpError(ValueError):
    """A dump file that does not follow the contract."""


def chunk_name(rid: str, start: int, end: int) -> str:
    parse_rid(rid)
    return f"{rid}.{start}-{end}.safetensors"


def parse_chunk_name(name: str) -> tuple[str, int, int] | None:
    """(rid, start, end) of a chunk file name, or None for anything else in the directory."""
    m = _NAME.fullmatch(name)
    if not m:
        return None
    return m.group(1), int(m.group(2)), int(m.group(3))


@dataclass
class Chunk:
    """Rows of one request in one forward: prompt positions [start, end)."""

    rid: str
    start: int
    end: int
    input_ids: torch.Tensor  # [end-start]
    hidden_states: torch.Tensor  # [end-start, K, H]


def cut_batch(
    rids: Sequence[str],
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
) -> list[Chunk]:
    """Slice a flat extend batch (requests' new tokens laid end to end, as SGLang lays them)
    into per-request chunks; requests without the `hv-` prefix (warmup, health checks,
    foreign traffic) are skipped. The chunk's positions come from the prefix length, so
    chunked prefill yields consecutive chunks of one prompt."""
    if not (len(rids) == len(prefix_lens) == len(seq_lens)):
        raise DumpError(f"batch layout mismatch: {len(rids)} rids, {len(prefix_lens)} prefix lens, {len(seq_lens)} seq lens")
    total = int(sum(seq_lens))
    if input_ids.shape[0] != total or hidden_states.shape[0] != total:
        raise DumpError(
            f"batch has {total} extend tokens but input_ids {tuple(input_ids.shape)} and hidden_states {tuple(hidden_states.shape)}"
        )
    chunks, loc = [], 0
    for rid, pre, n in zip(rids, prefix_lens, seq_lens):
        pre, n = int(pre), int(n)
        if isinstance(rid, str) and rid.startswith(RID_PREFIX) and n > 0:
            try:
                parse_rid(rid)
            except ValueError:
                rid = None
            if rid is not None:
                chunks.append(Chunk(rid, pre, pre + n, input_ids[loc : loc + n], hidden_states[loc : loc + n]))
        loc += n
    return chunks


def encode_chunk(chunk: Chunk, capture_points: Sequence[int], model: str) -> bytes:
    meta = {
        "format": FORMAT,
        "rid": chunk.rid,
        "start": str(chunk.start),
        "end": str(chunk.end),
        "capture_points": json.dumps(list(capture_points)),
        "model": model,
    }
    tensors = {
        "hidden_states": chunk.hidden_states.detach().to("cpu").contiguous(),
        "input_ids": chunk.input_ids.detach().to("cpu", torch.int64).contiguous(),
    }
    return encode(tensors, meta)


def write_chunk(dump_dir: str, chunk: Chunk, capture_points: Sequence[int], model: str) -> str:
    """Write one chunk file atomically (temporary dot-name, then rename), so a worker that
    lists the directory sees either nothing or the whole file."""
    name = chunk_name(chunk.rid, chunk.start, chunk.end)
    path = os.path.join(dump_dir, name)
    tmp = os.path.join(dump_dir, f".tmp-{name}.{os.getpid()}")
    data = encode_chunk(chunk, capture_points, model)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a full disk must not also keep the partial file
        raise
    return path


@dataclass
class ChunkFile:
    rid: str
    start: int
    end: int
    capture_points: list[int]
    model: str
    input_ids: torch.Tensor
    hidden_states: torch.Tensor


def read_chunk(path: str) -> ChunkFile:
    """Read and check one chunk file against its own name; any mismatch is a DumpError."""
    parsed = parse_chunk_name(os.path.basename(path).removesuffix(".claimed"))
    try:
        check_regular_file(path)
    except OSError as e:
        raise DumpError(f"{path}: {e}") from None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != {"hidden_states", "input_ids"}:
                raise DumpError(f"{path}: tensors {sorted(names)}, expected hidden_states and input_ids")
            hs = f.get_tensor("hidden_states")
            ids = f.get_tensor("input_ids")
    except DumpError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise DumpError(f"{path}: unreadable dump file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise DumpError(f"{path}: format {meta.get('format')!r}, expected {FORMAT}")
    try:
        rid, start, end = meta["rid"], int(meta["start"]), int(meta["end"])
        cps = [int(x) for x in json.loads(meta["capture_points"])]
    except (KeyError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: bad metadata ({e})") from None
    if parsed is not None and parsed != (rid, start, end):
        raise DumpError(f"{path}: file name says {parsed}, metadata says {(rid, start, end)}")
    n = end - start
    if hs.ndim != 3 or hs.shape[0] != n or ids.shape != (n,):
        raise DumpError(f"{path}: shapes hidden_states {tuple(hs.shape)} input_ids {tuple(ids.shape)} for {n} positions")
    if hs.shape[1] != len(cps):
        raise DumpError(f"{path}: {hs.shape[1]} capture slots for capture points {cps}")
    return ChunkFile(rid, start, end, cps, meta.get("model", ""), ids, hs)


class DumpWriter:
    """Writes chunks off the forward loop: device-to-host copies are started at submit time
    (into pinned memory, on the current stream, so later kernels cannot overwrite the rows
    first) and a background thread waits for them and writes the files. The queue is
    bounded: when the disk falls behind, `submit` blocks and the forward waits rather than
    dropping a chunk."""

    FULL_POLL_S = 0.2

    def __init__(self, dump_dir: str, capture_points: Sequence[int], model: str, max_pending: int = 64,
                 full_wait_s: float = 600.0) -> None:
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
        staged = [Chunk(c.rid, c.start, c.end, self._to_host(c.input_ids), self._to_host(c.hidden_states)) for c in chunks]
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

    def _write(self, c: Chunk, log) -> None:
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
