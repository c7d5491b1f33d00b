"""A dataset row with the place it came from, and a row that gives no sample.

Every source (producer.sources for JSONL, producer.columnar for Parquet and Arrow) yields
`Row`s, and every later stage reports a `BadRow` by that place, so a bad row can be named.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    data: object  # the parsed row; anything but a dict is a bad row downstream
    where: str  # "file:line" (JSONL) or "file:row N" (Parquet, Arrow; N counts from 0)


@dataclass(frozen=True)
class BadRow:
    """A row that gives no sample. `kind` is `bad` (broken input, counted against the exit
    status), `empty` (0 tokens) or `overlong` (over --max-len with --overlong skip)."""

    where: str
    reason: str
    kind: str = "bad"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"
