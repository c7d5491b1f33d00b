"""The shard index: `index/<shard_id>.json`, the document that commits a shard.

A shard exists for readers only once its index file does; the collector writes it after the
shard's bytes are stored (harvest.formats.shard), and reconcile rebuilds the ledger's done-set
from these files alone. Every reader parses an index through `parse_index`, which checks the
format version and the fields, so an index from another layout is refused by name instead of
being misread.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from harvest.config import FINAL_POST_NORM, FINAL_STATES
from harvest.ids import check_id

FORMAT = "harvest-shard-1"  # the layout version of a shard and of its index: they change together
INDEX = "index"


class ShardError(ValueError):
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
    # What the final capture point holds (harvest.config.FINAL_POST_NORM); indexes written before it
    # was recorded hold the same, and parse_index fills it in for them.
    final_state: NotRequired[str]


_FIELDS: dict[str, type] = {"format": str, "shard_id": str, "shard": str, "samples": list, "tokens": list,
                            "offsets": list, "bytes": int, "sha256": str, "dtype": str, "capture_points": list}


def index_file(shard_id: str) -> str:
    return f"{INDEX}/{check_id(shard_id, 'shard id')}.json"


def parse_index(doc: object, where: str) -> ShardIndex:
    """`doc` (a parsed index file) checked: this format version, every field of its type, the
    per-sample lists consistent. Raises ShardError naming `where`."""
    if not isinstance(doc, dict):
        raise ShardError(f"{where}: an index file holds a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ShardError(f"{where}: index format {doc.get('format')!r}, this harvest reads {FORMAT}")
    for name, kind in _FIELDS.items():
        if not isinstance(doc.get(name), kind):
            raise ShardError(f"{where}: index field {name!r} missing or not a {kind.__name__}")
    doc.setdefault("final_state", FINAL_POST_NORM)
    if doc["final_state"] not in FINAL_STATES:
        raise ShardError(f"{where}: final state {doc['final_state']!r}, this harvest reads {', '.join(FINAL_STATES)}")
    check_id(doc["shard_id"], "shard id")
    n = len(doc["samples"])
    if len(doc["tokens"]) != n or len(doc["offsets"]) != n + 1:
        raise ShardError(f"{where}: {n} samples but {len(doc['tokens'])} token counts and {len(doc['offsets'])} offsets")
    return doc  # type: ignore[return-value]
