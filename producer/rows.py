"""A dataset row with the place it came from, and a row that gives no sample.

Every source (harvest.producer.sources for JSONL, harvest.producer.columnar for Parquet and Arrow) yields
`Row`s, and every later stage reports a `BadRow` by that place, so a bad row can be named.

Where the line runs between a bad row and a bug (one row never stops a dataset, and a bug in
harvest is never passed off as bad data): a row's data meets other people's code at a few call
sites only: the JSON parser (harvest.producer.sources), the chat template and transformers' copy of the
messages (harvest.producer.templates), and the tokenizer (harvest.producer.tokenize). Whatever those raise for
one row is that row's: it becomes a BadRow naming the exception's type and message
(`exception_reason`), and the dataset goes on. harvest's own checks of a row raise `RowError`,
`TemplateError` or `SampleError` with messages of their own, told the same way. Any other
exception raised in harvest's own code is a bug: it is not caught per row, and stops the
producer with its traceback. Parquet and Arrow rows come from pyarrow a record batch at a time;
a batch pyarrow cannot read is one bad row at the place it broke (harvest.producer.columnar).
"""

from __future__ import annotations

from dataclasses import dataclass

# --overlong: what a sample longer than its limit (--max-len, or the model's context) becomes.
# skip: an `overlong` row, reported and counted; truncate: its first tokens up to the limit;
# fail: the producer stops at the first one (exit status 2, naming the row).
OVERLONG_POLICIES = ("skip", "truncate", "fail")


@dataclass(frozen=True)
class Row:
    data: object  # the parsed row; anything but a dict is a bad row downstream
    where: str  # "file:line" (JSONL) or "file:row N" (Parquet, Arrow; N counts from 0)


@dataclass(frozen=True)
class BadRow:
    """A row that gives no sample. `kind` is `bad` (broken input, counted against the exit
    status), `empty` (0 tokens) or `overlong` (over its length limit with --overlong skip or fail)."""

    where: str
    reason: str
    kind: str = "bad"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


def exception_reason(what: str, e: BaseException) -> str:
    """A bad row's reason for an exception another library raised on the row's data: what failed,
    and the exception's type and message (cut to a line: a message may quote the whole row)."""
    msg = " ".join(str(e).split())
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{what} ({type(e).__name__}: {msg})" if msg else f"{what} ({type(e).__name__})"
