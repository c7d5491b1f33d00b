"""The packing record: the one shard a node's collector is committing, kept in Redis (its format
and its store, `PackingRecords`, are harvest.state.packing's; this module holds the collectors' rules).

`harvest:<run>:packing:<node>` holds `{shard_id, sample_ids, spool}` from the moment a shard is
chosen until it is committed or given up, so a restarted collector finishes the same shard.
Once the commit fence passes (harvest.state.ledger.Ledger.fence_commit: the spool still owns
every sample and is not revoked) the record also holds the shard's index document, and the
commit is decided: whoever reads the record finishes it by writing that index (the same bytes
whoever writes them) and marking the samples done. That is the node's collector after a
restart, or any collector of the run once the node's spool is revoked (the node is gone).

A record without an index whose spool is revoked is void: its samples went back to the queue,
so its shard must never be indexed; whoever finds it removes the shard's object and the record.

Who owns a name: the shard id in a record is drawn fresh when the record is first written
(harvest.ids.new_shard_id) and kept by every resume, so the shard object, its multipart uploads and
the claims naming `{shard, ledger}` belong to that one record. Voiding it (`give_up_shard`, by the
record's collector or by `tend_revoked`) removes only them: never another collector's re-pack of the
same samples, which has a name of its own. A decided record is only ever finished, never voided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import redis

from harvest.formats.claims import Claimer
from harvest.formats.generated import generated_file
from harvest.formats.index import encode_index, index_file
from harvest.formats.shard import shard_file
from harvest.state.ledger import Ledger
from harvest.state.packing import PackingRecord, PackingRecords
from harvest.state.spools import SpoolLeases
from harvest.storage import Location

log = logging.getLogger("harvest.collector")

Retry = Callable[[Callable[[], object], str], object]


class Voided(Exception):
    """The commit fence refused a shard: it must never be indexed."""


def write_decided_index(out: Location, rec: PackingRecord, retry: Retry) -> None:
    name = index_file(rec.shard_id)
    if not retry(lambda: out.exists(name), f"checking {out.path(name)}"):
        retry(lambda: out.write_atomic(name, encode_index(rec.index)), f"writing {out.path(name)}")


def remove_shard(out: Location, shard_id: str, retry: Retry) -> None:
    """A void shard's object (and any unfinished upload of it) out of storage; never an indexed one."""
    name = shard_file(shard_id)
    retry(lambda: out.abort_uploads(name), f"aborting unfinished uploads of {out.path(name)}")
    if retry(lambda: out.exists(index_file(shard_id)), f"checking {out.path(index_file(shard_id))}"):
        return
    for leftover in (name, generated_file(shard_id)):  # a --regenerate run's conversations go with their shard
        if retry(partial(out.exists, leftover), f"checking {out.path(leftover)}"):
            retry(partial(out.delete, leftover), f"deleting {out.path(leftover)}")


def give_up_shard(out: Location, claimer: Claimer, shard_id: str, sample_ids: list[str], retry: Retry) -> None:
    """A shard that will never be indexed: its object (and unfinished uploads) removed, then the
    claims naming it released, so its samples can be claimed for another shard. The record goes
    last (the caller's), so a kill in between leaves it to be given up again."""
    remove_shard(out, shard_id, retry)
    claimer.release(shard_id, sample_ids)


def recorded_anywhere(conn: redis.Redis, run: str, shard_id: str) -> bool:
    """Whether any collector of this ledger has a packing record naming `shard_id` (it may still
    commit it). O(nodes): asked only when a claim in storage names a shard with no index."""
    return shard_id in PackingRecords(conn, run).shard_ids()


def tend_revoked(conn: redis.Redis, run: str, out: Location, retry: Retry, own_keys: frozenset[str]) -> int:
    """Finish the decided records, and clear the void ones, of nodes whose spool was revoked.
    Returns the samples this call moved to done."""
    records, ledger, leases = PackingRecords(conn, run), Ledger(conn, run), SpoolLeases(conn, run)
    done = 0
    for key, seen, _ in records.items(skip=own_keys, complete=False):  # periodic: the index, not a SCAN
        if not leases.is_revoked(seen.spool):
            continue  # a live node's shard in progress: its own collector's
        # Read again now that the revocation is seen: no fence passes for a revoked spool, so whether
        # this read holds an index is final, where the first read may predate a fence that passed
        # just before the revocation (voiding that would delete a decided shard's object).
        got = records.get_as_stored(key)
        if got is None or got[0].spool != seen.spool:
            continue  # finished, or rewritten by its owner under a new spool id: a later pass looks again
        rec, raw = got
        if rec.index is not None:
            write_decided_index(out, rec, retry)
            tokens = dict(zip(rec.index["samples"], rec.index["tokens"], strict=False))
            changed = ledger.mark_done(rec.sample_ids, tokens=[tokens.get(s, 0) for s in rec.sample_ids])
            if changed:
                ledger.add_stats(bytes_done=rec.index["bytes"], shards=1)
            done += len(changed)
            log.warning(
                "finished shard %s of revoked spool %s (%s): %d samples", rec.shard_id, rec.spool, key, len(changed)
            )
        else:
            give_up_shard(
                out, Claimer(out, ledger.identity(), lambda _: True, retry), rec.shard_id, rec.sample_ids, retry
            )
            log.warning("removed void shard %s of revoked spool %s (%s)", rec.shard_id, rec.spool, key)
        records.clear_if_same(key, raw)
    return done
