"""The worker's client for SGLang's native `/generate` (the reference engine speaks the same).

One batched request per job: token ids in, one unique rid per sample, one new token out,
and a unique `extra_key` per request so the radix cache can never serve a prefix (a cached
prefix is a prefix whose hidden states are never computed, hence never dumped).
Timeouts, connection errors and 5xx are transient and retried with backoff; a 4xx names a
bad request, and a batch that gets one is split so that only the offending sample fails.
"""

from __future__ import annotations

import logging

import httpx

from harvest.health import healthy
from workers.clients.base import EngineUnavailable, Generated, Rejected, error_message, post_with_retries

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

    def model_info(self) -> dict:
        r = self.http.get(f"{self.url}/get_model_info", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]:
        status, body = self._post(rids, prompts)
        if status < 400:
            items = body if isinstance(body, list) else [body]
            if len(items) != len(rids):
                raise EngineUnavailable(f"engine answered {len(items)} results for {len(rids)} prompts")
            out: list[Generated | Rejected] = []
            for rid, item in zip(rids, items):
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
        for rid, p in zip(rids, prompts):
            out.extend(self.generate([rid], [p]))
        return out

    def _post(self, rids: list[str], prompts: list[list[int]]) -> tuple[int, object]:
        body = {
            "input_ids": prompts,
            "rid": rids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "extra_key": rids,
        }
        return post_with_retries(self.http, f"{self.url}/generate", body, self.retries, self.backoff, f"engine {self.url}")
