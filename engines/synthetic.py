"""A zero-cost engine: SGLang's `/generate` subset answered at once, with synthetic dump chunks.

Why. The control plane (Redis, RQ, the ledger, heartbeats, the janitor, the collector's commit
steps) is what limits a large fleet, and measuring it needs far more nodes than one machine
can run real engines for. This engine computes nothing: for every `hv-` request it writes the
dump chunks of a `[T, K, H]` hidden state at once (T the prompt's length, K the capture
points, H a hidden size chosen tiny by the caller), with the request's own token ids and
finite values (zeros), in the dump format of `harvest.formats.dump`. A worker's claim and
verification run unchanged on them (coverage, token ids, capture points, finiteness), so a
fleet of real `harvest worker` and `harvest collect` processes runs against it as against
SGLang, and only the control plane costs anything. It is for benchmarks (bench/fleet.py) and
never serves a model.

Who owns what. One process may serve several simulated nodes: one HTTP port and one dump
directory per node (`--serve PORT=DIR`, repeated), each port writing only into its own
directory, so a node's workers claim only their node's files as on a real node. The chunk
files are written whole (a temporary name, then a rename: `write_chunk`) before the response
is sent, so a worker finds every chunk of its rids at its first look; what a worker does not
claim is the janitor's, as with any engine. The HTTP side (routes, the per-call faults of
`harvest.engines.faults`: `http500`, `hang`) is the reference engine's own handler.

    python -m harvest.engines.synthetic --serve 31000=/dev/shm/n0 --serve 31001=/dev/shm/n1 \
        --capture 2,4,5,8 --hidden 8 [--chunked-prefill-size 512] [--model-name synthetic]
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Sequence

import torch

from harvest.engines import faults as fx
from harvest.engines.generation import max_new_tokens
from harvest.engines.reference import BadRequest, ReferenceEngine, serve
from harvest.formats.dump import Chunk, write_chunk
from harvest.ids import RID_PREFIX
from harvest.node.paths import private_dir
from harvest.settings import EngineSettings

log = logging.getLogger("harvest.engine")

VOCAB = 1 << 31  # any non-negative int32 token id is accepted: the engine reads no embedding


class SyntheticEngine:
    """The reference engine's interface (`parse`, `parse_sampling`, `generate`, `info`, `server_info`, `faults`)
    with no model: every request is answered as soon as its chunk files are on disk."""

    def __init__(
        self,
        dump_dir: str,
        capture_points: Sequence[int],
        hidden_size: int,
        model_name: str = "synthetic",
        chunked_prefill_size: int = EngineSettings.chunked_prefill_size,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if hidden_size < 1 or not capture_points:
            raise ValueError("a synthetic engine needs a hidden size >= 1 and at least one capture point")
        self.dump_dir = private_dir(dump_dir, "dump dir")
        self.capture_points = list(capture_points)
        self.hidden_size = hidden_size
        self.model_name = model_name
        self.chunk = int(chunked_prefill_size or 0)
        self.dtype = dtype
        self.vocab_size = VOCAB
        self.faults = fx.Faults.from_env()  # per-call faults only (the handler's): no dump faults here
        self.requests = 0
        self.prefill_tokens = 0
        self.busy_seconds = 0.0
        self._zeros = torch.zeros(0, len(self.capture_points), hidden_size, dtype=dtype)
        self._lock = threading.Lock()  # counters and the shared zero buffer; files are written outside it

    def info(self) -> dict:
        return {
            "model_path": self.model_name,
            "model_name": self.model_name,
            "num_layers": max(self.capture_points),
            "hidden_size": self.hidden_size,
            "capture_points": self.capture_points,
            "chunked_prefill_size": self.chunk,
            "engine": "harvest-synthetic",
        }

    def server_info(self) -> dict:
        return {
            **self.info(),
            "busy_seconds": self.busy_seconds,
            "prefill_tokens": self.prefill_tokens,
            "requests": self.requests,
            "threads": 1,
        }

    def parse(self, body: object) -> tuple[list[str], list[list[int]], bool]:
        """The reference engine's request rules (they read only `vocab_size`), and no generation."""
        rids, prompts, batched = ReferenceEngine.parse(self, body)
        self.parse_sampling(body, rids, prompts)
        return rids, prompts, batched

    def parse_sampling(self, body: dict, rids: list[str], prompts: list[list[int]]) -> None:
        """This engine extracts only: a request for more than one new token is refused (HTTP 400)."""
        sp = body.get("sampling_params") or {}
        try:
            longest = max(max_new_tokens(x) for x in (sp if isinstance(sp, list) else [sp]))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if longest > 1:
            raise BadRequest("this engine generates at most 1 new token (sampling_params.max_new_tokens <= 1)")
        return None

    def _rows(self, n: int) -> torch.Tensor:
        """`n` finite rows [n, K, H], from one zero buffer grown as needed (never written to)."""
        with self._lock:
            if self._zeros.shape[0] < n:
                self._zeros = torch.zeros(
                    max(n, 2 * self._zeros.shape[0]), len(self.capture_points), self.hidden_size, dtype=self.dtype
                )
            return self._zeros[:n]

    def generate(self, rids: list[str], prompts: list[list[int]], sampling: None = None) -> list[dict]:
        t0 = time.perf_counter()
        out = []
        for rid, ids in zip(rids, prompts, strict=False):
            if rid.startswith(RID_PREFIX):
                step = self.chunk or len(ids)
                for start in range(0, len(ids), step):
                    end = min(len(ids), start + step)
                    chunk = Chunk(
                        rid, start, end, torch.tensor(ids[start:end], dtype=torch.int64), self._rows(end - start)
                    )
                    write_chunk(self.dump_dir, chunk, self.capture_points, self.model_name)
            out.append(
                {
                    "text": "",
                    "output_ids": [0],
                    "meta_info": {
                        "id": rid,
                        "prompt_tokens": len(ids),
                        "completion_tokens": 1,
                        "cached_tokens": 0,
                        "finish_reason": {"type": "length", "length": 1},
                    },
                }
            )
        with self._lock:
            self.requests += len(rids)
            self.prefill_tokens += sum(len(p) for p in prompts)
            self.busy_seconds += time.perf_counter() - t0
        return out


