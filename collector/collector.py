"""One collector per node packs the node's spool into shards and commits them.

Commit order is the contract readers rely on: record the shard's sample set in Redis, stream
the shard out of the spool files (to object storage: into a multipart upload, harvest.multipart;
to a local output: into a temporary file in the shards folder, fsynced), make it visible whole
(complete the upload; rename), write its index file (the commit), mark the samples done, delete
their spool files, clear the record. A collector killed anywhere in that sequence finds the
record on restart and finishes the same shard (same samples, same order, same bytes, under the
name the record holds): an unfinished upload of it is aborted, and a stored shard that lacks its
index is simply overwritten by the identical re-pack, so no sample is packed twice and none is
lost. Each shard a collector records gets a fresh random name (harvest.ids.new_shard_id), so what
a collector voids (the object, its uploads, the claims naming it) is only ever its own attempt's,
never another collector's re-pack of the same samples.

Tensor bytes are copied out of the spool files undecoded (with a codec, the hidden states are
first coded into a scratch file in the spool: harvest.collector.pack), with no temporary shard on the
node's disk for object storage. To object storage, or to a local output on another filesystem,
they are streamed through small buffers and hashed on that one pass (write_shard); to a local
output on the spool's filesystem the kernel copies them, cloning blocks where the filesystem can,
and a second thread hashes the file as it fills (copy_shard: both harvest.formats.shard_write). Memory:
the copy buffers, plus the parts in flight to object storage. Storage errors that persist stop
the collector with a `StorageError`; the spool and the record stay, so a restart resumes.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from harvest.atomic import unlink_quiet
from harvest.collector.due import QueuedCheck, may_be_due
from harvest.collector.faults import CrashHook
from harvest.collector.integrity import Damaged, checked, inspect_all, reject
from harvest.collector.pack import Packed, clear_scratch, pack_shard, scratch_file, staging_dir
from harvest.collector.records import Voided, give_up_shard, recorded_anywhere, tend_revoked, write_decided_index
from harvest.collector.sweep import sweep_orphans
from harvest.collector.unknown import take_up
from harvest.config import RunConfig
from harvest.formats.claims import STALE_S, Claimer
from harvest.formats.generated import generated_file, store_generated
from harvest.formats.index import index_file
from harvest.formats.runfile import run_location
from harvest.formats.shard import ShardPlan, plan_shard, shard_file
from harvest.formats.spool import SpoolEntry, SpoolError
from harvest.ids import check_id, new_shard_id, node_name
from harvest.node.spooldir import list_spooled, spool_identity, spool_path
from harvest.settings import CollectorSettings
from harvest.state.ledger import DONE, FAILED, QUEUED, SPOOLED, Ledger
from harvest.state.packing import PackingRecord, PackingRecords
from harvest.state.spools import SpoolLeases
from harvest.state.tally import Tally
from harvest.storage import TEMP_PREFIX, StorageError, retry

log = logging.getLogger("harvest.collector")
T = TypeVar("T")

TEND_S = 10.0  # how often the run loop looks for the packing records of revoked spools
BUSY_S = 10.0  # how long samples another collector is committing (claimed in storage) are left alone


class Collector:
    def __init__(
        self,
        conn: redis.Redis,
        cfg: RunConfig,
        spool_dir: str,
        node: str | None = None,
        shard_bytes: int | None = None,
        max_wait: float = CollectorSettings.max_wait_s,
        part_bytes: int | None = None,
        retries: int = CollectorSettings.storage_retries,
        retry_delay: float = CollectorSettings.retry_delay_s,
        orphan_age: float = CollectorSettings.orphan_age_s,
        packer: int = 0,
        packers: int = 1,
        tally: Tally | None = None,
    ) -> None:
        self.conn, self.cfg, self.spool_dir = conn, cfg, spool_dir
        self.spool_id = spool_identity(spool_dir)
        self.node = check_id(node or node_name(), "node name")
        self.ledger = Ledger(conn, cfg.run)
        # Packer `packer` of the node's `packers` (harvest.collector.packers): its own record, and only the
        # spool files of its slice of the sample ids, so no two packers ever pick the same sample.
        self.packer, self.packers = packer, packers
        self.records = PackingRecords(conn, cfg.run)
        self.packing_key = self.records.key(self.node, packer)
        self.shard_bytes, self.max_wait, self.part_bytes = shard_bytes or cfg.shard_bytes, max_wait, part_bytes
        self.retries, self.retry_delay, self.orphan_age = retries, retry_delay, orphan_age
        self.out = run_location(cfg.out_url, cfg.run)
        if not self.out.is_local and not hasattr(self.out.fs, "call_s3"):
            raise StorageError(f"output {self.out.url()}: shards go to a local folder or to S3 (multipart uploads)")
        # Local output: build the shard in its final folder so committing is a rename.
        self.stage = staging_dir(self.out)  # a read-only or full output: a StorageError, told as one line
        self.shards_committed = 0
        self.set_aside = 0  # spool files this collector moved aside (harvest.collector.integrity)
        # The commits' stats, written at the node's beat (harvest.collector.packers), not with each commit;
        # a Collector made without the node's tally keeps them until its owner flushes `tally`
        self.tally = tally or Tally(conn, cfg.run)
        self._recorded_spool: str | None = None  # the spool the record of the shard in flight names
        self._record_json = ""  # that record as written, which the fence requires to be unchanged
        self._refused = ""  # why, as the record was written, its shard may not be committed ('' it may)
        self._viewed_spool: str | None = None  # the spool whose samples `choose` last read
        self._claimed: tuple[str, float] | None = None  # (shard in flight, time.monotonic()) once claimed in storage
        self._busy: dict[str, float] = {}  # sample -> monotonic time until which another collector has it
        self.claimer = Claimer(
            self.out, self.ledger.identity(), lambda shard: recorded_anywhere(conn, cfg.run, shard), self._retry
        )
        self.leases = SpoolLeases(conn, cfg.run)
        self._queued = QueuedCheck(conn, self.ledger.keys.counts)  # harvest.collector.due
        self._crash = CrashHook.from_env()

    def renew_lease(self) -> None:
        """Renew the spool's lease (harvest.state.spools). A revoked spool (reclaimed while this node
        was silent) takes a new id: the files of the old one are then not ours, and go."""
        self.spool_id = self.leases.renew_or_rotate(self.spool_dir, self.spool_id, self.node)

    def tend_others(self, own_keys: frozenset[str] = frozenset()) -> int:
        """Finish or clear the packing records of nodes whose spool was revoked (harvest.collector.records);
        `own_keys`: this node's other packers' records, which they tend themselves."""
        return tend_revoked(self.conn, self.cfg.run, self.out, self._retry, own_keys | {self.packing_key})

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        return retry(fn, what, attempts=self.retries, base_delay=self.retry_delay)

    def _temp_path(self, shard_id: str) -> str:
        return os.path.join(self.stage, f"{TEMP_PREFIX}{self.node}-{shard_id}.safetensors")

    def _clear_temps(self) -> None:
        """Temporary shard (and scratch) files a killed incarnation of this node's collector left behind."""
        clear_scratch(self.spool_dir, self.node)
        if self.stage is None:
            return
        for p in glob.glob(os.path.join(glob.escape(self.stage), f"{TEMP_PREFIX}{self.node}-*.safetensors")):
            unlink_quiet(p)

    def resume(self) -> None:
        """Finish the shard a previous incarnation of this collector was committing (or give it
        up, if this spool was reclaimed meanwhile), finish or clear the records of revoked
        spools, and sweep orphan shards (uploaded, never committed, not recorded by anyone).
        With several packers, only the first calls this, before any packs (it clears the node's
        temporary shard files); the others call `resume_record`."""
        self._clear_temps()
        self.renew_lease()
        self.records.adopt()  # records of an older collector into the index its periodic pass reads
        self.tend_others()
        self.resume_record()

    def resume_record(self) -> None:
        """Finish (or void) the shard this packer's record names; else sweep orphan shards."""
        got = self.records.get_as_stored(self.packing_key)
        if got is None:
            self._retry(lambda: sweep_orphans(self.out, self.conn, self.cfg, self.orphan_age), "sweeping orphan shards")
            return
        rec, self._record_json = got
        log.info("resuming shard %s (%d samples)", rec.shard_id, len(rec.sample_ids))
        if rec.index is not None:  # the commit was decided before the restart
            write_decided_index(self.out, rec, self._retry)
            # Its stats in full: a decided record means its commit's move never ran (it clears the
            # record), and what may have moved its samples since (reconcile) counts no tokens
            self._finish_samples(
                rec.sample_ids,
                [spool_path(self.spool_dir, s) for s in rec.sample_ids],
                stats={"bytes_done": rec.index["bytes"], "shards": 1, "tokens_done": sum(rec.index["tokens"])},
            )
            return
        if rec.spool not in (None, self.spool_id):  # this spool was revoked and renamed since
            self._void(rec.shard_id, rec.sample_ids, f"spool {rec.spool} was reclaimed while the shard was in flight")
            return
        name = shard_file(rec.shard_id)
        if self._retry(lambda: self.out.abort_uploads(name), f"aborting unfinished uploads of {self.out.path(name)}"):
            log.info("aborted the unfinished upload of %s left by the previous collector", name)
        self._commit(rec.sample_ids, resumed_shard=rec.shard_id)

    def _reject(self, bad: dict[str, SpoolError]) -> int:
        """Spool files that will not be committed, once no shard in flight holds them: set aside,
        their samples extracted again or failed (harvest.collector.integrity). Returns 0: nothing committed."""
        reject(self.conn, self.cfg, self.spool_id, {sid: spool_path(self.spool_dir, sid) for sid in bad}, bad)
        self.set_aside += len(bad)
        return 0

    def step(self, force: bool = False) -> int:
        """Commit one shard if one is due (full, or its oldest sample older than max_wait, or
        nothing left queued); returns the number of samples committed."""
        chosen = self.choose(force)
        return self._commit([e.id for e in chosen], entries=chosen) if chosen else 0

    def choose(self, force: bool) -> list[SpoolEntry]:
        """The samples of the next shard if one is due, their headers checked."""
        now = time.monotonic()
        self._busy = {s: t for s, t in self._busy.items() if t > now}
        files = [f for f in list_spooled(self.spool_dir) if self._mine(f[0]) and f[0] not in self._busy]
        if not files:
            return []
        if not (force or may_be_due(files, self.shard_bytes, self.max_wait, self._queued)):
            return []
        ids = [sid for sid, _, _ in files]
        ready, unknown = [], []
        self._viewed_spool = self.spool_id  # the record's ownership test then asks only this spool's revocation
        for (sid, path, size), st, owner in zip(files, *self.ledger.states_and_owners(ids), strict=True):
            if st in (DONE, FAILED) or (st == SPOOLED and owner not in (None, "", self.spool_id)):
                # committed already, given up on, or accepted from another node's spool (a retry
                # of a job whose worker died between writing this file and marking it): not ours
                unlink_quiet(path)
            elif st is None:  # unknown to a ledger that forgot it: taken up (harvest.collector.unknown), packed later
                unknown.append((sid, path))
            elif st != QUEUED:  # queued: its worker died before marking it, and its job will run again
                ready.append((sid, path, size))
        take_up(self.ledger, self.cfg.run, self.spool_id, unknown)
        if not ready:
            return []
        # Due or not is decided from sizes, ages and the queue alone; spool headers are read
        # only for a shard that will be committed (a poll while a 1 GiB shard fills read
        # every waiting file's header twice a second).
        picked, total, full = [], 0, False
        for sid, path, size in ready:
            if picked and total + size > self.shard_bytes:
                full = True  # the next sample would overflow the shard
                break
            picked.append((sid, path))
            total += size
        full = full or total >= self.shard_bytes
        try:
            oldest_age = time.time() - os.stat(ready[0][1]).st_mtime
        except FileNotFoundError:
            oldest_age = 0.0
        if not (force or full or oldest_age >= self.max_wait or self._queued.none()):
            return []
        chosen, bad = inspect_all(self.cfg, picked)
        if bad:
            self._reject(bad)
        return chosen

    def _mine(self, sid: str) -> bool:
        return self.packers == 1 or int(sid[:8], 16) % self.packers == self.packer

    def _commit(
        self, sample_ids: list[str], resumed_shard: str | None = None, entries: list[SpoolEntry] | None = None
    ) -> int:
        """Commit one shard of `sample_ids`: named afresh, or `resumed_shard`, the name its record
        holds. `entries`: the spool headers `step` already read and checked (a resume reads them)."""
        paths = [spool_path(self.spool_dir, s) for s in sample_ids]
        present = [os.path.exists(p) for p in paths]
        if resumed_shard and not all(present):
            # Spool files are deleted only after the index was written and the ledger updated.
            if self._retry(lambda: self.out.exists(index_file(resumed_shard)), f"checking {index_file(resumed_shard)}"):
                self._finish_samples(sample_ids, paths)
                return 0
            raise RuntimeError(
                f"shard {resumed_shard} was being packed but {present.count(False)} of its spool files are gone "
                "and it has no index file: the spool was modified outside harvest"
            )
        viewed = entries is not None  # chosen by `choose`, which checked the headers
        if entries is None:  # a resumed record: its files' headers are read now
            entries, bad = inspect_all(self.cfg, list(zip(sample_ids, paths, strict=True)))
            if bad:
                self._void(resumed_shard, sample_ids, "; ".join(str(e) for e in bad.values()))
                return self._reject(bad)
        plan = self.plan(entries, resumed_shard)
        self.record(plan, viewed=viewed)
        # A fresh name has no index; a resumed one has when the last incarnation died after writing it
        if not (
            resumed_shard
            and self._retry(lambda: self.out.exists(index_file(resumed_shard)), f"checking {index_file(resumed_shard)}")
        ):
            if self._refused:  # asked with the record's write
                self.void(plan, f"{self._refused}: nothing packed")
                return 0
            if not self.claim(plan):
                return 0
            try:
                packed = self.pack(plan)
                self.publish(plan := packed.plan, packed)  # with a codec, the plan of the coded shard
            except Voided as e:
                self.void(plan, str(e))  # Damaged: a spool file changed on the node; the rest go in the next shard
                return self._reject(e.found) if isinstance(e, Damaged) else 0
            except StorageError as e:
                if self._record_is_mine():
                    raise  # the spool and the record stay: a restart finishes the shard
                # Its record was cleared (a tend pass gave the shard up, its spool revoked while this
                # node was silent, and aborted its upload): the fence would refuse it, so it is void.
                self.void(plan, f"its packing record is gone (spool reclaimed?) and storing it failed: {e}")
                return 0
        return self.finish(plan)

    def _record_is_mine(self) -> bool:
        got = self.records.get_as_stored(self.packing_key)
        return got is not None and got[1] == self._record_json

    def claim(self, plan: ShardPlan) -> bool:
        """Claim the shard's samples in storage (harvest.formats.claims) before any byte is packed.
        Samples already committed elsewhere (a Redis that forgot a commit, another runner on this
        output) are marked done from that truth; samples another collector is committing are
        left alone for BUSY_S. Either way this shard is given up, so False, and the next one is
        chosen from what remains."""
        got = self.claimer.claim(plan.shard_id, plan.sample_ids)
        self._claimed = (plan.shard_id, time.monotonic())
        self._crash("claimed")
        for sid, old in got.taken_over.items():
            log.warning("sample %s: took over its claim by shard %s, abandoned with no index", sid, old)
        if got.whole:
            return True
        if got.committed:
            self.ledger.mark_done(list(got.committed))
            for sid in got.committed:
                unlink_quiet(spool_path(self.spool_dir, sid))
            log.warning(
                "%d samples of shard %s are committed already (e.g. %s in shard %s): marked done from "
                "storage, not packed again",
                len(got.committed),
                plan.shard_id,
                *next(iter(got.committed.items())),
            )
        until = time.monotonic() + BUSY_S
        self._busy.update({sid: until for sid in got.busy})
        self.void(
            plan,
            f"{len(got.committed)} of its samples are committed in other shards and {len(got.busy)} are "
            "being committed by another collector",
        )
        return False

    def plan(self, entries: list[SpoolEntry], shard_id: str | None = None) -> ShardPlan:
        """The layout of a shard of `entries`, named `shard_id` (a resumed record's) or afresh: a new
        name for every shard recorded, so no other attempt at the same samples (this ledger's or
        another's) ever shares it (harvest.ids.new_shard_id)."""
        return plan_shard(
            entries,
            self.cfg.run,
            self.cfg.capture_points,
            self.cfg.torch_dtype,
            shard_id=shard_id or new_shard_id(),
            codec=self.cfg.codec,
        )

    def record(self, plan: ShardPlan, viewed: bool = False) -> None:
        """The one record per node of the shard being committed, which a restart finishes, with the
        fence's ownership test and the ledger's id (restored if Redis lost it) in one call. `viewed`:
        chosen by `choose`, whose view found each sample spooled and owned by this spool: the test
        then asks only whether it was revoked since. A node back late after its spool was revoked
        fails that test (or its spool took a new id, and asks of each sample); a sample that
        changed hands since the view, or a Redis that lost its last second (this record, a move),
        is refused by the commit fence, which asks of each sample and that the record is unchanged."""
        # The spool this record names is the one the fence checks: packer 0 may renew the lease (and
        # rotate the id of a revoked spool) for every packer while this one is mid-commit.
        self._recorded_spool = spool = self.spool_id
        self._record_json, owned, held = self.records.put_owned(
            self.packing_key,
            PackingRecord(plan.shard_id, plan.sample_ids, spool),
            self.claimer.ledger_id,
            samples=not (viewed and self._viewed_spool == spool),
        )
        self._refused = "" if owned else f"spool {spool} does not own all of its samples (reclaimed, or lost keys)"
        if held != self.claimer.ledger_id:  # a Redis lost it and another process took a new one
            self._refused, self.claimer.ledger_id = f"the ledger's id is {held} now, not {self.claimer.ledger_id}", held
        self._crash("recorded")

    def pack(self, plan: ShardPlan) -> Packed:
        """The shard's bytes streamed out of the spool files into storage, not yet visible, each
        sample's crc32s the ones its worker recorded; else `Damaged` (harvest.collector.integrity)."""
        tmp = None if self.stage is None else self._temp_path(plan.shard_id)
        return checked(
            plan,
            lambda: pack_shard(
                self.out,
                plan,
                tmp,
                scratch_file(self.spool_dir, self.node, plan.shard_id),
                self.spool_dir,
                self.part_bytes,
                self.retries,
                self.retry_delay,
                self._crash,
            ),
        )

    def publish(self, plan: ShardPlan, packed: Packed) -> None:
        """The shard made visible whole, then the commit fence, then the index. Raises Voided when
        the fence refuses: the spool no longer owns every sample (it was reclaimed)."""
        name = shard_file(plan.shard_id)
        if packed.upload is not None:
            packed.upload.complete(f"completing the upload of {self.out.path(name)}")
        else:
            try:
                self._retry(
                    lambda: self.out.put_file(packed.tmp, name, progress=lambda _: self._crash("uploading")),
                    f"renaming {packed.tmp} to {self.out.path(name)}",
                )
            finally:
                unlink_quiet(packed.tmp)
        self._crash("uploaded")
        spool = self._recorded_spool
        if self._claimed is None or self._claimed[0] != plan.shard_id:
            raise RuntimeError(f"shard {plan.shard_id} is published before its samples are claimed (Collector.claim)")
        if time.monotonic() - self._claimed[1] > STALE_S / 2:  # another ledger may take claims this old over
            raise Voided(f"shard {plan.shard_id} took over {STALE_S / 2:.0f} s from its claims to its commit")
        index = plan.index(packed.sums)
        if gen := [e.generation for e in plan.entries if e.generation is not None]:  # a --regenerate run's turns
            index["generated"] = self._retry(
                lambda: store_generated(self.out, plan.shard_id, gen),
                f"writing the generated file {self.out.path(generated_file(plan.shard_id))}",
            )
        rec = PackingRecord(plan.shard_id, plan.sample_ids, spool, index=index)
        if not self.ledger.fence_commit(spool, plan.sample_ids, self.packing_key, rec.to_json(), self._record_json):
            raise Voided(
                f"the commit fence refused shard {plan.shard_id}: spool {spool} no longer owns all of its "
                "samples (reclaimed while this node was silent?), or its packing record is gone (a Redis "
                "that forgot it)"
            )
        self._crash("fenced")
        write_decided_index(self.out, rec, self._retry)
        self._crash("indexed")

    def void(self, plan: ShardPlan, why: str) -> None:
        """Give up a shard: never indexed, its object and its claims removed, the record cleared."""
        self._void(plan.shard_id, plan.sample_ids, why)

    def _void(self, shard_id: str, sample_ids: list[str], why: str) -> None:
        """Everything named `shard_id` is this attempt's own (its name is unique to its record), and
        so is the record, cleared only while it is still the one this collector wrote or resumed."""
        log.warning("shard %s given up: %s", shard_id, why)
        give_up_shard(self.out, self.claimer, shard_id, sample_ids, self._retry)
        self.records.clear_if_same(self.packing_key, self._record_json)
        self.renew_lease()

    def finish(self, plan: ShardPlan) -> int:
        """After the index: ledger and record, the stats counted, then the spool files (`_finish_samples`)."""
        sample_ids = plan.sample_ids
        self._finish_samples(
            sample_ids,
            [e.path for e in plan.entries],
            tokens=[e.num_tokens for e in plan.entries],
            stats={"bytes_done": plan.nbytes, "shards": 1},
        )
        self.shards_committed += 1
        log.info(
            "committed shard %s: %d samples, %d tokens, %.1f MB to %s",
            plan.shard_id,
            len(sample_ids),
            sum(e.num_tokens for e in plan.entries),
            plan.nbytes / 1e6,
            self.out.url(),
        )
        return len(sample_ids)

    def _finish_samples(
        self,
        sample_ids: list[str],
        paths: list[str],
        tokens: list[int] | None = None,
        stats: dict[str, int] | None = None,
    ) -> list[bool]:
        """After the index exists: ledger done and the record cleared, in one call, then the spool
        files gone (a restart's step removes those of done samples). Returns, per sample, whether
        this call moved it to done. The moved samples, their `tokens` and `stats` go to the tally
        (harvest.state.tally: written at the node's beat, not with the move), before any spool
        file goes, so a beat that finds the spool empty writes every commit's."""
        changed = set(self.ledger.mark_done(sample_ids, clear=self.records.ended(self.packing_key), counted=False))
        done_tokens = sum(t for s, t in zip(sample_ids, tokens or [], strict=False) if s in changed)
        self.tally.add({"samples_done": len(changed), "tokens_done": done_tokens, **(stats or {})})
        self._crash("marked")
        for p in paths:
            unlink_quiet(p)
            self._crash("unlinking")
        return [s in changed for s in sample_ids]
