"""The torch datasets over a committed run: EAGLE-3 items, map-style and iterable, across
DataLoader worker processes, with dtype choice."""

import pytest
import torch
from torch.utils.data import DataLoader

from harvest.collector.collector import Collector
from harvest.config import RunConfig
from harvest.formats.fp8 import dequantize
from harvest.read.dataset import HiddenStateDataset
from harvest.read.eagle3 import NoFinalState, eagle3_item
from harvest.read.feed import HiddenStateIterable
from harvest.read.reader import RunReader
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.synth import make_config, spool_samples


def _run(conn, tmp_path, dtype="bf16", lengths=(5, 9, 1, 30, 12, 7, 3)):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}", dtype=dtype))
    spool = str(tmp_path / "spool")
    samples = spool_samples(spool, cfg, list(lengths))
    Ledger(conn, "r").add_queued([s.id for s in samples])
    Ledger(conn, "r").mark_spooled([s.id for s in samples])  # as the worker does after writing them
    c = Collector(conn, cfg, spool, node="n1", shard_bytes=3000)
    while c.step(force=True):
        pass
    return cfg, {s.id: s for s in samples}


def _expect(s, cfg, dtype=None):
    hs = s.hidden_states if s.hidden_scale is None else dequantize(s.hidden_states, s.hidden_scale, torch.bfloat16)
    if dtype is not None:
        hs = hs.to(dtype)
    return {
        "input_ids": s.input_ids.long(),
        "loss_mask": s.loss_mask.long(),
        "hidden_state": hs[:, 3],  # capture points [2, 4, 5, 8]: 8 is the final state
        "aux_hidden_state": torch.cat([hs[:, 0], hs[:, 1], hs[:, 2]], dim=-1),
    }


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_map_style_dataset_yields_eagle3_items_in_storage_order(conn, tmp_path):
    cfg, samples = _run(conn, tmp_path)
    ds = HiddenStateDataset(cfg.out_url + "/r")
    assert len(ds) == 7 and sorted(ds.sample_ids) == sorted(samples)
    for i, sid in enumerate(ds.sample_ids):
        item = ds[i]
        assert item["hidden_state"].shape == (samples[sid].num_tokens, 16)
        assert item["aux_hidden_state"].shape == (samples[sid].num_tokens, 48)
        _same(item, _expect(samples[sid], cfg))
    f32 = HiddenStateDataset(cfg.out_url + "/r", dtype=torch.float32)
    _same(f32[2], _expect(samples[f32.sample_ids[2]], cfg, torch.float32))
    got = [b["input_ids"] for b in DataLoader(ds, batch_size=None, num_workers=2, shuffle=False)]
    assert [t.tolist() for t in got] == [samples[s].input_ids.long().tolist() for s in ds.sample_ids]


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_yields_each_sample_once_across_workers_and_ranks(conn, tmp_path, workers):
    cfg, samples = _run(conn, tmp_path, dtype="fp8_e4m3")
    assert len(RunReader(cfg.out_url + "/r").shard_ids()) >= 3
    seen = []
    for rank in range(2):
        ds = HiddenStateIterable(cfg.out_url + "/r", seed=7, rank=rank, world_size=2)
        for item in DataLoader(ds, batch_size=None, num_workers=workers):
            sid = next(k for k, s in samples.items() if torch.equal(s.input_ids.long(), item["input_ids"]))
            _same(item, _expect(samples[sid], cfg))  # fp8 dequantized to bf16 by default
            seen.append(sid)
    assert sorted(seen) == sorted(samples)


def test_run_without_final_state_is_refused_with_the_fix():
    cfg = RunConfig(run="r", model="m", capture_points=[2, 4], hidden_size=4, out_url="x", num_layers=8)
    with pytest.raises(
        NoFinalState,
        match=r"run 'r' captured layers \[2, 4\] of a 8-layer model, not the final hidden "
        r"state \(index 8\): re-run with --layers eagle3",
    ):
        eagle3_item({"hidden_states": torch.zeros(1, 2, 4)}, cfg)
