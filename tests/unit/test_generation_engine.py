"""Regeneration's engine side: the reference engine generates for real (`hg-` rids, or
max_new_tokens > 1) and the worker's clients' `complete` speak SGLang's and vLLM's generation APIs.

The reference engine runs its real HTTP server in-process with the tiny model and is called
through `SGLangClient.complete`; its tokens are checked against HF `model.generate` run on its own.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from harvest.config import RunConfig
from harvest.engines.reference import BadRequest, ReferenceEngine, serve
from harvest.workers.clients.base import Completion, EngineUnavailable, GenParams, Rejected
from harvest.workers.clients.sglang import SGLangClient
from harvest.workers.clients.vllm import VllmClient

PROMPT = [5, 6, 7, 8, 9]  # greedy on the tiny model: three different tokens first (the stop test needs it)
PROMPTS = [PROMPT, [3, 40, 41, 42, 100, 200], list(range(10, 60))]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    eng = ReferenceEngine(tiny_model, str(tmp_path_factory.mktemp("gen") / "dump"), layers="2,4,8")
    server = serve(eng, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield eng
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def client(engine):
    c = SGLangClient(engine.url, timeout=120, retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int, stop: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=stop,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


EOS = 2  # the tiny model's </s>: engines stop at the model's EOS too, as SGLang does


def test_greedy_equals_hf_generate(client, hf):
    for i, prompt in enumerate(PROMPTS):
        got = client.complete(f"hg-greedy-{i}", prompt, GenParams(max_new_tokens=24))
        want = hf_greedy(hf, prompt, 24, [EOS])
        assert isinstance(got, Completion) and got.tokens == want
        assert got.finish_reason == ("stop" if want[-1] == EOS else "length") and got.prompt_tokens == len(prompt)


def test_stops_at_a_stop_token_and_keeps_it(client, hf, tokenizer):
    greedy = hf_greedy(hf, PROMPT, 8, [EOS])
    stop = greedy[2]
    assert stop not in greedy[:2]  # so step 3 is the first place it can stop
    got = client.complete("hg-stop-0", PROMPT, GenParams(max_new_tokens=8, stop_token_ids=(stop,)))
    assert got.finish_reason == "stop" and got.tokens == greedy[:3] and got.tokens[-1] == stop
    assert got.tokens == hf_greedy(hf, PROMPT, 8, [stop, EOS])
    assert got.text == tokenizer.decode(greedy[:2], skip_special_tokens=True)  # the stop token is not in the text


def test_length_finish(client, tokenizer):
    got = client.complete("hg-len-0", PROMPT, GenParams(max_new_tokens=4))
    assert got.finish_reason == "length" and len(got.tokens) == 4
    assert got.text == tokenizer.decode(got.tokens, skip_special_tokens=True)


def test_seeded_sampling_repeats_and_seeds_differ(client):
    def run(seed: int, top_p: float = 1.0) -> list[int]:
        return client.complete(f"hg-seed-{seed}", PROMPT, GenParams(16, temperature=1.0, top_p=top_p, seed=seed)).tokens

    assert run(7) == run(7) and run(7, 0.9) == run(7, 0.9)
    assert len({tuple(run(s)) for s in (1, 2, 3)}) > 1


def test_top_p_keeps_only_the_nucleus():
    """top_p tiny leaves only the most likely token: sampling then is greedy, whatever the seed."""
    from harvest.engines.generation import Sampling, sample

    logits = torch.tensor([0.1, 3.0, 0.5, 2.9])
    nucleus = Sampling(1, temperature=1.0, top_p=1e-3)
    assert {sample(logits, nucleus, torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    two = Sampling(1, temperature=1.0, top_p=0.6)  # 1 and 3 hold ~0.94 of the mass; 1 alone ~0.48
    assert {sample(logits, two, torch.Generator().manual_seed(s)) for s in range(40)} == {1, 3}


def test_concurrent_completes_equal_sequential(client):
    jobs = [
        (f"hg-conc-{i}", PROMPTS[i % 3], GenParams(12, temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(8)
    ]
    sequential = [client.complete(*j).tokens for j in jobs]
    with ThreadPoolExecutor(4) as pool:
        concurrent = [c.tokens for c in pool.map(lambda j: client.complete(*j), jobs)]
    assert concurrent == sequential


def test_overlong_and_bad_requests_are_rejected(client, engine):
    got = client.complete("hg-long-0", PROMPT, GenParams(max_new_tokens=5000))
    assert isinstance(got, Rejected) and got.rid == "hg-long-0"
    assert "prompt of 5 tokens + max_new_tokens 5000 exceeds the model's context of 4096" in got.message
    got = client.complete("hg-long-1", [5] * 4096, GenParams(max_new_tokens=1))
    assert isinstance(got, Rejected) and "reaches the model's context of 4096" in got.message
    got = client.complete("hg-bad-0", PROMPT, GenParams(max_new_tokens=4, top_p=0.0))
    assert isinstance(got, Rejected) and "top_p" in got.message
    for sp in (
        {"max_new_tokens": 4, "temperature": -1},
        {"max_new_tokens": 4, "stop_token_ids": "2"},
        {"max_new_tokens": 4, "sampling_seed": 1.5},
        {"max_new_tokens": 0},
    ):
        r = httpx.post(f"{engine.url}/generate", json={"input_ids": PROMPT, "rid": "hg-bad-1", "sampling_params": sp})
        assert r.status_code == 400 and r.json()["error"]["message"], sp


def test_generation_dumps_only_hv_rids(client, engine):
    """An `hg-` rid leaves nothing in the dump dir; an `hv-` rid that asks for more tokens is
    extracted (dumped) and then generated."""
    engine.writer.flush()
    before = set(os.listdir(engine.dump_dir))
    assert client.complete("hg-nodump-0", PROMPT, GenParams(6)).finish_reason in ("stop", "length")
    engine.writer.flush()
    assert set(os.listdir(engine.dump_dir)) == before
    rid = "hv-" + "ab" * 16 + "-0"
    r = httpx.post(
        f"{engine.url}/generate",
        timeout=60,
        json={"input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3  # greedy: no EOS in the first three
    engine.writer.flush()
    assert any(rid in name for name in set(os.listdir(engine.dump_dir)) - before)
    # an extraction request is answered as before: one greedy token, finish length 1
    one = httpx.post(
        f"{engine.url}/generate",
        timeout=60,
        json={"input_ids": PROMPT, "rid": "warm-0", "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
    )
    assert one.json()["output_ids"] == r.json()["output_ids"][:1]
    assert one.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 1}


def test_synthetic_engine_still_refuses_generation(tmp_path):
    from harvest.engines.synthetic import SyntheticEngine

    eng = SyntheticEngine(str(tmp_path / "dump"), [2, 4], 8)
    with pytest.raises(BadRequest, match="at most 1 new token"):
        eng.parse({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5}})
    assert eng.parse({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0]


# --- vLLM ---------------------------------------------------------------------------------------


class FakeVllm:
    """Stands in for vLLM 0.32's `/v1/completions` (a real one runs in tests/system/test_vllm.py):
    answers each request with the next queued (status, body) and records the request bodies."""

    def __init__(self):
        self.requests: list[dict] = []
        self.answers: list[tuple[int, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, **body})
                status, answer = fake.answers.pop(0)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def vllm_answer(token_ids, text, finish_reason, stop_reason=None, prompt_tokens=5) -> dict:
    """The shape of vLLM's CompletionResponse with return_token_ids (no kv_transfer_params: the
    connector saves nothing for generation requests)."""
    return {
        "id": "cmpl-hg-x-0",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_tokens + len(token_ids),
        },
        "kv_transfer_params": None,
    }


def test_vllm_complete_request_and_parsing(tmp_path):
    fake = FakeVllm()
    cfg = RunConfig(run="r", model="/m/tiny", capture_points=[2, 4], hidden_size=4, out_url="x", num_layers=8)
    client = VllmClient(fake.url, cfg, str(tmp_path / "dump"), retries=1, backoff=0.01)
    try:
        params = GenParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=123, stop_token_ids=(4, 2))
        fake.answers = [
            (200, vllm_answer([11, 12, 4], "ab", "stop", 4)),  # a stop_token_id: in token_ids, not in text
            (200, vllm_answer([11, 2], "a", "stop", None)),  # the model's EOS: stop_reason None
            (200, vllm_answer([11, 12], "ab", "stop", 4)),  # a stop token left out of token_ids is appended
            (200, vllm_answer([11] * 8, "a" * 8, "length")),
            (
                400,
                {
                    "error": {
                        "message": "This model's maximum context length is 4096 tokens.",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
            ),
            (200, vllm_answer([11], "a", "abort")),
            (200, vllm_answer([11], "a", "repetition", "repetition_detected")),
        ]
        got = client.complete("hg-x-0", [1, 2, 3, 4, 5], params)
        assert got == Completion("hg-x-0", [11, 12, 4], "ab", "stop", 5)
        assert fake.requests[0] == {
            "path": "/v1/completions",
            "prompt": [1, 2, 3, 4, 5],
            "max_tokens": 8,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 123,
            "stop_token_ids": [4, 2],
            "skip_special_tokens": True,
            "return_token_ids": True,
            "request_id": "hg-x-0",
        }
        assert client.complete("hg-x-0", [1], params).tokens == [11, 2]
        assert client.complete("hg-x-0", [1], params).tokens == [11, 12, 4]
        got = client.complete("hg-x-0", [1], params)
        assert (got.finish_reason, len(got.tokens)) == ("length", 8)
        got = client.complete("hg-x-0", [1], params)
        assert isinstance(got, Rejected) and "maximum context length is 4096" in got.message
        with pytest.raises(EngineUnavailable, match="aborted"):
            client.complete("hg-x-0", [1], params)
        got = client.complete("hg-x-0", [1], params)
        assert isinstance(got, Rejected) and "repetition" in got.message
        fake.answers = [(503, {"error": {"message": "busy"}}), (503, {"error": {"message": "busy"}})]
        with pytest.raises(EngineUnavailable, match="busy"):
            client.complete("hg-x-0", [1], params)
    finally:
        client.close()
        fake.server.shutdown()
        fake.server.server_close()


def test_sglang_complete_appends_a_left_out_stop_token_and_maps_abort():
    """SGLang's answer shapes the reference engine never produces (same fake server)."""
    fake = FakeVllm()
    client = SGLangClient(fake.url, retries=0)
    meta = {"id": "hg-y-0", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    try:
        fake.answers = [
            (
                200,
                {
                    "text": "ab",
                    "output_ids": [11, 12],
                    "meta_info": {**meta, "finish_reason": {"type": "stop", "matched": 4}},
                },
            ),
            (
                200,
                {
                    "text": "a",
                    "output_ids": [11],
                    "meta_info": {**meta, "finish_reason": {"type": "abort", "message": "gone"}},
                },
            ),
        ]
        params = GenParams(max_new_tokens=4, temperature=0.5, top_p=0.8, seed=9, stop_token_ids=(4,))
        assert client.complete("hg-y-0", [1, 2, 3], params) == Completion("hg-y-0", [11, 12, 4], "ab", "stop", 3)
        assert fake.requests[0] == {
            "path": "/generate",
            "input_ids": [1, 2, 3],
            "rid": "hg-y-0",
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0.5,
                "top_p": 0.8,
                "sampling_seed": 9,
                "stop_token_ids": [4],
                "skip_special_tokens": True,
            },
        }
        with pytest.raises(EngineUnavailable, match="gone"):
            client.complete("hg-y-0", [1, 2, 3], params)
    finally:
        client.close()
        fake.server.shutdown()
        fake.server.server_close()
