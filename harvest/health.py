"""An engine's `/health`, asked once or waited for.

SGLang, vLLM and the reference engine all answer `GET /health` with 200 once they take requests.
Every process that waits for an engine (the worker before its first job, `harvest run` after
starting one, the launchers of the tests, benches and scripts) asks here, so a probe's meaning
(200 is healthy; a transport error or any other status is not yet) is written once. The caller
keeps its own error: `wait_healthy` returns False at its deadline and the caller says what it
started and where its log is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def healthy(url: str, timeout: float, client: httpx.Client | None = None) -> bool:
    """`url`/health answered 200 within `timeout` seconds; a transport error is False. `client`:
    the caller's connection pool (an engine client's), else a one-off request."""
    get = client.get if client is not None else httpx.get
    try:
        return get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(
    url: str,
    timeout: float | None,
    *,
    interval: float = 0.5,
    probe_timeout: float = 2.0,
    check: Callable[[], object] | None = None,
    client: httpx.Client | None = None,
) -> bool:
    """Ask `url`/health every `interval` seconds until it answers 200 (True) or `timeout` seconds
    have passed (False; None waits for ever). `check` runs before each probe: it raises to stop
    the wait (the engine's process exited) or does what the caller must do meanwhile (a
    supervisor's poll)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if check is not None:
            check()
        if healthy(url, probe_timeout, client):
            return True
        time.sleep(interval)
    return False
