"""Progress for a person at a terminal, and for a log.

On a terminal (the stream is a TTY) progress is a tqdm bar redrawn in place. Anywhere else (a
pipe, a file, `docker compose logs`, CI) tqdm's `\\r` frames pile up into one endless line, so
there progress is a plain line every `PLAIN_INTERVAL_S` seconds, and one when it ends. Every
progress display of harvest is made by `progress`, so that rule is written once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

PLAIN_INTERVAL_S = 30.0  # between two plain progress lines; a log line more often is noise


def progress(
    desc: str,
    unit: str = " it",
    total: int | None = None,
    enabled: bool = True,
    stream: IO[str] | None = None,
    interval: float = PLAIN_INTERVAL_S,
) -> tqdm | PlainProgress:
    """A progress display with tqdm's interface (`update`, `n`, `total`, `set_postfix`,
    `set_postfix_str`, `refresh`, `close`, a context manager): a tqdm bar when `stream` (default
    stderr) is a terminal, `PlainProgress` lines otherwise, nothing when not `enabled`."""
    from tqdm import tqdm

    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return tqdm(desc=desc, unit=unit, total=total, disable=True)
    if _isatty(stream):
        return tqdm(desc=desc, unit=unit, total=total, file=stream, dynamic_ncols=True)
    return PlainProgress(desc, unit, total, stream, interval)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or a closed stream
        return False


class PlainProgress:
    """Progress as whole lines, `desc: 1200 rows of 5000 (24%), 40.0 rows/s, bad=0, enqueued=1100`, at most
    one per `interval` seconds (and the last one at `close`), for streams that are no terminal."""

    def __init__(
        self,
        desc: str,
        unit: str,
        total: int | None,
        stream: IO[str],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.unit, self.total, self.stream, self.interval = desc, unit, total, stream, interval
        self.n = 0
        self.postfix = ""
        self.clock = clock
        self.start = self.last = clock()
        self.closed = False

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_print()

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: object) -> None:
        items = {**(ordered_dict or {}), **{k: kwargs[k] for k in sorted(kwargs)}}  # keys sorted, as tqdm does
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())
        if refresh:
            self._maybe_print()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self._maybe_print()

    def refresh(self) -> None:
        self._maybe_print()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._print(final=True)

    def line(self, final: bool = False) -> str:
        """The line as it stands now."""
        elapsed = max(self.clock() - self.start, 1e-9)
        out = f"{self.desc}: {self.n}{self.unit}"
        if self.total:
            out += f" of {self.total} ({100 * self.n / self.total:.0f}%)"
        out += f", {self.n / elapsed:.1f}{self.unit}/s"
        if final:
            out += f", {elapsed:.0f}s in all"
        return out + (f", {self.postfix}" if self.postfix else "")

    def _maybe_print(self) -> None:
        if not self.closed and self.clock() - self.last >= self.interval:
            self._print()

    def _print(self, final: bool = False) -> None:
        self.last = self.clock()
        print(self.line(final), file=self.stream, flush=True)
