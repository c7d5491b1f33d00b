"""The engine interface workers use, with its result and error types.

Every engine client (SGLang's `/generate`, vLLM's completions with harvest's connector) takes
one job's rids and token ids and answers, per rid, `Generated` (the engine ran the prefill and
dumped it) or `Rejected` (refused before any forward: nothing to wait for). `EngineUnavailable`
is transient: the job retries later (harvest.state.failures.ENGINE_UNAVAILABLE).
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


class Engine(Protocol):
    """What workers.job needs of an engine client."""

    url: str

    def health(self) -> bool: ...

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]: ...

    def close(self) -> None: ...


def post_with_retries(http: httpx.Client, url: str, body: dict, retries: int, backoff: float,
                      what: str) -> tuple[int, object]:
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
