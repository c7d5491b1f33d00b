"""`<out>/<run>/jobs/<digest>.jsonl`: the producer's tokenized samples, kept in storage, not in Redis.

Why: Redis runs on one thread, and token bulk carried in RQ jobs (and their AOF) would take most
of its CPU for long samples. So the producer writes the rows of the samples it is about to
enqueue once, as one object, and a job in Redis names its rows by byte span.

The object: one payload row (harvest.state.payload) a line, as JSON. Its name is the first 32 hex
digits of the SHA-256 of its bytes, so a write is idempotent: a producer that retries, or a rerun
that writes the same samples, writes the same object. It is written whole or not at all
(`Location.write_atomic`) before the transaction that enqueues the jobs naming it, so a job never
names an object that is not there. Who owns it: the producer writes it; nobody rewrites it, and
harvest deletes none during the run (they are tokens only, about 1e-4 of a run's bytes).

A job's reference (`ref`): the object's URL, the byte range `at` covering its rows, each row's
span within that range, and the SHA-256 of the range. Readers (the worker's job, the janitor's
reclaim, a dead worker's job, the stranded sweep, requeue) read that one range (one ranged GET on
an object store), check its digest, and then, as for any payload, derive each sample's id from
its content: a reference tampered with in Redis cannot point a worker at other tokens.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from harvest.errors import InputError, StorageError
from harvest.storage import Location, retry

FOLDER = "jobs"
_NAME = re.compile(r"^[0-9a-f]{32}\.jsonl$")


class JobRowsError(InputError, ValueError):
    """A job's rows that cannot be read as written: the object is gone, or its bytes changed."""


@dataclass
class RowsObject:
    """An object as its producer wrote it: its URL and where each sample's row lies in it."""

    url: str
    data: bytes
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)

    def ref(self, ids: Iterable[str]) -> dict[str, Any]:
        """The reference a job of `ids` (all rows of this object, in the job's order) carries."""
        spans = [self.spans[i] for i in ids]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        return {
            "url": self.url,
            "at": [lo, hi],
            "spans": [[s - lo, e - lo] for s, e in spans],
            "sha256": hashlib.sha256(self.data[lo:hi]).hexdigest(),
        }


def write(run_loc: Location, rows: Iterable[tuple[str, str]]) -> RowsObject:
    """One object of (sample id, payload row JSON) `rows` in the run's `jobs/` folder."""
    parts, spans, at = [], {}, 0
    for sid, row in rows:
        line = row.encode() + b"\n"
        spans[sid] = (at, at + len(line) - 1)
        parts.append(line)
        at += len(line)
    data = b"".join(parts)
    name = f"{FOLDER}/{hashlib.sha256(data).hexdigest()[:32]}.jsonl"
    retry(lambda: run_loc.write_atomic(name, data), f"writing the job rows {run_loc.describe(name)}")
    return RowsObject(run_loc.describe(name), data, spans)


def read(ref: Any) -> list[dict[str, Any]]:
    """The rows a job's reference names, in its order (JobRowsError: gone or changed; StorageError:
    the store failed for good after retries)."""
    try:
        url, (lo, hi), spans, digest = ref["url"], ref["at"], ref["spans"], ref["sha256"]
        folder, name = posixpath.split(str(url))
        lo, hi = int(lo), int(hi)
        spans = [(int(s), int(e)) for s, e in spans]
    except (KeyError, TypeError, ValueError) as e:
        raise JobRowsError(f"malformed job rows reference: {e!r}") from None
    if not _NAME.match(name) or posixpath.basename(folder) != FOLDER or not 0 <= lo <= hi:
        raise JobRowsError(f"job rows reference names {url!r} [{lo}, {hi}): not a jobs/<digest>.jsonl range")
    loc = Location.from_url(folder)
    try:
        data = retry(lambda: loc.read_range(name, lo, hi), f"reading the job rows {url}")
    except StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            raise JobRowsError(f"job rows {url} are missing: deleted from the run's {FOLDER}/ folder?") from None
        raise
    if len(data) != hi - lo or hashlib.sha256(data).hexdigest() != digest:
        raise JobRowsError(f"job rows {url} [{lo}, {hi}) changed since they were written (digest differs)")
    try:
        return [json.loads(data[s:e]) for s, e in spans]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise JobRowsError(f"job rows {url} [{lo}, {hi}): a row is not JSON ({e})") from None
