"""`harvest run` takes the producer's options (declared once, in harvest.cli.options): a field
read from another column, a length limit with truncation, a chat template, job sizes, strict."""

from __future__ import annotations

import json

from harvest.cli.demo import CHAT_TEMPLATE
from harvest.read.reader import RunReader
from tests.support.cli import harvest_cli


def test_run_takes_every_producer_option(tmp_path, tiny_model):
    data = tmp_path / "rows.jsonl"
    rows = [
        {"content": "the model reads a long prompt"},
        {"content": "alpha beta gamma"},
        {"content": " ".join(["river mountain forest city"] * 40)},  # far over --max-len
        {"conv": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "seven"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(CHAT_TEMPLATE)
    out = tmp_path / "out"
    res = harvest_cli(
        "run",
        str(data),
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--run",
        "opts",
        "--workers",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--no-progress",
        "--field",
        "text=content",
        "--field",
        "messages=conv",
        "--max-len",
        "24",
        "--overlong",
        "truncate",
        "--chat-template",
        str(tpl),
        "--batch-samples",
        "2",
        "--batch-tokens",
        "4096",
        "--strict",
        "--processes",
        "1",
        "--max-wait",
        "1",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "samples: 4 done, 0 failed" in res.stdout, res.stdout
    # The long text and the templated chat (its special tokens and role names) are cut to 24.
    assert "overlong 0 skipped, truncated 2" in res.stdout and "in 2 jobs" in res.stdout, res.stdout
    reader = RunReader(str(out / "opts"))
    lengths = sorted(int(reader.get(sid)["input_ids"].shape[0]) for sid in reader.sample_ids)
    assert lengths == [4, 8, 24, 24], lengths  # 'alpha beta gamma', the short prompt, the two cut ones
