"""Parquet and Arrow sources, read record batch by record batch so memory stays flat.

HF `datasets.save_to_disk` writes Arrow IPC *stream* files (`data-00000-of-00001.arrow`);
other tools write the IPC *file* format. Both are read here, a batch at a time; a row's place
is `file:row N` with N counting from 0 across the whole file. A file pyarrow cannot read from
some batch on ends with one bad row at the first row it could not give (harvest.producer.rows).
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from harvest.producer.rows import BadRow, Row, exception_reason

BATCH_ROWS = 1024
_ARROW_FILE_MAGIC = b"ARROW1"


def _rows(path: str, batches: Iterator[pa.RecordBatch]) -> Iterator[Row | BadRow]:
    n = 0
    try:
        for batch in batches:
            for data in batch.to_pylist():
                yield Row(data, f"{path}:row {n}")
                n += 1
    except (pa.ArrowException, OSError) as e:
        yield BadRow(f"{path}:row {n}", exception_reason("file unreadable from here on", e))


def read_parquet(path: str) -> Iterator[Row | BadRow]:
    """Stream a Parquet file by record batches (row groups are never loaded whole)."""
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield BadRow(f"{path}:row 0", f"unreadable Parquet file ({e})")
        return
    yield from _rows(path, pf.iter_batches(batch_size=BATCH_ROWS))


def _arrow_batches(source: pa.NativeFile) -> Iterator[pa.RecordBatch]:
    if source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
        reader = ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
        return
    source.seek(0)
    yield from ipc.open_stream(source)


def read_arrow(path: str) -> Iterator[Row | BadRow]:
    """Stream an Arrow IPC file (stream format, as `save_to_disk` writes, or file format)."""
    with pa.memory_map(path, "r") as source:
        yield from _rows(path, _arrow_batches(source))


def holds_a_row(path: str) -> bool:
    """Whether a Parquet or Arrow file has a row (or is unreadable: a bad row, told when read).
    Parquet: its footer's row count; Arrow: its batches until one has rows."""
    try:
        if path.endswith(".parquet"):
            return pq.ParquetFile(path).metadata.num_rows > 0
        with pa.memory_map(path, "r") as source:
            return any(b.num_rows for b in _arrow_batches(source))
    except (pa.ArrowException, OSError):
        return True
