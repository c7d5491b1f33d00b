"""The shard index: `index/<shard_id>.json`, the document that commits a shard.

A shard exists for readers only once its index file does; the collector writes it after the
shard's bytes are stored (harvest.formats.shard), and reconcile rebuilds the ledger's done-set
from these files alone. Every reader parses an index through `parse_index`, which checks the
format version and the fields, so an index from another layout is refused by name instead of
being misread.

An index also carries what lets every read be checked (`crc32`: per sample, one checksum per
per-token tensor, written at pack time) and what later repairs decided (`excluded`: samples whose
bytes stay in the shard but which the index no longer commits, a duplicate copy or a corrupt
one). Readers, reconcile and the repairs all go through `committed_samples` and `kept_copies`, so
they agree on which samples a run holds and which copy of each they read.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NotRequired, TypedDict

from harvest.config import FINAL_STATES
from harvest.errors import InputError
from harvest.formats.codec import CODECS
from harvest.ids import check_id
from harvest.storage import Location, UnreadableDocument

FORMAT = "harvest-shard-1"  # the layout version of a shard and of its index: they change together
# A shard whose hidden states are coded (harvest.formats.codec): its own version, so that a harvest
# that cannot decode them refuses it by name instead of misreading it.
CODED_FORMAT = "harvest-shard-2"
FORMATS = (FORMAT, CODED_FORMAT)
INDEX = "index"


class ShardError(InputError, ValueError):
    """A shard or index file that does not follow the layout."""


class ShardIndex(TypedDict):
    format: str
    shard_id: str
    shard: str  # the shard's name under the run's folder
    samples: list[str]  # sample ids, in storage order
    tokens: list[int]  # tokens per sample
    offsets: list[int]  # token offset of each sample, and the total
    bytes: int  # the shard file's size
    sha256: str
    dtype: str  # harvest.formats.dtypes.dtype_name of the storage dtype
    capture_points: list[int]
    # What the final capture point holds (harvest.config.FINAL_POST_NORM).
    final_state: str
    # Per sample (storage order), one zlib.crc32 per tensor named in `crc32_tensors` (every tensor but
    # `offsets`, in the shard's order), over exactly that sample's rows as stored.
    crc32: list[list[int]]
    crc32_tensors: list[str]
    # CODED_FORMAT only: the codec (harvest.formats.codec) and, per sample and then the total, the
    # byte offset of its coded hidden states within the `hidden_states` tensor. Their crc32 is the
    # raw bytes'.
    codec: NotRequired[str]
    coded_offsets: NotRequired[list[int]]
    # {sample id: reason}: samples whose bytes are in the shard but which this index no longer commits
    # (a duplicate copy kept elsewhere, or a corrupt copy dropped for re-extraction).
    excluded: NotRequired[dict[str, str]]
    # A --regenerate run's shard: the file of its samples' generated conversations, committed with it
    # (harvest.formats.generated): {"file": name under the run's folder, "sha256": ..., "rows": n}.
    generated: NotRequired[dict[str, Any]]


_FIELDS: dict[str, type] = {
    "format": str,
    "shard_id": str,
    "shard": str,
    "samples": list,
    "tokens": list,
    "offsets": list,
    "bytes": int,
    "sha256": str,
    "dtype": str,
    "capture_points": list,
}


def index_file(shard_id: str) -> str:
    return f"{INDEX}/{check_id(shard_id, 'shard id')}.json"


def read_index(loc: Location, name: str) -> ShardIndex:
    """The index file `index/<name>` of the run folder `loc`, read and checked (`parse_index`).
    Every error names the file: one that is not JSON at all (garbled, cut short) is a ShardError
    with the way out, as one an object store refuses names it too (Location.read_bytes)."""
    path = f"{INDEX}/{name}"
    try:
        doc = loc.read_json(path)
    except UnreadableDocument as e:
        run = posixpath.basename(loc.root)
        raise ShardError(
            f"index file {e}; move it out of {loc.describe(INDEX)} (its shard is then uncommitted) and "
            f"run `harvest reconcile --run {run}` (with the run's --redis or --work-dir) to extract its "
            "samples again"
        ) from None
    return parse_index(doc, loc.describe(path))


def parse_index(doc: object, where: str) -> ShardIndex:
    """`doc` (a parsed index file) checked: this format version, every field of its type, the
    per-sample lists consistent. Raises ShardError naming `where`."""
    if not isinstance(doc, dict):
        raise ShardError(f"{where}: an index file holds a JSON object, found {type(doc).__name__}")
    if doc.get("format") not in FORMATS:
        raise ShardError(f"{where}: index format {doc.get('format')!r}, this harvest reads {' and '.join(FORMATS)}")
    for name, kind in _FIELDS.items():
        if not isinstance(doc.get(name), kind):
            raise ShardError(f"{where}: index field {name!r} missing or not a {kind.__name__}")
    if doc.get("final_state") not in FINAL_STATES:
        raise ShardError(
            f"{where}: final state {doc.get('final_state')!r}, this harvest reads {', '.join(FINAL_STATES)}"
        )
    check_id(doc["shard_id"], "shard id")
    n = len(doc["samples"])
    if len(doc["tokens"]) != n or len(doc["offsets"]) != n + 1:
        raise ShardError(
            f"{where}: {n} samples but {len(doc['tokens'])} token counts and {len(doc['offsets'])} offsets"
        )
    if len(set(doc["samples"])) != n:
        raise ShardError(f"{where}: a sample is listed twice")
    _check_crc32(doc, n, where)
    _check_coded(doc, n, where)
    excluded = doc.get("excluded", {})
    if not isinstance(excluded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in excluded.items()
    ):
        raise ShardError(f"{where}: index field 'excluded' is not an object of sample id to reason")
    gen = doc.get("generated")
    if gen is not None and not (
        isinstance(gen, dict)
        and isinstance(gen.get("file"), str)
        and isinstance(gen.get("sha256"), str)
        and isinstance(gen.get("rows"), int)
    ):
        raise ShardError(f"{where}: index field 'generated' is not an object of file, sha256 and rows")
    stray = sorted(set(excluded) - set(doc["samples"]))
    if stray:
        raise ShardError(f"{where}: excludes {len(stray)} samples it does not hold (first {stray[0]})")
    return doc  # type: ignore[return-value]


def _check_crc32(doc: dict[str, Any], n: int, where: str) -> None:
    for field in ("crc32", "crc32_tensors"):
        if field not in doc:
            raise ShardError(f"{where}: index lacks its field {field!r}")
    names, sums = doc["crc32_tensors"], doc["crc32"]
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(x, str) for x in names)
        or len(set(names)) != len(names)
    ):
        raise ShardError(f"{where}: index field 'crc32_tensors' is not a list of distinct tensor names")
    if not isinstance(sums, list):
        raise ShardError(f"{where}: index field 'crc32' is not a list")
    if len(sums) != n:
        raise ShardError(f"{where}: {n} samples but {len(sums)} crc32 entries")
    for i, row in enumerate(sums):
        if (
            not isinstance(row, list)
            or len(row) != len(names)
            or not all(type(c) is int and 0 <= c < 1 << 32 for c in row)
        ):
            raise ShardError(
                f"{where}: crc32 of sample {i} is not {len(names)} unsigned 32-bit ints (one per tensor of {names})"
            )


def _check_coded(doc: dict[str, Any], n: int, where: str) -> None:
    coded = doc["format"] == CODED_FORMAT
    if not coded:
        if "codec" in doc or "coded_offsets" in doc:
            raise ShardError(f"{where}: index of format {FORMAT} with a codec: only {CODED_FORMAT} shards are coded")
        return
    if doc.get("codec") not in CODECS[1:]:
        raise ShardError(f"{where}: codec {doc.get('codec')!r}, this harvest decodes {', '.join(CODECS[1:])}")
    at = doc.get("coded_offsets")
    if not (
        isinstance(at, list)
        and len(at) == n + 1
        and all(type(x) is int for x in at)
        and at[0] == 0
        and all(a <= b for a, b in pairwise(at))
    ):
        raise ShardError(f"{where}: index field 'coded_offsets' is not {n + 1} ascending byte offsets from 0")


def encode_index(doc: Mapping[str, Any]) -> bytes:
    """The bytes of an index file: the one encoding, so every writer of the same document (a
    collector finishing a decided commit, a repair rewriting it) writes the same file."""
    return json.dumps(doc, indent=1).encode()


def committed_samples(doc: ShardIndex) -> list[str]:
    """The samples this index commits, in storage order: its samples less the excluded ones."""
    excluded = doc.get("excluded") or {}
    return [s for s in doc["samples"] if s not in excluded]


def with_excluded(doc: ShardIndex, reasons: Mapping[str, str]) -> ShardIndex:
    """A copy of `doc` that no longer commits the samples of `reasons` (those already excluded keep
    their first reason, so a repair run twice writes the same document)."""
    excluded = dict(doc.get("excluded") or {})
    for sid, why in reasons.items():
        if sid not in doc["samples"]:
            raise ShardError(f"shard {doc['shard_id']} does not hold sample {sid}: it cannot exclude it")
        excluded.setdefault(sid, why)
    return {**doc, "excluded": excluded}


@dataclass(frozen=True)
class Copies:
    """Which committed copy of each sample a run's readers read: `kept` maps each sample to its
    shard id (in storage order: shards by id, samples as packed); `extra` maps a sample committed
    by more than one index to the other shards (ascending) that also commit it."""

    kept: dict[str, str]
    extra: dict[str, list[str]]


def kept_copies(docs: Iterable[ShardIndex]) -> Copies:
    """The one choice of copy for every sample (readers, `harvest reconcile --dedupe`): the copy in
    the smallest shard id among the indexes that commit it. Shards are ordered by id, not by the
    order given, so every process that sees the same index files makes the same choice, and a
    dedupe that excludes the other copies changes no reader's answer."""
    kept: dict[str, str] = {}
    extra: dict[str, list[str]] = {}
    for doc in sorted(docs, key=lambda d: d["shard_id"]):
        sid = doc["shard_id"]
        for sample in committed_samples(doc):
            if sample in kept:
                extra.setdefault(sample, []).append(sid)
            else:
                kept[sample] = sid
    return Copies(kept, extra)
