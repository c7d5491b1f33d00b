"""`harvest produce` as a user runs it: summary, exit status, bad rows on stderr, dry run, options."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
from rq import Queue
from rq.serializers import JSONSerializer

from harvest.producer.rowkinds import FieldMap
from harvest.producer.rows import Row
from harvest.producer.tokenize import LengthPolicy, RowTokenizer
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from tests.support.cli import harvest_cli
from tests.support.templates import CHATML

ROWS = [
    {"text": "the model reads"},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the data"}]},
    {"prompt": "the", "completion": " model"},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]},
    {"input_ids": [5, 6, 7]},
]


def _write(path, rows, extra=b""):
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + extra)
    return path


def test_dry_run_counts_without_redis_and_reports_bad_rows(tiny_model, tmp_path):
    p = _write(tmp_path / "d.jsonl", ROWS, b'{"text": ""}\n{oops\n{"text": "\xff"}\n{"foo": 1}\n')
    r = harvest_cli(
        "produce", str(p), "--run", "x", "--model", tiny_model, "--dry-run", "--redis", "redis://127.0.0.1:1"
    )
    assert r.returncode == 1, r.stderr
    assert r.stdout.startswith("rows 9: 5 samples (")
    assert "; dry run, nothing enqueued; bad 3, empty 1, overlong 0 skipped, truncated 0" in r.stdout
    lines = [line for line in r.stderr.splitlines() if " row " in line]
    assert lines == [
        f"empty row {p}:6: empty sample (0 tokens)",
        f"bad row {p}:7: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"bad row {p}:8: not UTF-8 (invalid start byte at byte 10)",
        f"bad row {p}:9: no usable field: expected one of input_ids, messages, conversations, prompt, text; got ['foo']",
    ]


def test_strict_stops_at_the_first_bad_row(tiny_model, tmp_path):
    p = _write(tmp_path / "d.jsonl", ROWS[:1], b"{oops\n" + json.dumps(ROWS[1]).encode() + b"\n")
    r = harvest_cli("produce", str(p), "--run", "x", "--model", tiny_model, "--dry-run", "--strict")
    assert r.returncode == 2
    assert r.stderr.strip().endswith(
        f"harvest: error: bad row (--strict): {p}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    )


def test_enqueue_with_fields_template_and_length_policy(conn, redis_server, tokenizer, tiny_model, tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the data"}]
    rows = [{"body": "the model reads a long prompt and writes hidden states"}, {"dialog": chat}, {"body": ""}]
    p = _write(tmp_path / "d.jsonl", rows)
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(CHATML)
    args = [
        "produce",
        str(p),
        "--run",
        "f",
        "--redis",
        redis_server.url,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "o"),
        "--field",
        "text=body",
        "--field",
        "messages=dialog",
        "--chat-template",
        str(tpl),
        "--max-len",
        "11",
    ]
    r = harvest_cli(*args, "--overlong", "truncate")
    assert r.returncode == 0, r.stderr
    assert "rows 3: 2 samples (22 tokens); enqueued 2 in 1 jobs (22 tokens)" in r.stdout
    assert r.stdout.strip().endswith("bad 0, empty 1, overlong 0 skipped, truncated 2")
    assert r.stderr.splitlines()[-1] == f"empty row {p}:3: empty sample (0 tokens)"
    q = Queue(Keys("f").queue_name, connection=conn, serializer=JSONSerializer)
    _, samples = decode_batch(q.jobs[0].args[0])
    ref = RowTokenizer(
        tokenizer, FieldMap.parse(["text=body", "messages=dialog"]), CHATML, LengthPolicy(11, "truncate")
    )
    want = ref([Row(rows[0], "x"), Row(rows[1], "x")])
    assert [(s.input_ids.tolist(), s.loss_mask.tolist()) for s in samples] == [
        (w.input_ids.tolist(), w.loss_mask.tolist()) for w in want
    ]
    full = RowTokenizer(tokenizer, FieldMap.parse(["messages=dialog"]), CHATML).one(Row(rows[1], "x"))
    assert full.num_tokens == 25 and want[1].input_ids.tolist() == full.input_ids.tolist()[:11]
    # skip (the default) reports the long rows instead; nothing new is enqueued; --progress draws the bar
    r = harvest_cli(*args, "--progress")
    assert r.returncode == 0
    assert "enqueued 0 in 0 jobs" in r.stdout and "overlong 2 skipped, truncated 0" in r.stdout
    assert f"overlong row {p}:1: 12 tokens, over --max-len 11 (--overlong skip)" in r.stderr
    # progress as plain lines (stderr is a pipe here), the last one with the final counts
    progress = [line for line in r.stderr.splitlines() if line.startswith("produce: ")]
    assert "\r" not in r.stderr and progress[-1].startswith("produce: 3 rows, ")
    assert progress[-1].endswith(", bad=0, enqueued=0, skipped=0"), progress
    assert Ledger(conn, "f").counts()["queued"] == 2


def test_parquet_and_saved_dataset_through_the_cli(conn, redis_server, tiny_model, tmp_path):
    import datasets

    pq.write_table(pa.Table.from_pylist([{"text": "the model"}, {"text": "the data"}]), tmp_path / "a.parquet")
    datasets.Dataset.from_list([{"text": "a token"}, {"text": None}]).save_to_disk(str(tmp_path / "saved"))
    base = ["--redis", redis_server.url, "--model", tiny_model, "--out", str(tmp_path / "o")]
    r = harvest_cli("produce", str(tmp_path / "a.parquet"), "--run", "pq", *base)
    assert r.returncode == 0 and "enqueued 2 in 1 jobs" in r.stdout, r.stderr
    r = harvest_cli("produce", str(tmp_path / "saved"), "--run", "pq", *base)
    assert r.returncode == 1
    assert "enqueued 1 in 1 jobs" in r.stdout and "bad 1," in r.stdout
    assert f"bad row {tmp_path}/saved/data-00000-of-00001.arrow:row 1: 'text' must be a string, got null" in r.stderr
    assert Ledger(conn, "pq").counts()["queued"] == 3
