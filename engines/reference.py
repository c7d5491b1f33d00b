"""The CPU reference engine: SGLang's native `/generate` subset over a real transformers model.

It exists so the whole pipeline runs without a GPU: same request and response shape as
SGLang, same dump contract, written by the same `harvest.formats.dump` code the SGLang plugin uses.
With `chunked_prefill_size` it schedules like SGLang's chunked prefill: each forward step
takes up to that many prompt tokens across the waiting requests, continuing each request
from its KV cache, and dumps one chunk per request per step.

It also generates, as SGLang does, for regeneration (harvest's `hg-` rids) and any request with
`max_new_tokens > 1`: the prefill above (dumps for `hv-` rids only), then a KV-cached
decode loop, greedy below temperature 1e-6, else temperature, top-p and `torch.multinomial` with
a `torch.Generator` seeded by `sampling_seed`, until a stop token (stop_token_ids or the model's
EOS, unless `ignore_eos`; kept in `output_ids`, cut from `text`, as SGLang does) or
max_new_tokens (the request rules: engines/generation.py). A request with `max_new_tokens <= 1`
and no `hg-` rid is an extraction request: the prefill and one greedy token.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from harvest.config import parse_layers
from harvest.engines import faults as fx
from harvest.engines.batch import cut_batch
from harvest.engines.dump_writer import DumpWriter
from harvest.engines.generation import Sampling, eos_ids, parse_sampling, sample
from harvest.formats.dump import Chunk
from harvest.formats.fingerprint import model_fingerprint
from harvest.ids import RID_PREFIX
from harvest.node.paths import private_dir
from harvest.settings import EngineSettings, IdentityDefaults

log = logging.getLogger("harvest.engine")


class BadRequest(ValueError):
    """A request this engine answers with HTTP 400 (never raised past its handler: outside
    harvest.errors' root on purpose)."""


@dataclass
class _Request:
    rid: str
    ids: list[int]
    done: int = 0
    cache: object = None
    last_logits: torch.Tensor | None = None
    chunks: list = field(default_factory=list)


class ReferenceEngine:
    def __init__(
        self,
        model_dir: str,
        dump_dir: str,
        layers: str = IdentityDefaults.layers,
        chunked_prefill_size: int = EngineSettings.chunked_prefill_size,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = model_dir
        self.fingerprint = model_fingerprint(model_dir)  # reported: workers check it against the run's
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tokenizer = None
        self.num_layers = self.model.config.num_hidden_layers
        self.capture_points = parse_layers(layers, self.num_layers)
        self.vocab_size = self.model.config.vocab_size
        self.dump_dir = dump_dir
        private_dir(dump_dir, "dump dir")
        self.chunk = int(chunked_prefill_size or 0)
        self.model_name = os.path.basename(os.path.abspath(model_dir))
        self._lock = threading.Lock()
        # Seconds spent inside the forward lock and prompt tokens prefilled: /get_server_info
        # reports them so a benchmark can tell an idle engine from a slow one.
        self.busy_seconds = 0.0
        self.prefill_tokens = 0
        self.requests = 0
        self.generated_tokens = 0  # decode: tokens generated beyond the extraction requests' one
        self.writer = DumpWriter(dump_dir, self.capture_points, self.model_name)
        self.faults = fx.Faults.from_env()
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def info(self) -> dict:
        return {
            "model_path": self.model_dir,
            "model_name": self.model_name,
            "model_fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "hidden_size": self.model.config.hidden_size,
            "capture_points": self.capture_points,
            "chunked_prefill_size": self.chunk,
            "engine": "harvest-reference",
        }

    def server_info(self) -> dict:
        return {
            **self.info(),
            "busy_seconds": self.busy_seconds,
            "prefill_tokens": self.prefill_tokens,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "threads": torch.get_num_threads(),
        }

    def _forward(self, req: _Request, n: int, wrong_layer: bool = False) -> torch.Tensor:
        from transformers.cache_utils import DynamicCache

        if req.cache is None:
            req.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([req.ids[req.done : req.done + n]], dtype=torch.long)
        out = self.model(ids, use_cache=True, output_hidden_states=True, **{self._cache_kw: req.cache})
        req.last_logits = out.logits[0, -1]
        points = list(self.capture_points)
        if wrong_layer:  # test-only fault: the first capture point read from the next layer
            points[0] = min(points[0] + 1, self.num_layers)
            if req.done == 0:
                log.warning(
                    "injected fault %s: %s capture point %d taken from layer %d",
                    fx.WRONG_LAYER,
                    req.rid,
                    self.capture_points[0],
                    points[0],
                )
        return torch.stack([out.hidden_states[p][0] for p in points], dim=1)  # [n, K, H]

    @torch.inference_mode()
    def generate(self, rids: list[str], prompts: list[list[int]], sampling: list[Sampling] | None = None) -> list[dict]:
        """Prefill (and dump the `hv-` rids); then one greedy token each, or with `sampling`
        (from `parse_sampling`) a generation for each request."""
        reqs = [_Request(r, p) for r, p in zip(rids, prompts, strict=False)]
        hit: dict[str, set[str]] = {}
        if self.faults:
            hv = [r.rid for r in reqs if r.rid.startswith(RID_PREFIX)]
            hit = {k: set() for k in fx.DUMP_KINDS}
            lengths = {r.rid: len(r.ids) for r in reqs}

            def applies(kind: str, rid: str) -> bool:  # not spent on a request the fault cannot hit
                if kind == fx.SHIFT_CHUNK:
                    return 0 < self.chunk < lengths[rid]
                return kind != fx.PERTURB or len(reqs) > 1

            for rid in hv:  # at most one dump fault a request, so each kind shows up on its own
                kind = next((k for k in fx.DUMP_KINDS if applies(k, rid) and self.faults.take(k)), None)
                if kind:
                    hit[kind].add(rid)
        with self._lock:
            t0 = time.perf_counter()
            while any(r.done < len(r.ids) for r in reqs):
                budget = self.chunk or sum(len(r.ids) for r in reqs)
                step_rids, prefix, lens, ids, hs = [], [], [], [], []
                for r in reqs:
                    left = len(r.ids) - r.done
                    if left == 0 or budget == 0:
                        continue
                    n = min(left, budget)
                    budget -= n
                    step_rids.append(r.rid)
                    prefix.append(r.done)
                    lens.append(n)
                    ids.append(torch.tensor(r.ids[r.done : r.done + n]))
                    hs.append(self._forward(r, n, r.rid in hit.get(fx.WRONG_LAYER, ())))
                    r.done += n
                chunks = cut_batch(step_rids, prefix, lens, torch.cat(ids), torch.cat(hs))
                self.writer.submit(self._inject(chunks, hit, {r.rid: len(r.ids) for r in reqs}) if hit else chunks)
            self.busy_seconds += time.perf_counter() - t0
            self.prefill_tokens += sum(len(r.ids) for r in reqs)
            self.requests += len(reqs)
        if sampling is not None:
            return [self._decode(r, sp) for r, sp in zip(reqs, sampling, strict=False)]
        out = []
        for r in reqs:
            tok = int(torch.argmax(r.last_logits))
            text = self.tokenizer.decode([tok]) if self.tokenizer is not None else ""
            out.append(
                {
                    "text": text,
                    "output_ids": [tok],
                    "meta_info": {
                        "id": r.rid,
                        "prompt_tokens": len(r.ids),
                        "completion_tokens": 1,
                        "cached_tokens": len(r.ids) // 2 if r.rid in hit.get(fx.CACHED, ()) else 0,
                        "finish_reason": {"type": "length", "length": 1},
                    },
                }
            )
        return out

    def _decode(self, r: _Request, sp: Sampling) -> dict:
        """Generate from a prefilled request: sample from its last logits, stop or feed the token
        back through the model on the request's own KV cache, repeat.

        The forward lock is taken per decode step, not per request: each request owns its cache,
        so steps of concurrent requests interleave safely (the model is the only shared state,
        and one forward at a time uses it), and an extraction request or another generation waits
        one step, not a whole answer. The tokens cannot depend on the interleaving: each step is
        a batch of one, computed the same way whatever ran before it."""
        seed = sp.seed if sp.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen = torch.Generator().manual_seed(seed)
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos_ids(self.model, self.tokenizer))
        ids: list[int] = []
        logits = r.last_logits
        while True:
            with self._lock:  # sampling too: one thread at a time in torch (many short-lived handler threads
                tok = sample(logits, sp, gen)  # running torch ops at once is what its OpenMP pool copes with least)
            ids.append(tok)
            if tok in stop:  # a stop token wins over the length cap on the same step, as in SGLang
                reason = {"type": "stop", "matched": tok}
                break
            if len(ids) >= sp.max_new_tokens:
                reason = {"type": "length", "length": sp.max_new_tokens}
                break
            with self._lock:
                t0 = time.perf_counter()
                step = torch.tensor([[tok]], dtype=torch.long)
                out = self.model(step, use_cache=True, **{self._cache_kw: r.cache})
                logits = out.logits[0, -1]
                self.busy_seconds += time.perf_counter() - t0
        with self._lock:
            self.generated_tokens += len(ids)
        shown = ids[:-1] if reason["type"] == "stop" and not sp.no_stop_trim else ids
        text = (
            "" if self.tokenizer is None else self.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens)
        )
        r.cache = None  # free the KV cache now, not when the response is sent
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": r.rid,
                "prompt_tokens": len(r.ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "finish_reason": reason,
            },
        }

    def _inject(self, chunks: list[Chunk], hit: dict[str, set[str]], lengths: dict[str, int]) -> list[Chunk]:
        """Test-only faults (engines/faults.py) applied to the chunks about to be written."""
        out = []
        for c in chunks:
            if c.rid in hit[fx.DROP_CHUNK] and c.start == 0:
                continue
            if c.rid in hit[fx.BAD_IDS]:
                ids = c.input_ids.clone()
                ids[0] = (ids[0] + 1) % self.vocab_size
                c = replace(c, input_ids=ids)
            if c.rid in hit[fx.NAN]:
                hs = c.hidden_states.clone()
                hs[0, 0, 0] = float("nan")
                c = replace(c, hidden_states=hs)
            if c.rid in hit[fx.SHIFT_CHUNK] and c.start > 0:
                hit[fx.SHIFT_CHUNK].discard(c.rid)  # one chunk of the request: its second
                c = replace(c, hidden_states=torch.cat([c.hidden_states[:1], c.hidden_states[:-1]]))
                log.warning(
                    "injected fault %s: %s rows [%d, %d) hold the states of the position before them",
                    fx.SHIFT_CHUNK,
                    c.rid,
                    c.start + 1,
                    c.end,
                )
            if c.rid in hit[fx.PERTURB] and c.end > lengths[c.rid] // 2:
                first = max(0, lengths[c.rid] // 2 - c.start)
                log.warning(
                    "injected fault %s: %s rows [%d, %d) perturbed by %g of their RMS",
                    fx.PERTURB,
                    c.rid,
                    c.start + first,
                    c.end,
                    fx.PERTURB_SCALE,
                )
                hs = c.hidden_states.clone()
                rows = hs[first:]
                g = torch.Generator().manual_seed(c.start)
                noise = torch.randn(rows.shape, generator=g, dtype=torch.float32)
                rms = rows.float().pow(2).mean(-1, keepdim=True).sqrt()
                rows += (fx.PERTURB_SCALE * rms * noise).to(hs.dtype)
                c = replace(c, hidden_states=hs)
            out.append(c)
        return out

    def parse(self, body: object) -> tuple[list[str], list[list[int]], bool]:
        """Validate a /generate body; returns (rids, prompts, batched)."""
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("this engine takes token ids: 'input_ids' is required ('text' is not supported)")
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for i, p in enumerate(prompts):
            if not isinstance(p, list) or not p or not all(isinstance(t, int) for t in p):
                raise BadRequest(f"input_ids[{i}] must be a non-empty list of integers")
            bad = [t for t in p if t < 0 or t >= self.vocab_size]
            if bad:
                raise BadRequest(
                    f"input_ids[{i}] holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
                )
        rid = body.get("rid")
        if rid is None:
            rids = [f"req-{os.urandom(8).hex()}" for _ in prompts]
        else:
            rids = rid if isinstance(rid, list) else [rid]
        if len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
            raise BadRequest(f"'rid' must be one string per prompt ({len(prompts)} prompts)")
        sp = body.get("sampling_params") or {}
        if not all(isinstance(x, dict) for x in (sp if isinstance(sp, list) else [sp])):
            raise BadRequest("'sampling_params' must be an object (or one per prompt)")
        return rids, prompts, batched

    def parse_sampling(self, body: dict, rids: list[str], prompts: list[list[int]]) -> list[Sampling] | None:
        """Each request's `Sampling` when the body asks for generation (an `hg-` rid, or
        max_new_tokens > 1), else None (extraction). Called after `parse`; raises BadRequest where
        SGLang answers 400 (engines/generation.py)."""
        context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        try:
            return parse_sampling(body, rids, prompts, self.vocab_size, context)
        except ValueError as e:
            raise BadRequest(str(e)) from None


def _handler(engine: ReferenceEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: object) -> None:  # route through logging, quietly
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, obj: object) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (
                BrokenPipeError,
                ConnectionResetError,
            ):  # the client timed out and left; its dumps stay for the janitor
                log.info("client %s went away before the response", self.address_string())

        def do_GET(self) -> None:
            if self.path in ("/health", "/health_generate"):
                self._send(200, {"status": "ok"})
            elif self.path in ("/get_model_info", "/model_info"):
                self._send(200, engine.info())
            elif self.path == "/get_server_info":
                self._send(200, engine.server_info())
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                rids, prompts, batched = engine.parse(body)
                sampling = engine.parse_sampling(body, rids, prompts)
            except (BadRequest, ValueError) as e:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}})
                return
            if engine.faults.take(fx.HTTP500):
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": "injected fault: http500"}})
                return
            if engine.faults.take(fx.HANG):
                time.sleep(engine.faults.hang_s)
            try:
                out = engine.generate(rids, prompts, sampling)
            except Exception as e:  # an engine fault is the server's, not the client's
                log.exception("generate failed")
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(e).__name__}: {e}"}})
                return
            self._send(200, out if batched else out[0])

    return Handler


def serve(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = EngineSettings.port) -> ThreadingHTTPServer:
    """Start serving in the calling thread's process; returns the server (call serve_forever)."""
    server = ThreadingHTTPServer((host, port), _handler(engine))
    server.daemon_threads = True
    return server
