"""The worker's client for a vLLM server running harvest's hidden-states connector.

vLLM's OpenAI server takes token ids on `/v1/completions`; with the `extract_hidden_states`
speculative method and harvest's connector (engines/vllm_connector.py) each finished request
leaves `<storage>/<vllm request id>.safetensors` (`hidden_states [T, K, H]`, `token_ids [T]`,
metadata `layer_ids`) behind an exclusive flock on `<file>.lock`, and the response names the
file in `kv_transfer_params.hidden_states_path`. Only choice 0's path comes back, so every
prompt is its own request; many run at once from a thread pool.

For each request this client waits for the lock, reads the file, maps vLLM's layer ids back to
HF indices (id k < L is HF index k; id L is before the final norm, so the norm is applied here,
harvest/read/final_norm.py) and writes the result as one harvest dump chunk `<rid>.0-<T>` into the
dump dir, with vLLM's token ids and the layers vLLM really captured; then it deletes vLLM's
files. From there the usual claim -> verify -> spool path (workers/claim.py) runs unchanged, so
token ids, coverage and capture points are verified exactly as for SGLang.

The interface is `harvest.workers.clients.base.Engine`'s (`generate(rids, prompts)`, `health`,
`close`, `url`), with its error semantics: timeouts, connection errors and 5xx are retried with
backoff and then raise `EngineUnavailable`; a 4xx rejects that sample only.

`complete` (regeneration) posts one `/v1/completions` request with an `hg-` rid and writes no
dump (engines/vllm_connector.py saves nothing for `cmpl-hg-` requests). What vLLM 0.32.0 does,
read in its source:
- The request (vllm/entrypoints/openai/completion/protocol.py `CompletionRequest`): `prompt` as
  token ids, `max_tokens`, `temperature` (0: greedy), `top_p`, `seed`, `stop_token_ids`,
  `skip_special_tokens` (default True), `request_id`; `return_token_ids: true` puts the generated
  ids in `choices[0].token_ids` (completion/serving.py `request_output_to_completion_response`).
- The scheduler appends each sampled token, then `check_stop` (vllm/v1/core/sched/utils.py) stops
  on the EOS id (stop_reason None) or a stop_token_id (stop_reason = that id) and trims only what
  FOLLOWS it, so `token_ids` INCLUDES the stop token; the detokenizer (vllm/v1/engine/
  detokenizer.py `update`) leaves it out of `text` unless include_stop_str_in_output.
- `finish_reason`: "stop", "length" (max_tokens or max_model_len), "abort", "repetition";
  "error" is turned into HTTP 500 by the server. A prompt past max_model_len is HTTP 400.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
from safetensors import safe_open

from harvest.config import RunConfig
from harvest.errors import InputError
from harvest.formats.crc import check_sums
from harvest.formats.dump import Chunk, write_chunk
from harvest.health import healthy
from harvest.node.dumpdir import vllm_dir
from harvest.read.final_norm import FinalNorm
from harvest.workers.clients.base import (
    Completion,
    EngineUnavailable,
    Generated,
    GenParams,
    Rejected,
    error_message,
    finished,
    post_with_retries,
)

log = logging.getLogger("harvest.worker")

ENV_MODEL_DIR = "HARVEST_MODEL_DIR"  # the run's checkpoint on this node, when not at the run's model path
CONNECTOR_FORMAT = "harvest-vllm-1"
STALE_S = 600.0  # vLLM files of harvest requests older than this were abandoned (see VllmClient.sweep)


class VllmDumpError(InputError):
    """vLLM's file for a request is missing, late, outside its storage dir, or not what harvest's connector writes."""


def wait_unlocked(path: str, timeout: float, poll: float = 0.005) -> None:
    """Wait until the writer's exclusive flock on `path + '.lock'` is released. The connector
    creates the lock before the response is sent, so a missing lock means the file is done
    (or was never going to be written, which the caller finds out next)."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise VllmDumpError(f"{path} still locked by the vLLM server after {timeout:.0f}s")
            time.sleep(poll)
    finally:
        os.close(fd)


