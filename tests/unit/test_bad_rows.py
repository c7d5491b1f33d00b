"""Every row a row: whatever one row raises in the code its data meets (the JSON parser, the chat
template, the tokenizer) is that row's bad row and the dataset goes on, the same in worker
processes; a bug in harvest's own code is not disguised as one. Token ids are integers, never
booleans. An empty dataset is refused by name."""

import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import harvest.producer.tokenize as tokenize
from harvest.producer.parallel import ProcessTokenizer
from harvest.producer.rows import BadRow, Row
from harvest.producer.sources import EmptyDataset, dataset_files, read_dataset
from harvest.producer.tokenize import LengthPolicy, RowTokenizer

DEEP = "[" * 100_000 + "]" * 100_000
NESTED_900 = "[" * 900 + "]" * 900  # parses, but is too deep to pickle to a worker process


def _lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _seen(out):
    return [
        (o.input_ids.tolist(), o.loss_mask.tolist()) if not isinstance(o, BadRow) else f"{o.kind}: {o}" for o in out
    ]


@pytest.fixture
def mixed(tmp_path):
    return _lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"input_ids": [5, 6]}),
            DEEP,
            '{"text": "a \\ud800 b"}',
            json.dumps({"input_ids": [5, True, 7]}),
            '{"input_ids": [' + "9" * 5000 + "]}",
            '{"text": "ok", "meta": ' + NESTED_900 + "}",
            json.dumps({"input_ids": [7]}),
        ],
    )


def test_one_row_never_stops_the_rest(tokenizer, mixed):
    out = RowTokenizer(tokenizer)(list(read_dataset(str(mixed))))
    ok = RowTokenizer(tokenizer).one(Row({"text": "ok"}, "x"))
    assert _seen(out) == [
        ([5, 6], [1, 1]),
        f"bad: {mixed}:2: JSON not parsed (RecursionError: maximum recursion depth exceeded while decoding a JSON "
        "array from a unicode string)",
        f"bad: {mixed}:3: 'text' is not valid Unicode: a lone surrogate '\\ud800' at character 2",
        f"bad: {mixed}:4: 'input_ids' must be a list of integers (token ids): 'input_ids'[1] is true (a boolean, "
        "not an integer)",
        f"bad: {mixed}:5: JSON not parsed (ValueError: Exceeds the limit (4300 digits) for integer string "
        "conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)",
        (ok.input_ids.tolist(), ok.loss_mask.tolist()),
        ([7], [1]),
    ]


def test_worker_processes_give_the_same_rows(tokenizer, mixed):
    rows = list(read_dataset(str(mixed)))
    with pytest.raises(RecursionError):
        pickle.dumps(rows)  # so the pool cannot take this batch: the parent tokenizes it, by the same rules
    want = _seen(RowTokenizer(tokenizer)(rows))
    pt = ProcessTokenizer(tokenizer, 2)
    got = [(batch, _seen(out)) for batch, out in pt.map([rows[:3], rows, rows[3:]])]
    assert got == [(rows[:3], want[:3]), (rows, want), (rows[3:], want[3:])]


def test_a_text_the_tokenizer_refuses_fails_its_row_alone(tokenizer):
    """A lone surrogate outside the fields harvest checks (a message's name the template renders)
    reaches the tokenizer, which refuses the batch: each text is then encoded alone."""
    tpl = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['name'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    t = RowTokenizer(tokenizer, chat_template=tpl)
    chat = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "ok", "name": "bot"}]
    bad = [{**chat[0], "name": "\ud800"}, chat[1]]
    rows = [Row({"messages": chat}, "f:1"), Row({"messages": bad}, "f:2"), Row({"text": "the model"}, "f:3")]
    out = t(rows)
    assert _seen(out)[1] == (
        "bad: f:2: the row's text as rendered is not valid Unicode: a lone surrogate '\\ud800' "
        "at character 17; the tokenizer cannot encode it"
    )
    assert _seen([out[0], out[2]]) == _seen([t.one(rows[0]), t.one(rows[2])])


