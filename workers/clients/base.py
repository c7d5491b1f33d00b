"""The engine interface workers use, with its result and error types.

Every engine client (SGLang's `/generate`, vLLM's completions with harvest's connector) takes
one job's rids and token ids and answers, per rid, `Generated` (the engine ran the prefill and
dumped it) or `Rejected` (refused before any forward: nothing to wait for). `EngineUnavailable`
is transient: the job retries later (harvest.state.failures.ENGINE_UNAVAILABLE).

Regeneration (the target model writes a chat's assistant turns before extraction) uses
`complete(rid, prompt, GenParams)`: one request, one `Completion` (or `Rejected`), safe to call
from many threads at once. Its rids start with `hg-`, never `hv-`, so no engine dumps them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import httpx

from harvest.errors import ServiceError

log = logging.getLogger("harvest.worker")


class EngineUnavailable(ServiceError, RuntimeError):
    """The engine did not answer usefully after all retries (transient cause persisted)."""


@dataclass
class Generated:
    rid: str
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Rejected:
    rid: str
    message: str


@dataclass(frozen=True)
class GenParams:
    """Sampling for one generation request."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # per request (harvest derives it from sample id + turn); 0..2**31-1
    stop_token_ids: tuple[int, ...] = ()  # the template's end-of-turn token(s) (and EOS)


@dataclass(frozen=True)
class Completion:
    """One finished generation. `tokens` ends with the matched stop token when `finish_reason`
    is "stop" (both SGLang and vLLM return it in their token ids; a client appends it if an
    engine leaves it out); `text` is the engine's decoding without it (special tokens skipped).
    Engines also stop at the model's own EOS tokens, listed or not: that is a "stop" too."""

    rid: str
    tokens: list[int]
    text: str
    finish_reason: str  # FINISH_STOP or FINISH_LENGTH
    prompt_tokens: int  # as the engine reports it, -1 if unknown


FINISH_STOP, FINISH_LENGTH = "stop", "length"


def finished(
    rid: str,
    tokens: list[int],
    text: str,
    kind: object,
    matched: object,
    prompt_tokens: int,
    engine: str,
    detail: str = "",
) -> Completion | Rejected:
    """A `Completion` from an engine's finish reason (`kind`: "stop", "length", anything else) and the
    token it matched (an int for a stop token; None for EOS on vLLM, whose ids end with it anyway).
    "abort" (the server dropped the request: shutdown, memory, a cancelled request) and no reason
    at all raise EngineUnavailable, so the job retries; any other reason (vLLM's "repetition")
    rejects this request. `detail`: the engine's words, for the messages."""
    if kind == FINISH_STOP:
        if isinstance(matched, int) and not isinstance(matched, bool) and (not tokens or tokens[-1] != matched):
            tokens = [*tokens, matched]
        return Completion(rid, tokens, text, FINISH_STOP, prompt_tokens)
    if kind == FINISH_LENGTH:
        return Completion(rid, tokens, text, FINISH_LENGTH, prompt_tokens)
    why = f" ({detail})" if detail else ""
    if kind == "abort" or kind is None:
        raise EngineUnavailable(f"{engine} {'aborted' if kind else 'did not finish'} generation request {rid}{why}")
    return Rejected(rid, f"{engine} ended generation request {rid} with finish reason {kind!r}{why}")


class Engine(Protocol):
    """What harvest.workers.job needs of an engine client."""

    url: str

    def health(self) -> bool: ...

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]: ...

    def complete(self, rid: str, prompt: list[int], params: GenParams) -> Completion | Rejected:
        """Generate from one prompt (an `hg-` rid: nothing is dumped). Thread-safe. A 4xx (e.g. a
        prompt plus max_new_tokens past the context) is `Rejected` with the engine's message;
        transport errors, 5xx and aborts raise EngineUnavailable."""
        ...

    def close(self) -> None: ...


def post_with_retries(
    http: httpx.Client, url: str, body: dict, retries: int, backoff: float, what: str
) -> tuple[int, object]:
    """POST `body`; transport errors and 5xx are retried with exponential backoff, anything
    else is returned as (status, JSON). Raises EngineUnavailable once the retries are spent."""
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            r = http.post(url, json=body)
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            log.warning("%s unreachable (%s), attempt %d", what, last, attempt + 1)
            continue
        if r.status_code >= 500:
            last = f"HTTP {r.status_code}: {error_message(_json(r))}"
            log.warning("%s error (%s), attempt %d", what, last, attempt + 1)
            continue
        return r.status_code, _json(r)
    raise EngineUnavailable(f"{what} failed {retries + 1} times; last error: {last}")


def _json(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return r.text


def error_message(body: object) -> str:
    """The human part of an engine's error body (OpenAI-style `error.message`, `message`, FastAPI's `detail`)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]
