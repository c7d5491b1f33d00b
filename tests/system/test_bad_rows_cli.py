"""Every row a row, as a user meets it in `harvest produce` and `harvest run`: a row that breaks the
JSON parser, the tokenizer or the id rules is one bad row with its file and line, and the rows after
it are enqueued (with --processes too); a row longer than the model's context is handled by
--overlong before it is enqueued; an empty dataset is refused by name, with nothing written."""

import json

import pytest

from harvest.read.reader import RunReader
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.payload import decode_batch
from tests.support.cli import harvest_cli

GOOD = [{"text": "the model reads"}, {"input_ids": [5, 6, 7]}, {"text": "the end"}]
LONG = {"input_ids": [5 + i % 400 for i in range(5000)]}  # the tiny model has 4096 positions


def _dataset(path):
    lines = [
        json.dumps(GOOD[0]),
        "[" * 100_000 + "]" * 100_000,
        '{"text": "a lone \\ud800 surrogate"}',
        json.dumps({"input_ids": [5, True, 7]}),
        json.dumps(LONG),
        json.dumps(GOOD[1]),
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\udfff"}]}',
        json.dumps(GOOD[2]),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _reported(p, policy="skip"):
    return [
        f"bad row {p}:2: JSON not parsed (RecursionError: maximum recursion depth exceeded while decoding a JSON array "
        "from a unicode string)",
        f"bad row {p}:3: 'text' is not valid Unicode: a lone surrogate '\\ud800' at character 7",
        f"bad row {p}:4: 'input_ids' must be a list of integers (token ids): 'input_ids'[1] is true (a boolean, not an "
        "integer)",
        f"overlong row {p}:5: 5000 tokens, over the model's context of 4096 (max_position_embeddings in its "
        f"config.json; --overlong {policy})",
        f"bad row {p}:7: 'messages'[1] content is not valid Unicode: a lone surrogate '\\udfff' at character 0",
    ]


def _rows_of(stderr):
    return [line for line in stderr.splitlines() if " row " in line]


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bad_rows_are_reported_and_every_row_after_them_is_enqueued(
    conn, redis_server, tiny_model, tmp_path, processes
):
    p = _dataset(tmp_path / "d.jsonl")
    r = harvest_cli(
        "produce",
        str(p),
        "--run",
        "bad",
        "--redis",
        redis_server.url,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--processes",
        processes,
    )
    assert r.returncode == 1, r.stderr
    assert _rows_of(r.stderr) == _reported(p)
    head, body, tail = r.stdout.strip().split("; ")
    assert head.startswith("rows 8: 3 samples (") and body.startswith("enqueued 3 in 1 jobs (")
    assert tail == "bad 4, empty 0, overlong 1 skipped, truncated 0"
    assert Ledger(conn, "bad").counts()["total"] == 3
    _, samples = decode_batch(run_queue(conn, "bad").jobs[0].args[0])
    assert [s.input_ids.tolist()[-3:] for s in samples][1] == [5, 6, 7]  # the row after the broken ones


def test_overlong_rows_skip_truncate_or_fail(tiny_model, tmp_path):
    p = _dataset(tmp_path / "d.jsonl")
    dry = ("produce", str(p), "--run", "x", "--model", tiny_model, "--dry-run")
    r = harvest_cli(*dry, "--overlong", "truncate")
    assert r.returncode == 1 and _rows_of(r.stderr) == [x for x in _reported(p) if not x.startswith("overlong row")]
    assert r.stdout.strip().endswith("bad 4, empty 0, overlong 0 skipped, truncated 1")
    assert r.stdout.startswith("rows 8: 4 samples (")
    r = harvest_cli(*dry, "--overlong", "fail")
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == "harvest: error: overlong row: " + _reported(p, "fail")[3].removeprefix(
        "overlong row "
    )
    assert r.stdout == ""
    # --max-len below the context is the limit; above it, the model's context still is
    r = harvest_cli(*dry, "--max-len", "2")
    assert f"overlong row {p}:6: 3 tokens, over --max-len 2 (--overlong skip)" in _rows_of(r.stderr)
    r = harvest_cli(*dry, "--max-len", "100000")
    assert _rows_of(r.stderr) == _reported(p)


def test_an_empty_dataset_is_an_error_that_names_it_and_writes_nothing(conn, redis_server, tiny_model, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    msg = (
        f"harvest: error: dataset {empty} holds no rows (the file is empty or blank): nothing to extract; check the "
        "DATASET argument"
    )
    r = harvest_cli(
        "produce", str(empty), "--run", "e", "--redis", redis_server.url, "--model", tiny_model, "--out", str(out)
    )
    assert (r.returncode, r.stdout, r.stderr.strip()) == (2, "", msg)
    r = harvest_cli(
        "run", str(empty), "--model", tiny_model, "--out", str(out), "--work-dir", str(tmp_path / "w"), "--no-progress"
    )
    assert (r.returncode, r.stdout, r.stderr.strip()) == (2, "", msg)
    assert not out.exists() and not (tmp_path / "w").exists() and conn.keys("harvest:e:*") == []


def test_harvest_run_goes_on_past_every_bad_row_and_says_so(tiny_model, tmp_path):
    """The same rows through `harvest run`: every good row is extracted, each bad one reported with its
    file and line, the overlong one never reaches the engine; exit 1 (rows were bad)."""
    p = _dataset(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    r = harvest_cli(
        "run",
        str(p),
        "--model",
        tiny_model,
        "--out",
        str(out),
        "--run",
        "rows",
        "--workers",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--max-wait",
        "1",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert _rows_of(r.stderr) == _reported(p)
    # stderr is no terminal: progress as whole lines, the last with the final counts, no \r frames
    assert "\r" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("extract: ")][-1].startswith(
        "extract: 3 samples of 3 (100%), "
    ), r.stderr
    lines = r.stdout.splitlines()
    assert "  samples: 3 done, 0 failed (3 enqueued now, 0 already known)" in lines, r.stdout
    assert "  bad rows: 4 (each reported above on stderr with its file and line)" in lines, r.stdout
    assert any(
        line.startswith("  produced: rows 8: 3 samples (")
        and line.endswith("; bad 4, empty 0, overlong 1 skipped, truncated 0")
        for line in lines
    ), r.stdout
    assert len(RunReader(str(out / "rows"))) == 3