def _parse_serve(spec: str) -> tuple[int, str]:
    port, sep, path = spec.partition("=")
    if not sep or not port.isdigit() or not path:
        raise argparse.ArgumentTypeError(f"--serve {spec!r}: expected PORT=DUMP_DIR")
    return int(port), path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harvest.engines.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--serve",
        action="append",
        type=_parse_serve,
        required=True,
        metavar="PORT=DUMP_DIR",
        help="one simulated node: its port and its dump dir (repeat for more nodes)",
    )
    ap.add_argument("--capture", default="2,4,5,8", help="capture points, as the run's (comma-separated)")
    ap.add_argument("--hidden", type=int, default=8, help="hidden size, as the run's")
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=EngineSettings.chunked_prefill_size,
        help="rows per dump chunk (0: one chunk a request)",
    )
    ap.add_argument("--model-name", default="synthetic")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    points = [int(p) for p in args.capture.split(",")]
    servers = []
    for port, dump_dir in args.serve:
        engine = SyntheticEngine(dump_dir, points, args.hidden, args.model_name, args.chunked_prefill_size)
        server = serve(engine, args.host, port)
        threading.Thread(target=server.serve_forever, name=f"synthetic-{port}", daemon=True).start()
        servers.append(server)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        f"synthetic engine: {len(servers)} node(s) on ports {[p for p, _ in args.serve]}, capture {points}, "
        f"hidden {args.hidden}",
        flush=True,
    )
    stop.wait()
    for s in servers:
        s.shutdown()
        s.server_close()


if __name__ == "__main__":
    main()
