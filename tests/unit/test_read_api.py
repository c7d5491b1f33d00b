"""harvest.read's public API: the names `__all__` promises, and a run read with neither Redis nor
RQ importable (a trainer's machine needs only the output folder). The run is committed here by
the real collector; the reading happens in a fresh interpreter whose imports of `redis` and `rq`
fail."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

import harvest.read
from harvest.collector.collector import Collector
from harvest.state.ledger import Ledger
from harvest.state.runstore import publish_run
from tests.support.cli import REPO
from tests.support.synth import make_config, spool_samples

PUBLIC = [
    "RunReader",
    "hidden_at",
    "HiddenStateDataset",
    "HiddenStateIterable",
    "eagle3_item",
    "export_run",
    "ExportReport",
    "EXPORT_FORMATS",
    "ConfigError",
    "ShardError",
    "CorruptSample",
    "UnreadableShard",
    "NoFinalState",
    "ExportError",
    "FeedStalled",
]


def test_all_names_the_public_reading_api_and_each_resolves():
    assert harvest.read.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(harvest.read, name) is not None, name
        assert name in dir(harvest.read)
    assert issubclass(harvest.read.CorruptSample, harvest.read.ShardError)
    assert issubclass(harvest.read.UnreadableShard, harvest.read.ShardError)
    ns: dict = {}
    exec("from harvest.read import *", ns)
    assert set(PUBLIC) <= set(ns)
    try:
        harvest.read.not_a_public_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_public_name" in str(e)
    else:
        raise AssertionError("an unknown name resolved")


# Runs in a fresh interpreter: `redis` and `rq` cannot be imported there at all.
READ_WITHOUT_REDIS = textwrap.dedent("""
    import json, sys

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("redis", "rq"):
                raise ImportError(f"{name} is blocked: reading a run must not need it")
            return None

    sys.meta_path.insert(0, Blocked())
    import harvest.read as hr
    light = "torch" not in sys.modules  # `import harvest.read` alone loads nothing heavy
    url, dest = sys.argv[1], sys.argv[2]
    r = hr.RunReader(url)
    samples = {}
    for sid in r.sample_ids:
        s = r.get(sid)
        samples[sid] = {"input_ids": s["input_ids"].tolist(), "loss_mask": s["loss_mask"].tolist(),
                        "hidden_states": s["hidden_states"].float().tolist(),
                        "final": hr.hidden_at(s, r.config.final_point).float().tolist()}
    items = [tuple(x["aux_hidden_state"].shape) for x in hr.HiddenStateIterable(url)]
    ds = hr.HiddenStateDataset(url)
    report = hr.export_run(url, "specforge", dest, progress=False)
    try:
        hr.RunReader(url + "-missing")
        missing = None
    except hr.ConfigError as e:
        missing = str(e)
    print(json.dumps({
        "light": light, "shards": r.shard_ids(), "samples": samples, "items": items, "dataset": len(ds),
        "exported": report.written, "corrupt": len(report.corrupt), "missing": missing,
        "redis": sorted(m for m in sys.modules if m.split(".")[0] in ("redis", "rq")),
    }))
""")


def test_a_run_is_read_without_redis_or_rq(conn, tmp_path):
    cfg = publish_run(conn, make_config(f"file://{tmp_path / 'out'}"))
    spool = str(tmp_path / "spool")
    samples = {s.id: s for s in spool_samples(spool, cfg, [5, 9, 3, 7])}
    ledger = Ledger(conn, cfg.run)
    ledger.add_queued(list(samples))
    ledger.mark_spooled(list(samples))
    collector = Collector(conn, cfg, spool, node="n1", shard_bytes=3000)
    while collector.step(force=True):
        pass
    url = f"{cfg.out_url}/{cfg.run}"

    proc = subprocess.run(
        [sys.executable, "-c", READ_WITHOUT_REDIS, url, str(tmp_path / "export")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    assert got["redis"] == [] and got["light"]
    assert len(got["shards"]) > 1  # shard_bytes=3000: the reader crosses shards
    assert sorted(got["samples"]) == sorted(samples)
    final = cfg.capture_points.index(cfg.final_point)
    for sid, s in samples.items():
        read = got["samples"][sid]
        assert read["input_ids"] == s.input_ids.tolist() and read["loss_mask"] == s.loss_mask.tolist()
        assert torch.equal(torch.tensor(read["hidden_states"]), s.hidden_states.float())
        assert torch.equal(torch.tensor(read["final"]), s.hidden_states[:, final].float())
    aux = 3 * cfg.hidden_size
    assert sorted(got["items"]) == sorted([s.num_tokens, aux] for s in samples.values())
    assert got["dataset"] == len(samples) and got["exported"] == len(samples) and got["corrupt"] == 0
    assert "run.json not found: not a harvest run output" in got["missing"]
