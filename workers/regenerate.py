"""Writing a conversation's assistant turns with the target model: the regeneration stage.

A worker of a `--regenerate` run does this first for each conversation of its job that is still
queued, then extracts the regenerated samples like any other, in the same job: the conversation's
turns and its hidden states are spooled together and committed together, in one shard and its
index (harvest.formats.generated), so a conversation is committed once or not at all. A worker or
node lost before the commit loses only work: the sample is still queued (or is reclaimed), and
generating it again gives the same tokens (temperature 0, or the same per-turn seed). Nothing here
changes who owns a sample: the ledger's states and its spool's lease do, as for any job. A worker
that comes back late after its job was taken over writes its spool files and meets the ledger's
refusal of a revoked spool at its marks (harvest.workers.job `finish`); its conversations are never
committed because the collector packs only samples its own spool owns. Each execution of a job
draws its own attempt number (harvest.ids.new_attempt), so two generations of a sample never share
`hg-` rids (which no engine dumps anyway), and its extraction rids are claimed and verified as ever.

Turns are written in order, each from the tokens before it (harvest.state.conversation's `splice`: a
turn cut at max_new_tokens is closed by the template's end-of-turn token, as the template renders it);
the conversations of a job are written at once, `MAX_IN_FLIGHT` requests at a time, because the
engine's continuous batching needs many requests in flight to keep a GPU busy (decode is
memory-bound: one request at a time would leave it idle).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TypeVar

from harvest.config import RunConfig
from harvest.regeneration import Regeneration
from harvest.sample import Sample
from harvest.state.conversation import gen_rid, turn_seed
from harvest.state.failures import (
    CONTEXT_LENGTH,
    ENGINE_REJECTED,
    ENGINE_UNAVAILABLE,
    GENERATION_EMPTY,
    GENERATION_LENGTH,
    PROMPT_LENGTH,
    SampleFailure,
)
from harvest.workers.clients.base import Engine, EngineUnavailable, GenParams, Rejected

log = logging.getLogger("harvest.worker")

MAX_IN_FLIGHT = 64  # generation requests a worker keeps at its engine
T = TypeVar("T")


@dataclass
class Written:
    """A conversation whose turns are written: the sample to extract, and its generated-dataset entry."""

    sample: Sample
    record: dict
    tokens: int  # tokens the model generated, over all turns

    def entry(self) -> str:
        """The record as the spool file's metadata carries it to the collector (harvest.formats.generated)."""
        return json.dumps(self.record, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Regenerated:
    written: dict[str, Written] = field(default_factory=dict)
    failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # sample -> (reason, message)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.written.values())

    def stats(self) -> dict[str, int]:
        """The stage's counters for the status and the metrics (added to the worker's tally with the
        job's marks: harvest.state.tally)."""
        return {
            "conversations_written": len(self.written),
            "tokens_generated": self.tokens,
            "generation_ms": int(self.seconds * 1000),
        }


def regenerate(
    engine: Engine, samples: list[Sample], attempt: int, cfg: RunConfig, job: str = "?", in_flight: int = MAX_IN_FLIGHT
) -> Regenerated:
    """Every conversation of `samples` (of job `job`) written, at most `in_flight` at once, with the
    run's settings, under rids of the job's `attempt` (harvest.state.conversation.gen_rid). A
    sample-level failure (see `write_turns`) is returned; an unreachable engine raises
    SampleFailure(engine-unavailable, transient) once the requests in flight have ended, for the
    job to retry: nothing written by this call is kept."""
    reg = cfg.regeneration
    if reg is None:
        raise ValueError(f"run {cfg.run} has conversations to regenerate but no regenerate settings in its run.json")
    try:
        out = _regenerate(engine, samples, attempt, reg, in_flight)
    except EngineUnavailable as e:
        raise SampleFailure(ENGINE_UNAVAILABLE, str(e), transient=True) from None
    log.info(
        "job %s: %d conversations written, %d tokens in %.2fs%s",
        job,
        len(out.written),
        out.tokens,
        out.seconds,
        f", {len(out.failures)} failed" if out.failures else "",
    )
    return out


class _Stopped(Exception):
    """A conversation left before its next turn: the job's generation step is over (an engine down,
    a bug, RQ's job timeout), and whatever it wrote would be thrown away."""


def _regenerate(engine: Engine, samples: list[Sample], attempt: int, reg: Regeneration, in_flight: int) -> Regenerated:
    """The first error that is not a sample's own (EngineUnavailable, a bug, RQ's timeout in this
    thread) stops the step: conversations not started are cancelled, those in flight stop before
    their next turn, and it is raised once they have (each holds one request at most)."""
    out = Regenerated()
    t0 = time.monotonic()
    if not samples:
        return out
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=min(in_flight, len(samples)), thread_name_prefix="regenerate")
    try:
        futures = {pool.submit(_stopping, stop, write_turns, engine, s, attempt, reg, stop): s for s in samples}
        for f in as_completed(futures):
            e = f.exception()
            if isinstance(e, _Stopped):  # stopped by the error that will come out of its own future
                continue
            if isinstance(e, SampleFailure):
                out.failures[futures[f].id] = (e.reason, e.message)
            elif e is not None:
                raise e
            else:
                out.written[futures[f].id] = f.result()
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    out.seconds = time.monotonic() - t0
    return out


