"""`harvest run --regenerate` end to end on the reference engine: the tiny model (random, non-unit
norms) writes every chat's assistant turns, turn by turn, and the regenerated conversations are
extracted. Checked against an independent route: transformers' own chat template rendering and
HF `generate` (greedy, fp32), turn by turn, then an HF forward over the whole conversation; the
generated dataset read back from its committed Parquet files; a rerun changes nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harvest.cli.demo import write_jsonl
from harvest.config import eagle3_layers
from harvest.read.generated import iter_generated
from harvest.read.reader import RunReader, hidden_at
from tests.support.cli import harvest_cli
from tests.support.expected import expected_regenerated

MAX_NEW = 6
CHATS = [
    [{"role": "user", "content": "the first question"}, {"role": "assistant", "content": "an answer to drop"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "two turns, please"},
        {"role": "assistant", "content": "old one"},
        {"role": "user", "content": "and the second"},
        {"role": "assistant", "content": "old two"},
    ],
    [{"role": "user", "content": "a chat that ends on the user"}],  # one answer to write
    [
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
        {"role": "assistant", "content": "e"},
    ],
]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def test_regenerated_turns_equal_hf_generate_and_their_states_an_hf_forward(tmp_path, tiny_model, tokenizer, hf_model):
    dataset = write_jsonl(str(tmp_path / "chats.jsonl"), [{"messages": m} for m in CHATS])
    out = tmp_path / "out"
    args = [
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
        "--workers",
        "2",
        "--chunked-prefill-size",
        "16",
        "--no-progress",
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--regenerate",
        "--max-new-tokens",
        str(MAX_NEW),
        "--on-length",
        "keep",
    ]
    res = harvest_cli(*args, "--work-dir", str(tmp_path / "work"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"samples: {len(CHATS)} done, 0 failed" in res.stdout
    turns = sum(max(1, sum(m["role"] == "assistant" for m in c)) for c in CHATS)
    assert f"  generated: {len(CHATS)} conversations written, {turns * MAX_NEW} tokens (the engine's" in res.stdout

    reader = RunReader(f"file://{out}/regen")
    assert reader.config.regenerate == {
        "max_new_tokens": MAX_NEW,
        "temperature": 0.0,
        "top_p": 1.0,
        "on_length": "keep",
        "context": 4096,
    }
    generated = {g["id"]: g for g in iter_generated(f"file://{out}/regen")}
    assert sorted(generated) == sorted(reader.sample_ids)
    points = eagle3_layers(8)
    by_first_user = {
        g["messages"][0]["content"] if g["messages"][0]["role"] != "system" else g["messages"][1]["content"]: g
        for g in generated.values()
    }
    worst = 0.0
    for messages in CHATS:
        ids, mask, turns = expected_regenerated(tokenizer, hf_model, messages, MAX_NEW)
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        g = by_first_user[first_user]
        got = reader.get(g["id"])
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == mask  # exactly the generated tokens
        assert [t["tokens"] for t in g["turns"]] == turns
        assert all(t["finish_reason"] == ("stop" if t["tokens"][-1] in (2, 4) else "length") for t in g["turns"])
        assert [m["role"] for m in g["messages"]] == [m["role"] for m in messages] + (
            [] if messages[-1]["role"] == "assistant" else ["assistant"]
        )
        answers = [m["content"] for m in g["messages"] if m["role"] == "assistant"]
        assert answers == [tokenizer.decode(t, skip_special_tokens=True) for t in turns]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for p in points:
            worst = max(worst, (hidden_at(got, p) - ref[p][0]).abs().max().item())
    assert worst <= 1e-5, worst

    # The same command again, a fresh work dir (a fresh Redis): nothing is generated again, no file changes.
    files = {p: os.path.getmtime(os.path.join(d, p)) for d, _, ps in os.walk(out) for p in ps}
    res = harvest_cli(*args, "--work-dir", str(tmp_path / "work2"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"samples: {len(CHATS)} done, 0 failed (0 enqueued now, {len(CHATS)} already known)" in res.stdout
    assert {p: os.path.getmtime(os.path.join(d, p)) for d, _, ps in os.walk(out) for p in ps} == files

    # `harvest audit`: a regenerated sample keeps its conversation's id, which no hash of its tokens gives;
    # the audit checks its bytes and states all the same.
    from harvest.cli.redisproc import RedisServer

    with RedisServer(str(tmp_path / "work" / "redis")) as server:
        res = harvest_cli(
            "audit",
            "--run",
            "regen",
            "--redis",
            server.url,
            "--samples",
            str(len(CHATS)),
            "--seed",
            "1",
            "--against",
            "hf",
            "--no-progress",
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-2] == f"verdict: pass: {len(CHATS)} of {len(CHATS)} samples within the bound", (
        res.stdout
    )

    dest = tmp_path / "generated.jsonl"
    res = harvest_cli("generated", "--run-url", f"file://{out}/regen", str(dest))
    assert res.returncode == 0 and f"wrote {len(CHATS)} conversations to {dest}" in res.stdout, res.stdout + res.stderr
    assert sorted(json.loads(line)["id"] for line in dest.read_text().splitlines()) == sorted(generated)
    res = harvest_cli("generated", "--run-url", str(tmp_path / "nowhere"), str(tmp_path / "none.jsonl"))
    assert (
        res.returncode == 2
        and res.stderr == f"harvest: error: {tmp_path}/nowhere/run.json not found: not a harvest run output\n"
    )
    assert not [p for p in os.listdir(tmp_path) if p.startswith("none.jsonl")]  # nothing written


def test_failed_turns_are_failed_samples_with_their_reason(tmp_path, tiny_model):
    """--on-length fail: a turn cut at --max-new-tokens fails its sample as generation-length; a
    budget past the model's context fails as context-length before the engine is asked."""
    dataset = write_jsonl(str(tmp_path / "chats.jsonl"), [{"messages": m} for m in CHATS[:2]])
    out = tmp_path / "out"
    base = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        f"file://{out}",
        "--dtype",
        "fp32",
        "--workers",
        "1",
        "--no-progress",
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--regenerate",
        "--on-length",
        "fail",
    ]
    res = harvest_cli(*base, "--run", "cut", "--max-new-tokens", "2", "--work-dir", str(tmp_path / "w1"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "samples: 0 done, 2 failed" in res.stdout
    assert "generation-length: 2" in res.stdout + res.stderr
    res = harvest_cli(*base, "--run", "long", "--max-new-tokens", "4096", "--work-dir", str(tmp_path / "w2"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "context-length: 2" in res.stdout + res.stderr
    assert not os.path.exists(out / "long" / "generated")
