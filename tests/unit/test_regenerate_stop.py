"""The regeneration step stops as one: once the engine is down, conversations not started are
never sent and those in flight stop before their next turn. The engine here is a stand-in object
with the client's `complete` (a real engine cannot be made to fail on the third request of many
on cue); the end-to-end paths run against the real reference engine in
tests/system/test_regenerate.py and test_regenerate_chaos.py."""

from __future__ import annotations

import threading

import pytest

from harvest.config import RunConfig
from harvest.sample import Sample
from harvest.state.conversation import Conversation
from harvest.state.failures import ENGINE_UNAVAILABLE, SampleFailure
from harvest.workers.clients.base import Completion, EngineUnavailable
from harvest.workers.regenerate import regenerate
from tests.support.synth import make_config


class _DownAfter:
    """Answers `n` requests (two tokens, the stop token last), then is unreachable."""

    def __init__(self, n: int) -> None:
        self.n, self.calls, self.lock = n, 0, threading.Lock()

    def complete(self, rid, prompt, params):
        with self.lock:
            self.calls += 1
            k = self.calls
        if k > self.n:
            raise EngineUnavailable("engine http://127.0.0.1:9 unreachable: connection refused")
        return Completion(rid, [7, params.stop_token_ids[0]], "x", "stop", len(prompt))


def _conversations(n: int, turns: int) -> list[Sample]:
    msgs = tuple(m for _ in range(turns) for m in ({"role": "user", "content": "q"}, {"role": "assistant"}))
    return [
        Sample.build([i + 10] * (turns + 1), [0] * (turns + 1), Conversation((1,) * (turns + 1), (2,), msgs, 2))
        for i in range(n)
    ]


def _cfg(tmp_path) -> RunConfig:
    import dataclasses

    cfg = make_config(f"file://{tmp_path}/out")
    return dataclasses.replace(
        cfg, regenerate={"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "on_length": "keep", "context": None}
    )


def test_an_engine_down_stops_the_step_without_sending_the_rest(tmp_path):
    samples = _conversations(100, turns=3)
    engine = _DownAfter(5)
    with pytest.raises(SampleFailure) as e:
        regenerate(engine, samples, 1, _cfg(tmp_path), in_flight=4)
    assert e.value.reason == ENGINE_UNAVAILABLE and e.value.transient
    # 5 answered, then each of the (at most 4) conversations in flight meets the dead engine once
    assert engine.calls <= 5 + 4, engine.calls


def test_every_conversation_is_written_when_the_engine_answers(tmp_path):
    samples = _conversations(10, turns=2)
    engine = _DownAfter(10**6)
    out = regenerate(engine, samples, 1, _cfg(tmp_path), in_flight=4)
    assert engine.calls == 20 and sorted(out.written) == sorted(s.id for s in samples) and out.failures == {}
    w = out.written[samples[0].id]
    assert w.sample.input_ids.tolist() == [10, 7, 2, 10, 7, 2, 10] and w.sample.loss_mask.tolist() == [
        0,
        1,
        1,
        0,
        1,
        1,
        0,
    ]
    assert [t["tokens"] for t in w.record["turns"]] == [[7, 2], [7, 2]] and w.tokens == 4
