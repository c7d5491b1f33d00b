"""What `harvest audit` measures: a stored sample against a second computation, per capture point,
with the bound each storage dtype allows and a diagnosis of what a failure looks like.

The measure is each row's (token's) relative error, `|s - r| / |r|` over the hidden dimension:
scale-free, so a capture point deep in the residual stream (large norms) and the normalized final
state get one bound, and an attention-sink token (a huge norm) does not hide the others. Cosine
similarity is reported beside it but decides nothing: for an error perpendicular to the row it is
`1 - e^2/2` (no power at these bounds), and a wrong scale leaves it at 1.

The bound per storage dtype (docs/architecture.md, "Auditing a run", says how they were chosen):
the storage format's own rounding (its unit roundoff u, per element, so per row at most u) plus
what a second pass legitimately differs by (another batch, other chunk boundaries, other kernels):
tiny in fp32, a few units of bf16's u at depth in half precision.

Failures are told apart by their shape, which names the likely bug:
- `misaligned`: the failing rows equal the recomputed rows one position over (row i holds i-1's
  states): hidden states cut or stitched at the wrong offset (chunked prefill, batching);
- `wrong-layer`: the whole capture point equals another layer's recomputed states: a capture hook
  on the wrong module, an off-by-one in layer ids;
- `drift`: anything else beyond the bound (batch-variant kernels, a wrong dtype, a broken model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are: `harvest status` imports none of it
    import torch

# storage dtype -> the largest relative error of a row that passes (see the module docstring)
TOLERANCE: dict[str, float] = {
    "fp32": 1e-4,  # stored exactly; two fp32 passes in other orders differ by ~1e-6
    "fp16": 2e-2,  # u = 2^-11 = 4.9e-4 stored, plus ~1e-2 of half-precision recompute variation
    "bf16": 5e-2,  # u = 2^-8 = 3.9e-3 stored, plus 1-4e-2 of bf16 recompute variation at depth
    "fp8_e4m3": 1.25e-1,  # the quantizer: 3 mantissa bits, u = 2^-4 = 6.25e-2 per element (per-row
    # scales, harvest.formats.fp8), plus the bf16 pass it was computed by
}
WORST_ROWS = 3  # positions named per capture point
OK, DRIFT, MISALIGNED, WRONG_LAYER = "ok", "drift", "misaligned", "wrong-layer"
CORRUPT, UNCHECKED = "corrupt", "unchecked"  # stored bytes fail their crc32s; the route could not recompute it
OUTCOMES = (OK, DRIFT, MISALIGNED, WRONG_LAYER, CORRUPT, UNCHECKED)
_SPECIFIC = (MISALIGNED, WRONG_LAYER, DRIFT)  # a sample's reason: the most specific of its points'


@dataclass
class PointStats:
    """One capture point of one sample (or the worst over several samples)."""

    point: int
    max_abs: float
    rel: float  # the largest row relative error
    cos: float  # the smallest row cosine similarity
    worst_rows: list[int] = field(default_factory=list)  # positions, worst first
    bad_rows: int = 0  # rows beyond the bound
    reason: str = OK
    detail: str = ""

    def line(self) -> str:
        rows = ", ".join(map(str, self.worst_rows))
        return (
            f"point {self.point}: max abs {self.max_abs:.2e}  rel {self.rel:.2e}  cos {self.cos:.6f}  worst rows {rows}"
        )

    def to_dict(self) -> dict:
        return {
            "point": self.point,
            "max_abs": self.max_abs,
            "rel": self.rel,
            "cos": self.cos,
            "worst_rows": self.worst_rows,
            "bad_rows": self.bad_rows,
            "reason": self.reason,
            "detail": self.detail,
        }


def _rows(s: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: relative error, cosine similarity, max abs difference (`s`, `r`: [T, H] float32)."""
    diff = s - r
    rn = r.norm(dim=-1)
    rel = diff.norm(dim=-1) / rn.clamp_min(1e-30)
    cos = (s * r).sum(-1) / (s.norm(dim=-1) * rn).clamp_min(1e-30)
    return rel, cos, diff.abs().amax(-1)


def _ranges(rows: list[int]) -> str:
    """Positions as ranges: `65-127, 130`."""
    out, start = [], None
    for i, p in enumerate(rows):
        if start is None:
            start = p
        if i + 1 == len(rows) or rows[i + 1] != p + 1:
            out.append(f"{start}-{p}" if p > start else f"{p}")
            start = None
    return ", ".join(out)


