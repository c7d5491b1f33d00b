"""Dataset sources: rows with the place they came from, so a bad row can be named."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    data: object  # the parsed row; anything but a dict is a bad row downstream
    where: str  # "file:line"


@dataclass(frozen=True)
class BadRow:
    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def read_jsonl(path: str) -> Iterator[Row | BadRow]:
    """Stream a JSONL file line by line; blank lines are skipped, broken ones reported."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset {path} does not exist")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield BadRow(where, f"not UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                yield Row(json.loads(text), where)
            except json.JSONDecodeError as e:
                yield BadRow(where, f"invalid JSON ({e.msg} at column {e.colno})")


def read_dataset(path: str) -> Iterator[Row | BadRow]:
    if path.endswith(".jsonl") or path.endswith(".json"):
        return read_jsonl(path)
    raise ValueError(f"dataset {path}: unsupported format (this version reads .jsonl)")
