"""`harvest audit`'s parts in process: the stratified choice, the comparison and its diagnoses, and
the reference engine's audit faults, which pass every check of the worker and which the
comparison names (tests/system/test_audit.py runs the whole command)."""

from __future__ import annotations

import pytest
import torch

from harvest.engines import faults as fx
from harvest.engines.reference import ReferenceEngine
from harvest.ids import rid_for
from harvest.ops.audit import Picked, pick
from harvest.ops.audit_compare import (
    DRIFT,
    MISALIGNED,
    OK,
    TOLERANCE,
    WRONG_LAYER,
    SampleResult,
    compare_point,
    compare_sample,
)
from harvest.ops.audit_record import status_line
from harvest.sample import Sample
from harvest.workers.claim import assemble, claim


def _committed(lengths: list[int]) -> list[Picked]:
    return [Picked(f"{i:032x}", "s" * 32, i, n) for i, n in enumerate(lengths)]


def test_pick_is_stratified_by_length_and_reproducible():
    # 90 short samples, 8 of 40-60 tokens, 2 long ones: a plain random 6 would rarely hold a long one
    samples = _committed([3 + i % 10 for i in range(90)] + [40 + i for i in range(8)] + [700, 900])
    chosen = pick(samples, 6, seed=5)
    assert len(chosen) == 6 and len({p.sample_id for p in chosen}) == 6
    strata = {p.tokens.bit_length() for p in chosen}
    assert {10, 6, 4} <= strata  # 512-1023 (the long ones), 32-63, 8-15 tokens: one each, longest first
    assert sum(p.tokens >= 700 for p in chosen) == 2  # the longest stratum gave both its samples in turn
    assert [p.tokens for p in chosen] == sorted(p.tokens for p in chosen)
    assert pick(samples, 6, seed=5) == chosen
    assert pick(list(reversed(samples)), 6, seed=5) == chosen  # the committed set decides, not its order
    assert any(pick(samples, 6, seed=s) != chosen for s in range(6, 12))
    assert pick(samples, 500, seed=1) == sorted(samples, key=lambda p: (p.tokens, p.sample_id))


def _states(t: int = 40, h: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)) * (1 + torch.arange(t)[:, None])


def test_compare_point_passes_rounding_and_names_each_kind_of_failure():
    r = _states()
    tol = TOLERANCE["fp32"]
    ok = compare_point(2, r * (1 + 1e-7), r, tol)
    assert (ok.reason, ok.bad_rows) == (OK, 0) and ok.rel < 2e-7 and ok.cos > 0.999999
    shifted = r.clone()
    shifted[11:20] = r[10:19]  # rows 11-19 hold their predecessors' states
    st = compare_point(2, shifted, r, tol)
    assert (st.reason, st.detail) == (MISALIGNED, "rows 11-19 hold the states of the position before them")
    assert set(st.worst_rows) <= set(range(11, 20)) and st.bad_rows == 9
    other = _states(seed=1)
    st = compare_point(2, other, r, tol, {2: r, 3: other, 4: _states(seed=2)})
    assert (st.reason, st.detail) == (WRONG_LAYER, "capture point 2 holds layer 3's states")
    noisy = r.clone()
    noise = torch.randn(10, 16, generator=torch.Generator().manual_seed(3))
    noisy[30:] += 1e-3 * r[30:].norm(dim=-1, keepdim=True) / 4 * noise  # a relative 1e-3 per row
    st = compare_point(2, noisy, r, tol)
    assert (st.reason, st.detail) == (DRIFT, "10 of 40 rows beyond the bound, rows 30-39")
    assert min(st.worst_rows) >= 30 and st.cos > 0.9999  # cosine alone would have passed it
    scaled = compare_point(2, r * 1.01, r, tol)
    assert scaled.reason == DRIFT and scaled.cos > 0.999999  # a wrong scale: cosine 1, relative error 1e-2


