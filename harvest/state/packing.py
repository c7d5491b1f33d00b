"""The packing record: `harvest:<run>:packing:<node>[:<packer>]`, the shard one packer of a node's
collector is committing, and `PackingRecords`, the one store that reads, writes and removes it.

Collectors write and finish it (harvest.collector.collector; harvest.collector.records says who owns it and what
fences a late one); the janitor's reclaim reads it to leave decided commits alone, and the orphan
sweep and the claims to tell a shard in flight from an abandoned one. The commit fence, which
writes the record with the shard's index document only while the spool still owns every sample,
is the ledger's move (harvest.state.ledger.Ledger.fence_commit), and so is its removal when the
commit ends (`ended`, in the call that marks the shard's samples done).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from harvest.formats.index import ShardIndex
from harvest.ids import check_id
from harvest.state import scripts
from harvest.state.keys import Keys


@dataclass
class PackingRecord:
    shard_id: str
    sample_ids: list[str]
    spool: str  # the spool dir whose copies the shard packs (harvest.state.spools)
    index: ShardIndex | None = None  # set by the commit fence: the commit is decided

    def to_json(self) -> str:
        d = {"shard_id": self.shard_id, "sample_ids": self.sample_ids, "spool": self.spool}
        if self.index is not None:
            d["index"] = self.index
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PackingRecord:
        d = json.loads(raw)
        return cls(check_id(d["shard_id"], "shard id"), list(d["sample_ids"]), str(d["spool"]), d.get("index"))


class PackingRecords:
    """Every packing record of a run in Redis: the only code that touches their keys.

    The run's index of record keys (`Keys.packing_index`) lets the periodic reader (every
    collector's `tend_revoked`, every 10 s) list the records in O(records), where a SCAN of the
    keyspace costs O(keys): RQ's job hashes and every worker's keys, so O(nodes^2) for the fleet.
    The readers whose answer fences a commit (a claim taken over when no record names its shard, a
    reclaim leaving decided shards alone) still SCAN as well (`complete`): they are rare, and a
    record written by hand is in no index."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn, self.keys = conn, Keys(run)

    def key(self, node: str, packer: int = 0) -> str:
        """The record of packer `packer` of `node`'s collector (packer 0: the node's plain key)."""
        return self.keys.packing(node, packer)

    def get_as_stored(self, key: str) -> tuple[PackingRecord, str] | None:
        """The record at `key` and its JSON as stored (what `clear_if_same` and the fence compare)."""
        raw = self.conn.get(key)
        return None if raw is None else (PackingRecord.from_json(raw), raw.decode())

    def put_owned(self, key: str, rec: PackingRecord, ledger_id: str, samples: bool = True) -> tuple[str, bool, str]:
        """Write `rec` at `key`, and in the same call ask whether its spool may commit its samples (not
        revoked, owning each in state s, as the commit fence asks) and restore the ledger's id
        `ledger_id` if Redis lost it. `samples=False`: the spool's revocation alone, for a caller
        whose view just found each sample spooled and its own (the fence asks again of each).
        Returns (the JSON written, whether it may commit, the ledger's id in force)."""
        raw = rec.to_json()
        ids = rec.sample_ids if samples else []
        ok, held = scripts.put_record(self.keys, key, raw, rec.spool, ids, ledger_id).run(self.conn)
        return raw, bool(ok), held.decode()

    def ended(self, key: str) -> tuple[str, str]:
        """What `Ledger.mark_done` deletes with a shard's samples (`clear=`): the record at `key`,
        and its entry in the index. Its shard's commit is over then: what is left of it (the spool
        files of done samples) the collector's next step removes, record or not."""
        return key, self.keys.packing_index

    def clear_if_same(self, key: str, raw: bytes | str) -> bool:
        """Remove the record at `key` only while it is still `raw` (as written, or as `items` read it):
        whoever clears a record clears the one it acted on, never a later one written there."""
        return bool(scripts.delete_record_if_same(self.keys, key, raw).run(self.conn))

    def adopt(self) -> int:
        """Index the records written without the index (by a harvest before it, or by hand): one
        SCAN of the keyspace, at a collector's start only. Returns how many it indexed."""
        found = [k.decode() for k in self.conn.scan_iter(match=self.keys.packing_pattern, count=1000)]
        return int(self.conn.sadd(self.keys.packing_index, *found)) if found else 0

    def _keys(self, complete: bool) -> list[str]:
        keys = {k.decode() for k in self.conn.smembers(self.keys.packing_index)}
        if complete:
            keys |= {k.decode() for k in self.conn.scan_iter(match=self.keys.packing_pattern, count=1000)}
        return sorted(keys)

    def items(
        self, skip: frozenset[str] = frozenset(), complete: bool = True
    ) -> Iterator[tuple[str, PackingRecord, bytes]]:
        """(key, record, the record as stored) of every record of the run, but those at `skip`.
        `complete=False`: the indexed records only, O(records), for a periodic pass."""
        keys = [k for k in self._keys(complete) if k not in skip]
        for key, raw in zip(keys, self.conn.mget(keys) if keys else [], strict=False):
            if raw:
                yield key, PackingRecord.from_json(raw), raw
            else:  # cleared by a harvest before the index (or just now): out of the index unless written again
                scripts.forget_record_if_gone(self.keys, key).run(self.conn)

    def extra_packers(self, node: str) -> Iterator[int]:
        """The packer numbers, other than 0, that have a record of `node`'s collector."""
        prefix = self.keys.packing(node) + ":"
        for key in self._keys(complete=True):
            if key.startswith(prefix):
                yield int(key.rsplit(":", 1)[1])

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
