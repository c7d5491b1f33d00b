"""The worker's client for SGLang's native `/generate` (the reference engine speaks the same).

One batched request per job: token ids in, one unique rid per sample, one new token out,
and a unique `extra_key` per request so the radix cache can never serve a prefix (a cached
prefix is a prefix whose hidden states are never computed, hence never dumped).
Timeouts, connection errors and 5xx are transient and retried with backoff; a 4xx names a
bad request, and a batch that gets one is split so that only the offending sample fails.

`complete` (regeneration) is one `/generate` request per call with an `hg-` rid, no `extra_key`
(generation may use the radix cache; nothing is dumped for it). What SGLang 0.5.23 answers, read
in its source:
- sampling_params (srt/sampling/sampling_params.py `SamplingParams`): `max_new_tokens`,
  `temperature` (below 1e-6: greedy, top_k 1), `top_p`, `stop_token_ids`, `skip_special_tokens`
  (default True) and the seed `sampling_seed`, which SGLang uses ONLY when the server runs with
  `--enable-deterministic-inference` (srt/sampling/sampling_batch_info.py; otherwise sampling at
  temperature > 0 is not repeatable).
- It stops at stop_token_ids and also at the model's EOS ids (generation config, tokenizer) unless
  `ignore_eos`; `Req._check_token_based_finish` (srt/managers/schedule_batch.py) sets
  `FINISH_MATCHED_TOKEN(matched=<token id>)` and `finished_len = matched position + 1`, and the
  output streamer sends `output_ids_through_stop`: `output_ids` INCLUDES the matched stop token.
  `text` is decoded by the detokenizer (srt/managers/detokenizer_manager.py), which drops that
  last token first (`trim_matched_stop`, unless `no_stop_trim`).
- `meta_info.finish_reason`: {"type": "stop", "matched": id} / {"type": "length", "length": n} /
  {"type": "abort", "message": ...}; an abort with a 4xx status_code comes back as that HTTP
  error instead (srt/managers/tokenizer_manager.py `_handle_abort_finish_reason`).
- A prompt of >= context tokens, or prompt + max_new_tokens > context, is HTTP 400
  (`TokenizerManager._validate_one_request`).
"""

from __future__ import annotations

import logging

import httpx

from harvest.health import healthy
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


class SGLangClient:
    """SGLang's native `/generate` (the reference engine serves the same subset)."""

    def __init__(self, url: str, timeout: float = 600.0, retries: int = 4, backoff: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff = retries, backoff
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self.http.close()

    def health(self) -> bool:
        return healthy(self.url, 5.0, self.http)

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]:
        status, body = self._post(rids, prompts)
        if status < 400:
            items = body if isinstance(body, list) else [body]
            if len(items) != len(rids):
                raise EngineUnavailable(f"engine answered {len(items)} results for {len(rids)} prompts")
            out: list[Generated | Rejected] = []
            for rid, item in zip(rids, items, strict=False):
                meta = (item or {}).get("meta_info") or {}
                if meta.get("id", rid) != rid:
                    raise EngineUnavailable(f"engine answered rid {meta.get('id')!r} in the place of {rid!r}")
                out.append(Generated(rid, int(meta.get("prompt_tokens", -1)), int(meta.get("cached_tokens", 0) or 0)))
            return out
        message = error_message(body)
        if len(rids) == 1:
            return [Rejected(rids[0], f"engine rejected the request (HTTP {status}): {message}")]
        log.warning("engine rejected a batch of %d (HTTP %d: %s); retrying one by one", len(rids), status, message)
        out = []
        for rid, p in zip(rids, prompts, strict=False):
            out.extend(self.generate([rid], [p]))
        return out

    def complete(self, rid: str, prompt: list[int], params: GenParams) -> Completion | Rejected:
        """One generation request (see the module docstring for what SGLang answers). Thread-safe:
        it shares only the httpx client, which is."""
        body = {
            "input_ids": list(prompt),
            "rid": rid,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "sampling_seed": params.seed,
                "stop_token_ids": list(params.stop_token_ids),
                "skip_special_tokens": True,
            },
        }
        status, out = post_with_retries(
            self.http, f"{self.url}/generate", body, self.retries, self.backoff, f"engine {self.url}"
        )
        if status >= 400:
            return Rejected(rid, f"engine rejected the request (HTTP {status}): {error_message(out)}")
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict) or not isinstance(out.get("output_ids"), list):
            raise EngineUnavailable(f"engine answered {str(out)[:200]!r} for {rid}")
        if meta.get("id", rid) != rid:
            raise EngineUnavailable(f"engine answered rid {meta.get('id')!r} in the place of {rid!r}")
        reason = meta.get("finish_reason")
        kind, matched = (reason.get("type"), reason.get("matched")) if isinstance(reason, dict) else (reason, None)
        return finished(
            rid,
            [int(t) for t in out["output_ids"]],
            out.get("text") or "",
            kind,
            matched,
            int(meta.get("prompt_tokens", -1)),
            f"engine {self.url}",
            str(reason.get("message", "")) if isinstance(reason, dict) else "",
        )

    def _post(self, rids: list[str], prompts: list[list[int]]) -> tuple[int, object]:
        body = {
            "input_ids": prompts,
            "rid": rids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "extra_key": rids,
        }
        return post_with_retries(
            self.http, f"{self.url}/generate", body, self.retries, self.backoff, f"engine {self.url}"
        )
