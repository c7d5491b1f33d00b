"""Dataset sources: rows with the place they came from, so a bad row can be named.

Every reader streams: JSONL line by line (plain, .gz or .zst), Parquet and Arrow record batch
by record batch, so memory stays flat whatever the dataset size. A path may be one file, a
dataset saved with HF `datasets` (`save_to_disk`), or a directory of such files and datasets.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator

from harvest.errors import InputError
from harvest.producer.rows import BadRow, Row, exception_reason

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
COLUMNAR_SUFFIXES = (".parquet", ".arrow")


class DatasetNotFound(InputError, FileNotFoundError):
    """The DATASET path does not exist."""


class DatasetError(InputError, ValueError):
    """A DATASET path that holds no dataset harvest reads; the message says what it expects."""


def _open_binary(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _lines(path: str) -> Iterator[tuple[int, bytes | BadRow]]:
    """Numbered lines; a truncated or corrupt file ends with one BadRow at the line it broke."""
    lineno = 0
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                yield lineno, raw
    except (EOFError, OSError) as e:  # gzip/zstd errors are OSError subclasses or EOFError
        yield lineno + 1, BadRow(f"{path}:{lineno + 1}", f"file unreadable from here on ({type(e).__name__}: {e})")


def read_jsonl(path: str) -> Iterator[Row | BadRow]:
    """Stream a JSONL file line by line; blank lines are skipped, broken ones reported."""
    for lineno, raw in _lines(path):
        if isinstance(raw, BadRow):
            yield raw
            return
        where = f"{path}:{lineno}"
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadRow(where, f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            yield BadRow(where, f"invalid JSON ({e.msg} at column {e.colno})")
            continue
        except Exception as e:  # noqa: BLE001 - the parser on this line's data (see harvest.producer.rows): nested
            # too deep (RecursionError), an integer over Python's digit limit (ValueError), ...
            yield BadRow(where, exception_reason("JSON not parsed", e))
            continue
        yield Row(data, where)


def _is_hf_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def _hf_files(path: str) -> list[str]:
    """The Arrow files of a `save_to_disk` dataset, in its row order."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = _json(os.path.join(path, "dataset_dict.json")).get("splits", [])
        raise DatasetError(
            f"dataset {path} is a DatasetDict with splits {splits}: pass one split's folder, e.g. {path}/{splits[0] if splits else 'train'}"
        )
    state = _json(os.path.join(path, "state.json"))
    try:
        return [os.path.join(path, d["filename"]) for d in state.get("_data_files", [])]
    except (KeyError, TypeError) as e:
        raise DatasetError(f"dataset {path}: state.json lists its data files without a filename ({e!r})") from None


def _json(path: str) -> dict:
    """A saved dataset's JSON document; not JSON (or not an object): a DatasetError naming it."""
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except ValueError as e:
            raise DatasetError(f"dataset file {path} is not JSON ({e}): not saved with save_to_disk?") from None
    if not isinstance(doc, dict):
        raise DatasetError(f"dataset file {path} is not a JSON object: not saved with save_to_disk?")
    return doc


def _walk(path: str) -> list[str]:
    if _is_hf_dataset(path):
        return _hf_files(path)
    files: list[str] = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith("."):
            continue
        if os.path.isdir(full):
            files.extend(_walk(full))
        elif name.endswith(JSONL_SUFFIXES + COLUMNAR_SUFFIXES):
            files.append(full)
    return files


def dataset_files(path: str) -> list[str]:
    """The files a dataset path stands for, in reading order (sorted within a directory).

    A dataset without a single row is refused here (DatasetError, naming it), before anything is
    registered or written: a run of nothing is a mistake (the wrong file, a failed download), not a
    success. Finding a row costs the first line of a file, or a Parquet footer."""
    if not os.path.exists(path):
        raise DatasetNotFound(f"dataset {path} does not exist")
    if os.path.isfile(path):
        if not path.endswith(JSONL_SUFFIXES + COLUMNAR_SUFFIXES):
            raise DatasetError(
                f"dataset {path}: unsupported format; expected one of {', '.join(JSONL_SUFFIXES + COLUMNAR_SUFFIXES)}, "
                "a dataset saved with datasets.save_to_disk, or a directory of those"
            )
        files = [path]
    else:
        files = _walk(path)
        if not files:
            raise DatasetError(
                f"dataset {path}: no {', '.join(JSONL_SUFFIXES + COLUMNAR_SUFFIXES)} files or saved datasets in it"
            )
    if not any(map(_holds_a_row, files)):
        raise EmptyDataset(path, len(files))
    return files


class EmptyDataset(DatasetError):
    """A dataset path whose files hold no row (empty, or blank lines only)."""

    def __init__(self, path: str, files: int) -> None:
        what = (
            "the file is empty or blank" if os.path.isfile(path) else f"its {files} file{'s' * (files != 1)} hold none"
        )
        super().__init__(f"dataset {path} holds no rows ({what}): nothing to extract; check the DATASET argument")


def _holds_a_row(path: str) -> bool:
    """Whether `path` yields anything at all: a row, or a bad row (an unreadable file counts, and is
    reported with its place when read)."""
    if path.endswith(COLUMNAR_SUFFIXES):
        from harvest.producer.columnar import holds_a_row

        return holds_a_row(path)
    lines = _lines(path)
    try:
        return any(isinstance(raw, BadRow) or raw.strip() for _, raw in lines)
    finally:
        lines.close()  # the file, at once


def read_file(path: str) -> Iterator[Row | BadRow]:
    if path.endswith(COLUMNAR_SUFFIXES):
        from harvest.producer.columnar import read_arrow, read_parquet

        return read_parquet(path) if path.endswith(".parquet") else read_arrow(path)
    return read_jsonl(path)


def read_dataset(path: str) -> Iterator[Row | BadRow]:
    """All rows of a dataset path; the files are resolved (and errors raised, an empty dataset's
    among them) before the first row."""
    files = dataset_files(path)

    def rows() -> Iterator[Row | BadRow]:
        for f in files:
            yield from read_file(f)

    return rows()