def _dump(engine: ReferenceEngine, tmp_path, samples: list[Sample], tag: str) -> dict[str, torch.Tensor]:
    """One /generate for `samples`; each sample's [T, K, H] through the worker's claim and verification."""
    rids = [rid_for(s.id, 1) for s in samples]
    engine.generate(rids, [s.input_ids.tolist() for s in samples])
    engine.writer.flush()
    mine = tmp_path / f"claimed-{tag}"
    mine.mkdir()
    claimed, failed = claim(
        engine.dump_dir, str(mine), {r: s.num_tokens for r, s in zip(rids, samples, strict=False)}, timeout=5
    )
    assert failed == {}
    return {
        s.id: assemble(claimed[r], s, engine.capture_points, torch.float32).hidden_states
        for r, s in zip(rids, samples, strict=False)
    }


def test_audit_faults_pass_the_workers_checks_and_the_comparison_names_them(tiny_model, tmp_path, monkeypatch):
    samples = [Sample.build(list(range(5 + i, 25 + i))) for i in range(4)]  # 20 tokens each: 3 chunks of 8
    clean = ReferenceEngine(tiny_model, str(tmp_path / "clean"), layers="2,4,8", chunked_prefill_size=8)
    want = _dump(clean, tmp_path, samples, "clean")
    monkeypatch.setenv(fx.ENV, "shift-chunk:1,wrong-layer:1,perturb:1")
    faulty = ReferenceEngine(tiny_model, str(tmp_path / "faulty"), layers="2,4,8", chunked_prefill_size=8)
    got = _dump(faulty, tmp_path, samples, "faulty")  # assemble raised nothing: tokens, coverage, finite all pass
    with torch.no_grad():
        every = faulty.model(torch.tensor([samples[1].input_ids.tolist()]), output_hidden_states=True).hidden_states
    layers = {p: h[0] for p, h in enumerate(every)}
    res = [
        compare_sample(
            SampleResult(s.id, "x", 20), [2, 4, 8], got[s.id], want[s.id], TOLERANCE["fp32"], layers if i == 1 else None
        )
        for i, s in enumerate(samples)
    ]
    assert [(r.outcome, r.detail) for r in res] == [
        (MISALIGNED, "rows 9-15 hold the states of the position before them (every capture point)"),
        (WRONG_LAYER, "capture point 2 holds layer 3's states"),
        (DRIFT, "10 of 20 rows beyond the bound, rows 10-19 (every capture point)"),
        (OK, ""),
    ]
    alone = _dump(faulty, tmp_path, samples[2:3], "alone")  # perturb needs company: alone, it is right
    assert torch.equal(alone[samples[2].id], want[samples[2].id])


def test_status_line_says_when_how_and_the_verdict():
    assert status_line(None, "r1") == "  audit    never (harvest audit --run r1)"
    doc = {
        "verdict": "fail",
        "at": 0,
        "route": "hf",
        "samples": 25,
        "seed": 7,
        "worst_rel": 0.98,
        "tolerance": 1e-4,
        "outcomes": {"ok": 22, "drift": 1, "misaligned": 2},
        "requeued": ["a"],
    }
    line = status_line(doc, "r1")
    assert line.startswith("  audit    fail ") and line.endswith(
        ", against hf, 25 samples (seed 7), worst relative error 9.8e-01 (bound 1.00e-04): 1 drift, 2 misaligned; "
        "1 requeued"
    )


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp8_e4m3"])
def test_every_storage_dtype_has_a_bound_above_its_rounding(dtype):
    from harvest.formats.dtypes import STORAGE_DTYPES
    from harvest.formats.fp8 import to_storage

    assert set(TOLERANCE) == set(STORAGE_DTYPES)
    x = _states(t=64, h=256, seed=4)[:, None, :]
    stored, scale = to_storage(x, getattr(torch, STORAGE_DTYPES[dtype]))
    back = stored.to(torch.float32) if scale is None else stored.to(torch.float32) * scale[..., None]
    st = compare_point(0, back[:, 0], x[:, 0], TOLERANCE[dtype])
    assert st.reason == OK and st.rel < TOLERANCE[dtype] / 1.5, (dtype, st.rel)
