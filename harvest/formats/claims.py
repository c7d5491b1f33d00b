"""Per-sample claims in the output: `claims/<sample_id>.json`, the storage side of exactly once.

The index file commits a shard (harvest.formats.index), and the ledger's commit fence keeps two
collectors of one ledger from committing one sample twice. But the ledger is Redis, and Redis can
forget (the last second of an AOF, a failover to a replica that was behind, a wipe), and two
ledgers can meet one output (two runners of the same dataset). So before a collector packs a
shard it claims every sample of it in storage, with a create that only one writer can win (S3
`If-None-Match: *`; a hard link on local folders: `Location.create_exclusive`). A claim names the
shard and the ledger (`Ledger.identity`). Outcomes per sample:

- created now, or found naming this very shard: ours;
- naming a shard whose index commits it: committed there; this collector marks it done and drops it
  (an index that excludes it, a corrupt copy dropped for re-extraction, makes the claim abandoned);
- naming a shard with no index, of this ledger and recorded by no collector of it (`Abandoned`),
  or of another ledger and older than STALE_S by the store's own clock: abandoned (its collector
  died with its record lost); taken over with a conditional delete and a new create;
- otherwise busy: another collector is committing it; this collector leaves it for later.

Who owns a claim: the collector whose packing record names the shard, from the claim until the
shard is indexed (then for ever: the claim and the index agree) or voided (it then deletes the
claims naming its shard, `release`). What fences a late one: the commit fence refuses a
collector whose packing record is no longer the one it wrote, which is exactly when a claim of
its ledger may be taken over; a collector of another ledger holds its claims at most STALE_S/2
before it must fence (`Collector.publish`), so a takeover after STALE_S never races a live commit.

Cost: one small conditional PUT per sample, made in parallel, where the shard itself takes one
PUT per 16 MiB part: for samples of a few MB of hidden states or more, claims add fewer requests
than the shard's own upload and no bytes. Readers never look at claims.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

from harvest.formats.index import committed_samples, index_file, parse_index
from harvest.ids import check_id
from harvest.storage import Location

CLAIMS = "claims"
STALE_S = 3600.0  # a claim of another ledger with no index this old (store clock) is abandoned
PARALLEL = 16  # claims in flight at once (small requests: latency, not bandwidth, bounds them)

T = TypeVar("T")


class Retry(Protocol):
    """harvest.storage.retry's shape: `fn()` retried on transient failures, `what` naming it."""

    def __call__(self, fn: Callable[[], T], what: str, /) -> T: ...


def claim_file(sample_id: str) -> str:
    return f"{CLAIMS}/{check_id(sample_id, 'sample id')}.json"


