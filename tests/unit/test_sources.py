"""Dataset sources: every format streams rows with the place they came from; bad input is a row, not a crash."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from harvest.producer.rows import BadRow, Row
from harvest.producer.sources import dataset_files, read_dataset
from tests.support.need import need_module

ROWS = [{"text": "the model"}, {"input_ids": [5, 6]}, {"messages": [{"role": "user", "content": "hi"}]}]


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _read(path):
    return [(r.data, r.where) if isinstance(r, Row) else str(r) for r in read_dataset(str(path))]


@pytest.mark.parametrize(
    "suffix,pack",
    [
        (".jsonl", lambda b: b),
        (".jsonl.gz", gzip.compress),
        (".jsonl.zst", lambda b: zstandard.ZstdCompressor().compress(b)),
    ],
)
def test_jsonl_plain_and_compressed(tmp_path, suffix, pack):
    p = tmp_path / f"d{suffix}"
    p.write_bytes(pack(_jsonl(ROWS)))
    assert _read(p) == [(r, f"{p}:{i + 1}") for i, r in enumerate(ROWS)]


def test_jsonl_bad_lines_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "a"}\n\n{broken\n{"text": "\xff"}\n   \n[1, 2]\n')
    assert _read(p) == [
        ({"text": "a"}, f"{p}:1"),
        f"{p}:3: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{p}:4: not UTF-8 (invalid start byte at byte 10)",
        ([1, 2], f"{p}:6"),  # not an object: the tokenizer reports it
    ]


def test_parquet_streams_by_record_batch(tmp_path, monkeypatch):
    import harvest.producer.columnar as columnar

    monkeypatch.setattr(columnar, "BATCH_ROWS", 2)
    rows = [{"text": f"row {i}", "input_ids": None} for i in range(5)]
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=3)
    assert _read(p) == [(r, f"{p}:row {i}") for i, r in enumerate(rows)]


def test_arrow_stream_and_file_formats(tmp_path):
    table = pa.Table.from_pylist(
        [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}]
    )
    s, f = tmp_path / "s.arrow", tmp_path / "f.arrow"
    with pa.OSFile(str(s), "wb") as out, pa.ipc.new_stream(out, table.schema) as w:
        for b in table.to_batches(max_chunksize=1):
            w.write_batch(b)
    with pa.OSFile(str(f), "wb") as out, pa.ipc.new_file(out, table.schema) as w:
        w.write_table(table)
    for p in (s, f):
        assert _read(p) == [(r, f"{p}:row {i}") for i, r in enumerate(table.to_pylist())]


def test_hf_save_to_disk_dataset_and_directory_of_them(tmp_path):
    """A real `datasets.save_to_disk` folder (several Arrow shards, in order), and a directory holding it
    next to a JSONL file: files are read in sorted order, a saved dataset's shards in its own order."""
    datasets = need_module("datasets", "the datasets package", "a dev dependency: pip install -e '.[dev]'")
    rows = [{"text": f"t{i}"} for i in range(7)]
    ds_dir = tmp_path / "corpus" / "b_saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(ds_dir), num_shards=3)
    (tmp_path / "corpus" / "a.jsonl").write_bytes(_jsonl([{"text": "first"}]))
    shards = dataset_files(str(ds_dir))
    assert [s.rsplit("/", 1)[1] for s in shards] == [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert [r.data for r in read_dataset(str(ds_dir))] == rows
    got = [r.data for r in read_dataset(str(tmp_path / "corpus"))]
    assert got == [{"text": "first"}, *rows]


def test_dataset_dict_asks_for_a_split(tmp_path):
    datasets = need_module("datasets", "the datasets package", "a dev dependency: pip install -e '.[dev]'")
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError) as e:
        read_dataset(str(tmp_path / "dd"))
    assert (
        str(e.value)
        == f"dataset {tmp_path}/dd is a DatasetDict with splits ['train']: pass one split's folder, e.g. {tmp_path}/dd/train"
    )


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_dataset(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported format"):
        read_dataset(str(tmp_path / "d.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .jsonl"):
        read_dataset(str(tmp_path / "empty"))


def test_jsonl_is_streamed_not_loaded(tmp_path):
    """The first row arrives before the reader has seen the rest of the file (a truncated gzip tail
    only fails when reached)."""
    p = tmp_path / "d.jsonl.gz"
    data = gzip.compress(_jsonl([{"text": "x"}] * 50000))
    p.write_bytes(data[: len(data) // 2])
    it = read_dataset(str(p))
    assert next(it).data == {"text": "x"}
    rest = list(it)
    assert all(isinstance(r, Row) for r in rest[:-1]) and isinstance(rest[-1], BadRow)
    n = len(rest) + 1  # the line it broke at
    assert str(rest[-1]) == (
        f"{p}:{n}: file unreadable from here on "
        "(EOFError: Compressed file ended before the end-of-stream marker was reached)"
    )
