"""The packing record's format: `harvest:<run>:packing:<node>`, the shard a node's collector is
committing. Collectors write and finish it (collector.records, which says who owns it and what
fences a late one); the janitor's reclaim reads it to leave decided commits alone."""

from __future__ import annotations

import json
from dataclasses import dataclass

from harvest.formats.index import ShardIndex
from harvest.ids import check_id


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