@dataclass(frozen=True)
class Claim:
    shard: str
    ledger: str

    def to_bytes(self) -> bytes:
        return json.dumps({"shard": self.shard, "ledger": self.ledger}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Claim | None:
        try:
            d = json.loads(raw)
            return cls(check_id(d["shard"], "shard id"), str(d["ledger"]))
        except (ValueError, KeyError, TypeError):
            return None  # not a claim harvest wrote: treated as abandoned


@dataclass
class ClaimOutcome:
    mine: list[str] = field(default_factory=list)  # claims naming this shard now
    committed: dict[str, str] = field(default_factory=dict)  # sample -> the indexed shard holding it
    busy: dict[str, str] = field(default_factory=dict)  # sample -> the shard another collector is committing
    taken_over: dict[str, str] = field(default_factory=dict)  # sample -> the abandoned shard it was claimed for

    @property
    def whole(self) -> bool:
        return not self.committed and not self.busy


def store_now(out: Location) -> float | None:
    """The store's clock (Unix seconds): the modification time of a probe object written now.
    Claim ages are measured with it, never with this node's clock."""
    probe = f"{CLAIMS}/.clock-{os.urandom(6).hex()}"
    out.write_atomic(probe, b"")
    try:
        return out.modified(probe)
    finally:
        out.delete(probe)


class Claimer:
    """Claims for one ledger's collector. `recorded(shard_id)`: whether some collector of this
    ledger has a packing record naming that shard (it may still commit it)."""

    def __init__(self, out: Location, ledger_id: str, recorded: Callable[[str], bool], retry: Retry) -> None:
        self.out, self.ledger_id, self.recorded, self.retry = out, ledger_id, recorded, retry

    def claim(self, shard_id: str, sample_ids: list[str]) -> ClaimOutcome:
        """Claim every sample for `shard_id`; the outcome says which are ours and why not the rest."""
        mine = Claim(shard_id, self.ledger_id).to_bytes()
        with ThreadPoolExecutor(min(PARALLEL, max(1, len(sample_ids))), thread_name_prefix="claims") as pool:
            created = list(pool.map(lambda s: self._create(s, mine), sample_ids))
        out = ClaimOutcome()
        now: list[float | None] = []  # the store's clock, read once if a foreign claim needs an age
        for sid, ok in zip(sample_ids, created, strict=True):
            if ok:
                out.mine.append(sid)
            else:
                self._settle(sid, shard_id, mine, out, now)
        return out

    def release(self, shard_id: str, sample_ids: list[str]) -> int:
        """Delete the claims naming `shard_id` (a shard given up before its index); returns how many."""
        mine = Claim(shard_id, self.ledger_id).to_bytes()
        with ThreadPoolExecutor(min(PARALLEL, max(1, len(sample_ids))), thread_name_prefix="claims") as pool:
            return sum(
                pool.map(
                    lambda s: bool(
                        self.retry(
                            lambda: self.out.delete_if(claim_file(s), mine), f"releasing {self.out.path(claim_file(s))}"
                        )
                    ),
                    sample_ids,
                )
            )

    def _create(self, sid: str, body: bytes) -> bool:
        name = claim_file(sid)
        return bool(self.retry(lambda: self.out.create_exclusive(name, body), f"claiming {self.out.path(name)}"))

    def _settle(self, sid: str, shard_id: str, mine: bytes, out: ClaimOutcome, now: list[float | None]) -> None:
        name = claim_file(sid)
        for _ in range(3):  # a claim deleted or replaced under us: look again
            raw = self.retry(lambda: _read_or_none(self.out, name), f"reading {self.out.path(name)}")
            if raw is None:
                if self._create(sid, mine):
                    out.mine.append(sid)
                    return
                continue
            held = Claim.from_bytes(raw)
            if held is not None and held.shard == shard_id and held.ledger == self.ledger_id:
                out.mine.append(sid)  # ours, from an earlier attempt at this very shard
                return
            doc = None
            if held is not None:
                index = index_file(held.shard)
                doc = self.retry(partial(_read_or_none, self.out, index), f"reading {self.out.path(index)}")
                if doc is not None and sid in committed_samples(parse_index(json.loads(doc), index)):
                    out.committed[sid] = held.shard
                    return
            # an index that excludes the sample (a corrupt copy dropped for re-extraction, a duplicate)
            # no longer commits it: its claim is abandoned
            if held is not None and doc is None and not self._abandoned(held, name, now):
                out.busy[sid] = held.shard
                return
            if self.retry(
                partial(self.out.delete_if, name, raw), f"taking over {self.out.path(name)}"
            ) and self._create(sid, mine):
                out.mine.append(sid)
                out.taken_over[sid] = held.shard if held else "?"
                return
        out.busy[sid] = "?"  # contended three times over: leave it for the next shard

    def _abandoned(self, held: Claim, name: str, now: list[float | None]) -> bool:
        if held.ledger == self.ledger_id:
            return not self.recorded(held.shard)  # its collector's record is gone: its fence refuses it
        if not now:
            now.append(self.retry(lambda: store_now(self.out), f"reading the clock of {self.out.url()}"))
        born = self.retry(lambda: _modified_or_none(self.out, name), f"dating {self.out.path(name)}")
        return now[0] is not None and born is not None and now[0] - born > STALE_S


def _read_or_none(out: Location, name: str) -> bytes | None:
    try:
        return out.read_bytes(name)
    except FileNotFoundError:
        return None


def _modified_or_none(out: Location, name: str) -> float | None:
    try:
        return out.modified(name)
    except FileNotFoundError:
        return None