def _shifted(s: torch.Tensor, r: torch.Tensor, bad: torch.Tensor, tol: float) -> int:
    """+1 if every bad row i holds the recomputed row i-1 (-1: row i+1), else 0."""
    rows = bad.nonzero().flatten()
    for d in (1, -1):
        src = rows - d
        if len(rows) and bool(((src >= 0) & (src < len(r))).all()):
            rel, _, _ = _rows(s[rows], r[src])
            if bool((rel <= tol).all()):
                return d
    return 0


def compare_point(
    point: int,
    stored: torch.Tensor,
    recomputed: torch.Tensor,
    tol: float,
    others: Mapping[int, torch.Tensor] | None = None,
) -> PointStats:
    """One capture point: `stored` and `recomputed` [T, H] (any float dtype); `others`: recomputed
    states of other layers (HF index -> [T, H]) that a wrong-layer capture may match."""
    import torch

    s, r = stored.to(torch.float32), recomputed.to(torch.float32)
    rel, cos, abs_ = _rows(s, r)
    order = torch.argsort(rel, descending=True, stable=True)[:WORST_ROWS]
    bad = rel > tol
    st = PointStats(
        point, float(abs_.max()), float(rel.max()), float(cos.min()), [int(i) for i in order], int(bad.sum())
    )
    if not st.bad_rows:
        return st
    d = _shifted(s, r, bad, tol)
    if d:
        st.reason = MISALIGNED
        st.detail = (
            f"rows {_ranges(bad.nonzero().flatten().tolist())} hold the states of the position "
            f"{'before' if d > 0 else 'after'} them"
        )
        return st
    for q, other in sorted((others or {}).items()):
        if q != point and other.shape == r.shape and bool((_rows(s, other.to(torch.float32))[0] <= tol).all()):
            st.reason, st.detail = WRONG_LAYER, f"capture point {point} holds layer {q}'s states"
            return st
    st.reason = DRIFT
    rows = _ranges(sorted(bad.nonzero().flatten().tolist()))
    st.detail = f"{st.bad_rows} of {len(r)} rows beyond the bound, rows {rows}"
    return st


@dataclass
class SampleResult:
    """One audited sample: its outcome, and per capture point what was measured."""

    sample_id: str
    shard_id: str
    tokens: int
    outcome: str = OK
    detail: str = ""
    points: list[PointStats] = field(default_factory=list)

    @property
    def bad(self) -> bool:
        return self.outcome in (DRIFT, MISALIGNED, WRONG_LAYER, CORRUPT)

    def to_dict(self) -> dict:
        return {
            "sample": self.sample_id,
            "shard": self.shard_id,
            "tokens": self.tokens,
            "outcome": self.outcome,
            "detail": self.detail,
            "points": [p.to_dict() for p in self.points],
        }


def compare_sample(
    result: SampleResult,
    points: Sequence[int],
    stored: torch.Tensor,
    recomputed: torch.Tensor,
    tol: float,
    layers: Mapping[int, torch.Tensor] | None = None,
) -> SampleResult:
    """Fill `result` from `stored` and `recomputed` [T, K, H] (K = `points`); `layers`: every
    recomputed layer the route has (HF: all of them; else the capture points themselves)."""
    if stored.shape != recomputed.shape:
        result.outcome = DRIFT
        result.detail = f"stored shape {tuple(stored.shape)}, recomputed {tuple(recomputed.shape)}"
        return result
    others = dict(layers) if layers is not None else {p: recomputed[:, k] for k, p in enumerate(points)}
    result.points = [compare_point(p, stored[:, k], recomputed[:, k], tol, others) for k, p in enumerate(points)]
    failing = [p for p in result.points if p.reason != OK]
    if failing:
        reason = next(r for r in _SPECIFIC if any(p.reason == r for p in failing))
        these = [p for p in failing if p.reason == reason]
        where = (
            "every capture point"
            if len(these) == len(points)
            else "capture point" + "s" * (len(these) > 1) + " " + ", ".join(str(p.point) for p in these)
        )
        result.outcome = reason
        result.detail = f"{these[0].detail} ({where})" if reason != WRONG_LAYER else these[0].detail
    return result


def worst_by_point(results: Sequence[SampleResult], points: Sequence[int]) -> list[PointStats]:
    """Per capture point, the worst figures over the samples (rows of the sample with the worst row)."""
    out = []
    for k, p in enumerate(points):
        got = [r.points[k] for r in results if len(r.points) == len(points)]
        if not got:
            continue
        worst = max(got, key=lambda s: s.rel)
        out.append(
            PointStats(
                p,
                max(s.max_abs for s in got),
                worst.rel,
                min(s.cos for s in got),
                worst.worst_rows,
                sum(s.bad_rows for s in got),
            )
        )
    return out
