"""fp8 e4m3 storage with a per-token, per-capture-point scale: quantization bounds, and the
whole path dump -> assemble -> spool -> shard -> reader with the exact scales carried along."""

import numpy as np
import torch

from harvest.collector.collector import Collector
from harvest.formats.dump import Chunk, write_chunk
from harvest.formats.fp8 import FP8, FP8_MAX, dequantize, quantize
from harvest.formats.spool import read_sample
from harvest.ids import rid_for
from harvest.node.spooldir import spool_path, write_sample
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from harvest.workers.claim import assemble, claim
from tests.support.synth import POINTS, make_config


def _hidden(t=37, h=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes differing by orders between tokens and capture points, like a residual stream
    x = torch.randn(t, len(POINTS), h, generator=g)
    x *= torch.logspace(-3, 3, t).reshape(t, 1, 1) * torch.tensor([1.0, 10.0, 100.0, 0.5]).reshape(1, -1, 1)
    x[5, 2] = 0  # an all-zero row
    return x


def test_quantize_scale_is_exact_and_error_is_within_e4m3_precision():
    x = _hidden()
    q, scale = quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    amax = x.abs().amax(dim=-1)
    expect = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    assert torch.equal(scale, expect) and scale[5, 2] == 1.0
    assert torch.equal(q.to(torch.float32).abs().amax(dim=-1)[amax > 0], torch.full_like(amax[amax > 0], FP8_MAX))
    back = dequantize(q, scale, torch.float32)
    # e4m3: 3 mantissa bits (relative rounding error <= 2^-4), subnormal step 2^-9 (times the scale)
    bound = x.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-10
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[5, 2], torch.zeros(64))


def test_fp8_through_assemble_spool_shard_and_reader(conn, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", dtype="fp8_e4m3", hidden=64))
    dump, claimed, spool = tmp_path / "dump", tmp_path / "claimed", str(tmp_path / "spool")
    dump.mkdir()
    claimed.mkdir()
    x = _hidden()
    sample = Sample.build(list(range(100, 137)))
    rid = rid_for(sample.id, 1)
    for a, b in [(0, 16), (16, 37)]:  # two prefill chunks
        write_chunk(
            str(dump), Chunk(rid, a, b, torch.tensor(sample.input_ids[a:b].astype(np.int64)), x[a:b]), POINTS, "m"
        )
    ok, failed = claim(str(dump), str(claimed), {rid: 37}, timeout=1)
    assert failed == {}
    s = assemble(ok[rid], sample, POINTS, cfg.torch_dtype)
    q, scale = quantize(x)
    assert s.hidden_states.dtype == FP8 and torch.equal(s.hidden_states.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(s.hidden_scale, scale)
    write_sample(spool, s, cfg.run)
    back = read_sample(spool_path(spool, s.id))
    assert torch.equal(back.hidden_scale, scale)
    Ledger(conn, "r").add_queued([s.id])
    Ledger(conn, "r").mark_spooled([s.id])  # as the worker does after writing it
    Collector(conn, cfg, spool, node="n1").step(force=True)

    reader = RunReader(cfg.out_url + "/r")
    raw = reader.get(s.id)
    assert raw["hidden_states"].dtype == FP8 and torch.equal(
        raw["hidden_states"].view(torch.uint8), q.view(torch.uint8)
    )
    assert torch.equal(raw["hidden_scale"], scale)
    up = reader.get(s.id, torch.float32)
    assert "hidden_scale" not in up and torch.equal(up["hidden_states"], dequantize(q, scale, torch.float32))
    assert ((up["hidden_states"] - x).abs() <= x.abs() * 2**-4 + scale.unsqueeze(-1) * 2**-10).all()
    assert torch.equal(reader.get(s.id, torch.bfloat16)["hidden_states"], dequantize(q, scale, torch.bfloat16))
