"""`harvest run` end to end: real redis-server, reference engine chunking at 64 tokens, two
workers, a collector, file:// output; every sample checked against an independent HF forward."""

import hashlib
import os

import torch

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.config import eagle3_layers
from harvest.ids import sample_id
from harvest.read.reader import RunReader, hidden_at
from tests.support.cli import harvest_cli
from tests.support.expected import expected_tokens


def _files(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = (hashlib.sha256(open(p, "rb").read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def test_harvest_run_end_to_end_matches_hf_forward(tmp_path, tiny_model, tokenizer):
    import numpy as np
    from transformers import AutoModelForCausalLM

    rows = demo_rows(40)
    dataset = write_jsonl(str(tmp_path / "mixed.jsonl"), rows)
    expected = {}
    for r in rows:
        ids, mask = expected_tokens(tokenizer, r)
        expected[sample_id(np.array(ids), np.array(mask))] = (ids, mask)
    lengths = sorted(len(v[0]) for v in expected.values())
    assert len(expected) >= 30 and lengths[0] == 1 and lengths[-1] >= 300
    assert {"text", "messages", "input_ids"} <= {k for r in rows for k in r}
    assert any(sum(m["role"] == "assistant" for m in r.get("messages", [])) > 1 for r in rows)

    out = tmp_path / "out"
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--run",
        "mixed",
        "--dtype",
        "fp32",
        "--workers",
        "2",
        "--chunked-prefill-size",
        "64",
        "--no-progress",
        "--dump-dir",
        str(tmp_path / "dumps"),
    ]
    res = harvest_cli(*args, "--work-dir", str(tmp_path / "work1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"samples: {len(expected)} done, 0 failed ({len(expected)} enqueued now, 0 already known)" in res.stdout

    reader = RunReader(f"file://{out}/mixed")
    assert sorted(reader.sample_ids) == sorted(expected)  # each exactly once (the reader refuses duplicates)
    points = eagle3_layers(8)
    assert reader.capture_points == points
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    worst = 0.0
    for sid, (ids, mask) in expected.items():
        got = reader.get(sid)
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == mask
        assert got["hidden_states"].shape == (len(ids), len(points), 64)
        assert got["hidden_states"].dtype == torch.float32
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for p in points:
            worst = max(worst, (hidden_at(got, p) - ref[p][0]).abs().max().item())
    assert worst <= 1e-5, worst
    assert os.listdir(tmp_path / "dumps") == []  # every dump claimed and deleted

    # Second run, fresh work dir (so a fresh private Redis): the ledger is rebuilt from the
    # index files, nothing is enqueued and no output file changes.
    before = _files(out)
    res2 = harvest_cli(*args, "--work-dir", str(tmp_path / "work2"))
    assert res2.returncode == 0, res2.stdout + res2.stderr
    assert f"samples: {len(expected)} done, 0 failed (0 enqueued now, {len(expected)} already known)" in res2.stdout
    assert _files(out) == before