def _stopping(stop: threading.Event, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, setting `stop` at once if it raises what is not a sample's own failure: the
    other conversations then stop before their next request, not when this one is noticed."""
    try:
        return fn(*args)
    except SampleFailure:
        raise
    except BaseException:
        stop.set()
        raise


def write_turns(
    engine: Engine, s: Sample, attempt: int, reg: Regeneration, stop: threading.Event | None = None
) -> Written:
    """Conversation `s`'s turns, in order, each generated from the regenerated ones before it.
    Raises SampleFailure (generation-empty, generation-length, context-length, engine-rejected,
    prompt-length) for a turn that cannot stand; `_Stopped` before a turn once `stop` is set."""
    conv = s.conv
    assert conv is not None, "only conversations are regenerated"
    pieces = conv.pieces(s.input_ids)
    generated: list[list[int]] = []
    turns: list[dict] = []
    texts: list[str] = []
    n = conv.turns
    for k in range(n):
        if stop is not None and stop.is_set():
            raise _Stopped(s.id)
        prompt, _ = conv.splice(pieces, generated)
        where = f"turn {k + 1} of {n}"
        if reg.context is not None and prompt.size + reg.max_new_tokens > reg.context:
            raise SampleFailure(
                CONTEXT_LENGTH,
                f"{where}: its prompt of {prompt.size} tokens and --max-new-tokens "
                f"{reg.max_new_tokens} exceed the model's context of {reg.context}",
            )
        seed = turn_seed(s.id, k)
        params = GenParams(reg.max_new_tokens, reg.temperature, reg.top_p, seed, conv.stop)
        r = engine.complete(gen_rid(s.id, attempt, k), prompt.tolist(), params)
        if isinstance(r, Rejected):
            raise SampleFailure(ENGINE_REJECTED, f"{where}: {r.message}")
        if r.prompt_tokens not in (-1, prompt.size):
            raise SampleFailure(
                PROMPT_LENGTH, f"{where}: engine saw {r.prompt_tokens} prompt tokens, sent {prompt.size}"
            )
        content = r.tokens[:-1] if r.finish_reason == "stop" else r.tokens
        if not content:
            raise SampleFailure(GENERATION_EMPTY, f"{where}: the model ended the turn before writing anything")
        if r.finish_reason == "length" and reg.on_length == "fail":
            raise SampleFailure(
                GENERATION_LENGTH,
                f"{where} reached --max-new-tokens {reg.max_new_tokens} without "
                "ending (--on-length keep keeps such turns)",
            )
        generated.append(list(r.tokens))
        texts.append(r.text)
        turns.append(
            {
                "tokens": list(r.tokens),
                "finish_reason": r.finish_reason,
                "seed": seed,
                "prompt_tokens": int(prompt.size),
            }
        )
    ids, mask = conv.splice(pieces, generated)
    if reg.context is not None and ids.size > reg.context:
        raise SampleFailure(
            CONTEXT_LENGTH,
            f"the regenerated conversation has {ids.size} tokens, over the model's context of {reg.context}",
        )
    answers = iter(texts)
    messages = [
        {"role": m["role"], "content": next(answers) if m["role"] == "assistant" else m.get("content")}
        for m in conv.messages
    ]
    record = {"id": s.id, "messages": messages, "turns": turns}
    return Written(s.regenerated(ids, mask), record, sum(len(g) for g in generated))
