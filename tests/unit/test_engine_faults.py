"""The reference engine's test-only fault switches, and what the worker's verification makes
of each: every injected fault must surface as a failure whose reason names the cause."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from harvest.engines import faults as fx
from harvest.engines.reference import ReferenceEngine, serve
from harvest.ids import rid_for
from harvest.sample import Sample
from harvest.state.failures import SampleFailure
from harvest.workers.claim import assemble, claim


def _engine(tiny_model, tmp_path, monkeypatch, spec: str, chunk: int = 8) -> ReferenceEngine:
    monkeypatch.setenv(fx.ENV, spec)
    return ReferenceEngine(tiny_model, str(tmp_path / "dump"), layers="2,4,8", chunked_prefill_size=chunk)


def _extract(engine: ReferenceEngine, tmp_path, samples: list[Sample]):
    """One /generate for `samples`, then the worker's claim and verification of each."""
    rids = [rid_for(s.id, 1) for s in samples]
    out = engine.generate(rids, [s.input_ids.tolist() for s in samples])
    engine.writer.flush()
    claim_dir = tmp_path / "claimed"
    claim_dir.mkdir(exist_ok=True)
    claimed, failed = claim(
        engine.dump_dir, str(claim_dir), {r: s.num_tokens for r, s in zip(rids, samples, strict=False)}, timeout=0.2
    )
    results = {}
    for r, s in zip(rids, samples, strict=False):
        if r in failed:
            results[s.id] = failed[r].reason
            continue
        try:
            assemble(claimed[r], s, [2, 4, 8], torch.float32)
            results[s.id] = "ok"
        except SampleFailure as e:
            results[s.id] = e.reason
    return out, results


def _samples(n: int) -> list[Sample]:
    return [Sample.build(list(range(10 + i, 30 + i))) for i in range(n)]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [("drop-chunk:1", "incomplete-dump"), ("bad-ids:1", "token-mismatch"), ("nan:1", "nonfinite")],
)
def test_dump_faults_fail_only_the_hit_sample_with_their_reason(tiny_model, tmp_path, monkeypatch, spec, reason):
    engine = _engine(tiny_model, tmp_path, monkeypatch, spec)
    samples = _samples(3)
    _, results = _extract(engine, tmp_path, samples)
    assert [results[s.id] for s in samples] == [reason, "ok", "ok"]
    # a count-limited fault is spent: the retry of the same sample succeeds
    _, again = _extract(engine, tmp_path, samples[:1])
    assert again == {samples[0].id: "ok"}


def test_permanent_fault_hits_every_time(tiny_model, tmp_path, monkeypatch):
    engine = _engine(tiny_model, tmp_path, monkeypatch, "nan")
    samples = _samples(2)
    for _ in range(2):
        _, results = _extract(engine, tmp_path, samples)
        assert set(results.values()) == {"nonfinite"}


def test_several_faults_hit_different_requests(tiny_model, tmp_path, monkeypatch):
    engine = _engine(tiny_model, tmp_path, monkeypatch, "drop-chunk:1,bad-ids:1,nan:1")
    samples = _samples(4)
    _, results = _extract(engine, tmp_path, samples)
    assert [results[s.id] for s in samples] == ["incomplete-dump", "token-mismatch", "nonfinite", "ok"]


def test_cached_fault_reports_cached_tokens(tiny_model, tmp_path, monkeypatch):
    engine = _engine(tiny_model, tmp_path, monkeypatch, "cached:1")
    samples = _samples(2)
    out, _ = _extract(engine, tmp_path, samples)
    assert [o["meta_info"]["cached_tokens"] for o in out] == [10, 0]


def test_warmup_requests_are_never_faulted_nor_dumped(tiny_model, tmp_path, monkeypatch):
    engine = _engine(tiny_model, tmp_path, monkeypatch, "nan,drop-chunk,bad-ids,cached")
    out = engine.generate(["warmup-1"], [[5, 6, 7]])
    engine.writer.flush()
    assert out[0]["meta_info"]["cached_tokens"] == 0
    assert [p.name for p in (tmp_path / "dump").iterdir()] == []


def test_http_faults(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(fx.ENV_HANG_S, "2")
    engine = _engine(tiny_model, tmp_path, monkeypatch, "http500:1,hang:1")
    server = serve(engine, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/generate"
    body = {"input_ids": [[5, 6, 7]], "rid": ["warm-0"], "sampling_params": {"max_new_tokens": 1}}
    try:
        r = httpx.post(url, json=body, timeout=30)
        assert (r.status_code, r.json()) == (500, {"error": {"message": "injected fault: http500"}})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.5)
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200 and r.json()[0]["meta_info"]["prompt_tokens"] == 3
    finally:
        server.shutdown()
        server.server_close()


def test_unknown_fault_is_refused():
    with pytest.raises(ValueError, match=r"HARVEST_ENGINE_FAULTS: unknown fault 'oom'; known: http500, hang"):
        fx.Faults("nan:1,oom")
    with pytest.raises(ValueError, match=r"HARVEST_ENGINE_FAULTS: 'nan:x': the count must be an integer"):
        fx.Faults("nan:x")
