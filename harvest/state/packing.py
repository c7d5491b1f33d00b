"""The packing record: `harvest:<run>:packing:<node>[:<packer>]`, the shard one packer of a node's
collector is committing, and `PackingRecords`, the one store that reads, writes and removes it.

Collectors write and finish it (collector.collector; collector.records says who owns it and what
fences a late one); the janitor's reclaim reads it to leave decided commits alone, and the orphan
sweep and the claims to tell a shard in flight from an abandoned one. The commit fence, which
writes the record with the shard's index document only while the spool still owns every sample,
is the ledger's move (harvest.state.ledger.Ledger.fence_commit).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from harvest.formats.index import ShardIndex
from harvest.ids import check_id
from harvest.state.keys import Keys

_DELETE_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


@dataclass
class PackingRecord:
    shard_id: str
    sample_ids: list[str]
    spool: str | None  # None: written by a harvest that predates spool leases (taken as the reader's own)
    index: ShardIndex | None = None  # set by the commit fence: the commit is decided

    def to_json(self) -> str:
        d = {"shard_id": self.shard_id, "sample_ids": self.sample_ids, "spool": self.spool}
        if self.index is not None:
            d["index"] = self.index
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PackingRecord:
        d = json.loads(raw)
        return cls(check_id(d["shard_id"], "shard id"), list(d["sample_ids"]), d.get("spool"), d.get("index"))


class PackingRecords:
    """Every packing record of a run in Redis: the only code that touches their keys."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn, self.keys = conn, Keys(run)

    def key(self, node: str, packer: int = 0) -> str:
        """The record of packer `packer` of `node`'s collector (packer 0: the node's plain key)."""
        return self.keys.packing(node, packer)

    def get(self, key: str) -> PackingRecord | None:
        raw = self.conn.get(key)
        return None if raw is None else PackingRecord.from_json(raw)

    def put(self, key: str, rec: PackingRecord) -> str:
        """Write `rec` at `key`; returns the JSON written (the commit fence requires it unchanged)."""
        raw = rec.to_json()
        self.conn.set(key, raw)
        return raw

    def clear(self, key: str) -> None:
        self.conn.delete(key)

    def clear_if_same(self, key: str, raw: bytes) -> bool:
        """Remove the record at `key` only while it is still `raw` (as `items` read it)."""
        return bool(self.conn.eval(_DELETE_IF_SAME, 1, key, raw))

    def items(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, PackingRecord, bytes]]:
        """(key, record, the record as stored) of every record of the run, but those at `skip`."""
        for key in self.conn.scan_iter(match=self.keys.packing_pattern):
            key = key.decode()
            if key in skip:
                continue
            raw = self.conn.get(key)
            if raw:
                yield key, PackingRecord.from_json(raw), raw

    def extra_packers(self, node: str) -> Iterator[int]:
        """The packer numbers, other than 0, that have a record of `node`'s collector."""
        for key in self.conn.scan_iter(match=self.keys.packing_extra_pattern(node)):
            yield int(key.decode().rsplit(":", 1)[1])

    def shard_ids(self) -> set[str]:
        """Shard ids recorded by any collector of the run as being committed."""
        return {rec.shard_id for _, rec, _ in self.items()}

    def decided_samples(self, spool: str | None = None) -> set[str]:
        """Samples in records that hold an index document (of `spool`, or of any spool)."""
        out: set[str] = set()
        for _, rec, _ in self.items():
            if rec.index is not None and (spool is None or rec.spool == spool):
                out.update(rec.sample_ids)
        return out
