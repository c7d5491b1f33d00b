"""Spool files the collector cannot commit: set aside, their samples extracted again or failed.

A spool file records the crc32 of each tensor as its worker verified it (harvest.formats.spool).
The collector finds a file damaged (`SpoolDamaged`) when it reads its header (unreadable,
shorter than the header says: `inspect_sample`), or as it copies it into a shard (a short or
failed read, or bytes whose crc32 is not the worker's: `ShardPlan.damaged`, raised here as
`Damaged` once the packed bytes are discarded). Then, in this order:

1. the shard being packed, if any, is voided before the commit fence (the caller's
   `Collector.void`): never indexed, its object, upload and claims removed, its record cleared;
2. the sample goes back to the queue, a new job built from its kept payload row, in one
   MULTI/EXEC with the count of its damaged files (`Keys.spool_damaged`) and only while this
   spool owns it (harvest.ops.reclaim.enqueue_again); once it has been extracted again
   `DAMAGED_RETRIES` times it fails as `spool-damaged` instead, its row kept for `harvest requeue`;
3. the file moves aside as `.bad-<name>` (harvest.node.spooldir.set_aside_path) for a person.

A file that reads but does not match the run (another sample, dtype or shape; no checksums) fails
its sample as `bad-spool` at once and moves aside too. The shard's other samples stay spooled and
go into the next shard; nothing here stops the collector. A kill after 1 leaves the file and the
sample spooled: the next pass finds the same damage. After 2 the sample is queued and its file
still in place: the collector skips queued samples, and the sample's next spool file, on this
node, replaces it (same name), or, on another, makes the collector delete it as not its own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

import redis

from harvest.collector.pack import Packed
from harvest.collector.records import Voided
from harvest.config import RunConfig
from harvest.formats.shard import ShardPlan
from harvest.formats.spool import SpoolDamaged, SpoolEntry, SpoolError, inspect_sample
from harvest.node.spooldir import set_aside_path
from harvest.ops.reclaim import enqueue_again
from harvest.state.failures import BAD_SPOOL, SPOOL_DAMAGED
from harvest.state.keys import Keys
from harvest.state.ledger import SPOOLED, Ledger

log = logging.getLogger("harvest.collector")

DAMAGED_RETRIES = 2  # extractions again of a sample whose spool file was damaged, before it fails


class Damaged(Voided):
    """Spool files of the shard being packed were found damaged: the shard must never be indexed,
    and these files (sample id -> what is wrong) go aside (`reject`)."""

    def __init__(self, found: Mapping[str, SpoolError]) -> None:
        self.found = dict(found)
        super().__init__("; ".join(str(e) for e in self.found.values()))


def inspect_all(cfg: RunConfig, files: list[tuple[str, str]]) -> tuple[list[SpoolEntry], dict[str, SpoolError]]:
    """The headers of (sample id, path) spool files checked against the run (`inspect_sample`):
    their entries, and what is wrong with the others."""
    entries, bad = [], {}
    for sid, path in files:
        try:
            entries.append(inspect_sample(path, sid, len(cfg.capture_points), cfg.hidden_size, cfg.torch_dtype))
        except SpoolError as e:
            bad[sid] = e
    return entries, bad


def checked(plan: ShardPlan, pack: Callable[[], Packed]) -> Packed:
    """What `pack` stored if every sample's bytes, as packed, have the crc32s its worker recorded.
    Else `Damaged`: a spool file that failed the copy (truncated, unreadable: `pack` removed what
    it stored), or bytes whose sums differ (then discarded here: the temporary file removed, the
    upload aborted)."""
    try:
        packed = pack()
    except SpoolDamaged as e:
        raise Damaged({next(x.id for x in plan.entries if x.path == e.path): e}) from None
    found = plan.damaged(packed.sums)
    if not found:
        return packed
    if packed.tmp is not None:
        try:
            os.unlink(packed.tmp)
        except FileNotFoundError:
            pass
    if packed.upload is not None:
        packed.upload.abort()  # best effort: the void removes any upload of the shard by name
    raise Damaged(found)


def reject(
    conn: redis.Redis, cfg: RunConfig, spool: str, paths: Mapping[str, str], found: Mapping[str, SpoolError]
) -> None:
    """Spool files (sample id -> its path, and what is wrong) that will not be committed, after any
    shard holding them was voided: each sample back on the queue or failed, then each file aside
    (see the module docstring). `spool`: the spool id its samples must be owned by."""
    ledger, key = Ledger(conn, cfg.run), Keys(cfg.run).spool_damaged
    damaged = [sid for sid, e in found.items() if isinstance(e, SpoolDamaged)]
    failures = {sid: (BAD_SPOOL, str(e)) for sid, e in found.items() if not isinstance(e, SpoolDamaged)}
    told = {sid: f"{found[sid]}: failed ({BAD_SPOOL})" for sid in failures}
    if damaged:
        states, owners = ledger.states_and_owners(damaged)
        # its owner: this spool, or none (spooled without one, which a move of owner '' takes)
        ours = {
            sid: o or ""
            for sid, st, o in zip(damaged, states, owners, strict=False)
            if st == SPOOLED and o in (None, spool)
        }
        seen = dict(zip(ours, (int(n or 0) for n in conn.hmget(key, list(ours))), strict=False)) if ours else {}
        again = [sid for sid in ours if seen[sid] < DAMAGED_RETRIES]
        requeued, lost = [], []
        for owner in sorted({ours[sid] for sid in again}):
            ids = [sid for sid in again if ours[sid] == owner]
            moved, _, kept_none = enqueue_again(
                conn, cfg, owner, ids, also=lambda pipe, ids=ids: [pipe.hincrby(key, sid, 1) for sid in ids]
            )
            requeued, lost = requeued + moved, lost + kept_none
        for sid in requeued:
            told[sid] = (
                f"{found[sid]}: its sample goes back to the queue to be extracted again "
                f"(retry {seen[sid] + 1} of {DAMAGED_RETRIES})"
            )
        spent = [sid for sid in ours if sid not in requeued]
        for sid in spent:
            why = (
                "no payload row was kept to extract it again"
                if sid in lost
                else f"damaged each of the "
                f"{DAMAGED_RETRIES + 1} times it was extracted: check the node's disk and memory"
            )
            failures[sid] = (SPOOL_DAMAGED, f"{found[sid]}; {why}")
            told[sid] = f"{found[sid]}: failed ({SPOOL_DAMAGED}: {why})"
        for sid in set(damaged) - set(ours):
            told[sid] = f"{found[sid]}: its sample is not this spool's to extract again (left as it is)"
    if failures:
        rows = dict(zip(failures, ledger.spooled_payloads(list(failures)), strict=False))
        ledger.mark_failed(failures, rows={sid: r for sid, r in rows.items() if r is not None})
        conn.hdel(key, *failures)
    for sid, path in paths.items():
        aside = set_aside_path(path)
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            pass
        log.error("%s; the file is set aside as %s", told[sid], aside)