def read_vllm_file(path: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(layer ids in slot order, hidden_states [T, K, H], token_ids [T]) of one connector file, its
    tensors checked against the crc32s the connector recorded."""
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != {"hidden_states", "token_ids"}:
                raise VllmDumpError(f"{path}: tensors {sorted(names)}, expected hidden_states and token_ids")
            hs, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    except VllmDumpError:
        raise
    except FileNotFoundError:
        raise VllmDumpError(f"the vLLM server wrote no hidden states at {path} (see its log)") from None
    except Exception as e:  # safetensors raises its own types for corrupt files
        raise VllmDumpError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if meta.get("format") != CONNECTOR_FORMAT:
        raise VllmDumpError(f"{path} was not written by harvest's connector: launch vLLM with `harvest vllm-args`")
    layer_ids = [int(x) for x in json.loads(meta["layer_ids"])]
    try:
        check_sums(meta, {"hidden_states": hs, "token_ids": ids}, "the connector")
    except ValueError as e:
        raise VllmDumpError(f"{path}: {e}") from None
    if hs.ndim != 3 or hs.shape[0] != ids.shape[0] or hs.shape[1] != len(layer_ids):
        raise VllmDumpError(
            f"{path}: hidden_states {tuple(hs.shape)}, token_ids {tuple(ids.shape)} for layers {layer_ids}"
        )
    return layer_ids, hs, ids


def to_capture_points(
    layer_ids: Sequence[int], hidden_states: torch.Tensor, num_layers: int, norm: FinalNorm | None
) -> tuple[list[int], torch.Tensor]:
    """vLLM slots -> harvest capture points (HF indices, ascending) and `[T, K, H]` in that order.
    The slot of id L gets the final norm, turning it into HF's `hidden_states[L]`."""
    order = sorted(range(len(layer_ids)), key=lambda j: layer_ids[j])
    points = [int(layer_ids[j]) for j in order]
    hs = hidden_states[:, order] if order != list(range(len(order))) else hidden_states
    if num_layers in points:
        if norm is None:
            raise VllmDumpError(f"vLLM captured layer id {num_layers} (before the final norm); no final norm loaded")
        k = points.index(num_layers)
        hs = hs.clone()
        hs[:, k] = norm(hs[:, k])
    return points, hs


class VllmClient:
    """`generate(rids, prompts)` against a vLLM server; leaves one harvest dump chunk per rid."""

    def __init__(
        self,
        url: str,
        cfg: RunConfig,
        dump_dir: str,
        concurrency: int = 32,
        timeout: float = 600.0,
        retries: int = 4,
        backoff: float = 0.5,
        lock_timeout: float = 60.0,
    ) -> None:
        if cfg.num_layers < 1:
            raise ValueError(f"run {cfg.run} records no layer count; the vLLM engine needs it to place the final norm")
        self.url = url.rstrip("/")
        self.cfg, self.dump_dir = cfg, dump_dir
        self.storage = os.path.realpath(vllm_dir(dump_dir))
        self.retries, self.backoff, self.lock_timeout = retries, backoff, lock_timeout
        self.model_name = os.path.basename(cfg.model.rstrip("/"))
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="harvest-vllm")
        self._norm: FinalNorm | None = None
        self.stale_s = STALE_S
        self._last_sweep = 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()

    def health(self) -> bool:
        return healthy(self.url, 5.0, self.http)

    @property
    def norm(self) -> FinalNorm:
        if self._norm is None:
            self._norm = FinalNorm.from_checkpoint(os.environ.get(ENV_MODEL_DIR) or self.cfg.model)
        return self._norm

    def sweep(self, now: float | None = None) -> int:
        """Remove harvest's files in vLLM's storage dir older than `stale_s` (a worker that died or
        timed out before converting them; the janitor looks only at the dump dir itself).
        Returns how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        try:
            entries = list(os.scandir(self.storage))
        except FileNotFoundError:
            return 0
        for e in entries:
            if not e.name.startswith("cmpl-hv-") or not e.is_file(follow_symlinks=False):
                continue
            try:
                if now - e.stat(follow_symlinks=False).st_mtime > self.stale_s:
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]:
        if time.monotonic() - self._last_sweep > 60:
            self._last_sweep = time.monotonic()
            self.sweep()
        if self.cfg.num_layers in self.cfg.capture_points:
            _ = self.norm  # load once, before the threads start (a bad checkpoint fails the job, not each request)
        futures = [self.pool.submit(self._one, rid, p) for rid, p in zip(rids, prompts, strict=False)]
        out, unavailable = [], None
        for f in futures:
            try:
                out.append(f.result())
            except EngineUnavailable as e:
                unavailable = unavailable or e
        if unavailable is not None:
            raise unavailable
        return out

    def _one(self, rid: str, prompt: list[int]) -> Generated | Rejected:
        status, body = self._post(rid, prompt)
        if status >= 400:
            return Rejected(rid, f"engine rejected the request (HTTP {status}): {error_message(body)}")
        if not isinstance(body, dict):
            raise EngineUnavailable(f"vLLM answered {str(body)[:200]!r} for {rid}")
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            return Rejected(
                rid,
                "vLLM returned no kv_transfer_params.hidden_states_path: launch it with the "
                "extract_hidden_states speculative config and harvest's connector (harvest vllm-args)",
            )
        try:
            self._convert(rid, path)
        except VllmDumpError as e:
            return Rejected(rid, f"vLLM hidden states of {rid}: {e}")
        return Generated(rid, int(usage.get("prompt_tokens", -1)), int(details.get("cached_tokens") or 0))

    def _convert(self, rid: str, path: str) -> None:
        """vLLM's file for `rid` -> one harvest dump chunk; vLLM's file and lock are removed either way."""
        real = os.path.realpath(path)
        name = os.path.basename(real)
        # Only files in this node's vLLM storage dir, and only this request's, are read or deleted.
        ours = name.startswith(f"cmpl-{rid}-") and name.endswith(".safetensors")
        if os.path.dirname(real) != self.storage or not ours:
            raise VllmDumpError(
                f"response names {path!r}, not a file of this request in {self.storage}: "
                f"the server's shared_storage_path must be <dump dir>/.vllm (harvest vllm-args)"
            )
        try:
            wait_unlocked(real, self.lock_timeout)
            layer_ids, hs, ids = read_vllm_file(real)
            norm = self.norm if self.cfg.num_layers in layer_ids else None
            points, hs = to_capture_points(layer_ids, hs, self.cfg.num_layers, norm)
            write_chunk(self.dump_dir, Chunk(rid, 0, int(ids.shape[0]), ids, hs), points, self.model_name)
        finally:
            for p in (real, real + ".lock"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def complete(self, rid: str, prompt: list[int], params: GenParams) -> Completion | Rejected:
        """One generation request, in the calling thread (see the module docstring for what vLLM
        answers). Thread-safe: it shares only the httpx client, which is; no dump, no sweep."""
        body = {
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop_token_ids": list(params.stop_token_ids),
            "skip_special_tokens": True,
            "return_token_ids": True,
            "request_id": rid,
        }
        what = f"vLLM {self.url}"
        status, out = post_with_retries(self.http, f"{self.url}/v1/completions", body, self.retries, self.backoff, what)
        if status >= 400:
            return Rejected(rid, f"engine rejected the request (HTTP {status}): {error_message(out)}")
        choices = out.get("choices") if isinstance(out, dict) else None
        if not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("token_ids"), list):
            raise EngineUnavailable(
                f"vLLM answered {str(out)[:200]!r} for {rid} (no choices[0].token_ids: "
                f"a vLLM without return_token_ids?)"
            )
        choice, usage = choices[0], out.get("usage") or {}
        return finished(
            rid,
            [int(t) for t in choice["token_ids"]],
            choice.get("text") or "",
            choice.get("finish_reason"),
            choice.get("stop_reason"),
            int(usage.get("prompt_tokens", -1)),
            what,
        )

    def _post(self, rid: str, prompt: list[int]) -> tuple[int, object]:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "request_id": rid}
        return post_with_retries(
            self.http, f"{self.url}/v1/completions", body, self.retries, self.backoff, f"vLLM {self.url}"
        )