def test_a_bug_in_harvest_is_not_passed_off_as_a_bad_row(tokenizer, monkeypatch):
    def broken(data, fields):
        raise KeyError("a bug")

    monkeypatch.setattr(tokenize, "classify", broken)
    with pytest.raises(KeyError, match="a bug"):
        RowTokenizer(tokenizer)([Row({"text": "x"}, "f:1")])


def test_the_model_context_bounds_every_sample(tmp_path, tokenizer, tiny_model):
    assert tokenize.model_context(tiny_model) == (4096, "max_position_embeddings")
    cfg = tmp_path / "m"
    cfg.mkdir()

    def context(doc):
        (cfg / "config.json").write_text(json.dumps(doc))
        return tokenize.model_context(str(cfg))

    assert context({"max_position_embeddings": 8}) == (8, "max_position_embeddings")
    assert context({"seq_length": 6, "max_position_embeddings": 8}) == (6, "seq_length")  # SGLang's order
    assert context({"max_position_embeddings": 8, "rope_scaling": {"type": "yarn", "factor": 4.0}}) == (
        32,
        "max_position_embeddings 8 x rope_scaling factor 4",
    )
    assert context(
        {
            "max_position_embeddings": 8,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2},
        }
    ) == (8, "max_position_embeddings")
    assert context({"max_position_embeddings": 8, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == (
        8,
        "max_position_embeddings",
    )
    assert context({"max_position_embeddings": True}) is None
    assert context({"hidden_size": 8}) is None
    assert tokenize.model_context(str(tmp_path / "nowhere")) is None

    (cfg / "config.json").write_text(json.dumps({"max_position_embeddings": 3}))
    row = Row({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, "f:7")
    skip = RowTokenizer(tokenizer, length=LengthPolicy().with_model(str(cfg)))
    assert _seen([skip.one(row)]) == [
        "overlong: f:7: 4 tokens, over the model's context of 3 (max_position_embeddings in its config.json; "
        "--overlong skip)"
    ]
    # --max-len below the context is the limit; above it, the context still is
    assert str(RowTokenizer(tokenizer, length=LengthPolicy(2).with_model(str(cfg))).one(row)) == (
        "f:7: 4 tokens, over --max-len 2 (--overlong skip)"
    )
    trunc = RowTokenizer(tokenizer, length=LengthPolicy(100, "truncate").with_model(str(cfg)))
    assert _seen([trunc.one(row)]) == [([5, 6, 7], [0, 0, 1])] and trunc.truncated == 1
    fail = RowTokenizer(tokenizer, length=LengthPolicy(overlong="fail").with_model(str(cfg)))
    assert _seen([fail.one(row)]) == [
        "overlong: f:7: 4 tokens, over the model's context of 3 (max_position_embeddings in its config.json; "
        "--overlong fail)"
    ]
    assert LengthPolicy(5).with_model(str(tmp_path / "nowhere")) == LengthPolicy(5)


def test_an_empty_dataset_is_refused_by_name(tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(EmptyDataset) as e:
        dataset_files(str(blank))
    assert str(e.value) == (
        f"dataset {blank} holds no rows (the file is empty or blank): nothing to extract; check the DATASET argument"
    )
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("text", pa.string())])), folder / "b.parquet")
    with pytest.raises(EmptyDataset) as e:
        read_dataset(str(folder))
    assert str(e.value) == (
        f"dataset {folder} holds no rows (its 2 files hold none): nothing to extract; check the DATASET argument"
    )
    (folder / "c.jsonl").write_text("{oops\n")  # a bad row is a row: reported when read, not "empty"
    assert [str(r) for r in read_dataset(str(folder))] == [
        f"{folder}/c.jsonl:1: invalid JSON (Expecting property name enclosed in double quotes at column 2)"
    ]
