"""A node's packers: several collectors sharing one spool, so packing is not one process's job.

A GPU node spools faster than one packer can stream shards (one pass over the bytes, hashed on
the way), so `harvest collect --pack-workers N` runs N packers on threads of one process (file
reads, hashing and uploads release the GIL). Packer i owns:

- the spool files whose sample id falls in its slice (`int(id[:8], 16) % N == i`), so no two
  packers ever choose the same sample and no lock is needed between them;
- its own packing record, `harvest:<run>:packing:<node>[:i]` (packer 0 keeps the node's plain
  key), with the commit order and restart rules of `harvest.collector.collector` unchanged.

A kill stops every packer at once, leaving at most one record each. At restart the first packer
resumes alone (it clears the node's temporary shard files, renews the spool's lease, tends revoked
spools) and finishes its record; then each other packer finishes its own, and records of packers
beyond a smaller new N are finished here too, before any packer chooses new samples. Only then
do the packers run. The first also keeps the node's heartbeat and the spool's lease for all.

Redis away. The client (harvest.state.connection) waits an outage out inside each call, so a
packer mid-commit just pauses and goes on; a connection error is never taken for a refusal, so
no shard is voided for it. Past the outage limit the client raises `RedisLost` (and refuses every
later call): the packers stop with their records and the spool as they are, nothing drained, and
the restarted collector finishes each record. Before each packing step, every packer asks the
process's one `Recovery` (harvest.ops.recovery) whether Redis was restarted or rolled back, so
no shard is chosen from a ledger that was not reconciled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from harvest.collector.collector import TEND_S, Collector
from harvest.config import RunConfig
from harvest.ops.recovery import Recovery
from harvest.state.heartbeat import CollectorBeat
from harvest.state.roundtrip import ScriptCall
from harvest.state.tally import Tally

log = logging.getLogger("harvest.collector")


class Packers:
    def __init__(self, conn: redis.Redis, cfg: RunConfig, spool_dir: str, pack_workers: int = 1, **kw: Any) -> None:
        if pack_workers < 1:
            raise ValueError("pack_workers must be at least 1")
        # The packers' commit stats, added up here and written at the node's beat (harvest.state.tally)
        self.tally = Tally(conn, cfg.run)
        self.conn, self.cfg, self.spool_dir, self.kw = conn, cfg, spool_dir, {**kw, "tally": self.tally}
        self.packers = [
            Collector(conn, cfg, spool_dir, packer=i, packers=pack_workers, **self.kw) for i in range(pack_workers)
        ]
        self.first = self.packers[0]
        self.keys = frozenset(p.packing_key for p in self.packers)
        self.recovery = Recovery(conn, cfg)  # one per process, shared by the packers' threads
        self._recovery_lock = threading.Lock()

    def check_recovery(self) -> bool:
        """A restarted or rolled-back Redis noticed and the ledger reconciled before a packer chooses."""
        with self._recovery_lock:
            return self.recovery.check()

    @property
    def shards_committed(self) -> int:
        return sum(p.shards_committed for p in self.packers)

    def _share_lease(self) -> None:
        for p in self.packers[1:]:
            p.spool_id = self.first.spool_id

    def resume(self) -> None:
        """Finish every packer's record (and those of packers beyond a smaller N). One that fails
        raises having written the counts of the records finished before it: their records are
        gone, and no restart would count them again."""
        try:
            self.first.resume()
            self._share_lease()
            for p in self.packers[1:]:
                p.resume_record()
            n = len(self.packers)
            for index in self.first.records.extra_packers(self.first.node):
                if index >= n:  # a packer of an earlier run of this node with more packers
                    leftover = Collector(self.conn, self.cfg, self.spool_dir, packer=index, packers=n, **self.kw)
                    leftover.spool_id = self.first.spool_id
                    leftover.resume_record()
        except BaseException:
            self.flush_last()
            raise

    def run(self, should_stop: Callable[[], bool] = lambda: False, poll: float = 0.2) -> None:
        """Resume, then pack until `should_stop`, then commit what is left. An error in any packer
        stops them all and is raised here (each record stays for the restart)."""
        f = self.first
        log.info(
            "collector started: run %s, node %s, spool %s (id %s), output %s, shards of %d MiB, max wait %.0fs, "
            "%d packer(s)",
            self.cfg.run,
            f.node,
            self.spool_dir,
            f.spool_id,
            f.out.url(),
            f.shard_bytes >> 20,
            f.max_wait,
            len(self.packers),
        )
        self.check_recovery()  # a ledger restored from storage before any record is finished
        self.resume()
        failed: list[BaseException] = []
        stop = lambda: should_stop() or bool(failed)  # noqa: E731

        def loop(p: Collector) -> None:
            try:
                while not stop():
                    self.check_recovery()
                    if p.step() == 0:
                        time.sleep(poll)
            except BaseException as e:  # raised again on the calling thread
                failed.append(e)

        threads = [
            threading.Thread(target=loop, args=(p,), name=f"harvest-packer-{p.packer}", daemon=True)
            for p in self.packers[1:]
        ]
        for t in threads:
            t.start()
        beat = CollectorBeat(self.conn, self.cfg.run, self.first.node, self.spool_dir)  # for `harvest status`
        tended = time.monotonic()
        try:
            while not stop():
                if beat.maybe_beat(self.shards_committed, send=self.beat_with_stats):
                    self.first.renew_lease()
                    self._share_lease()
                if time.monotonic() - tended > TEND_S:
                    tended = time.monotonic()
                    self.first.tend_others(self.keys)
                self.check_recovery()
                if self.first.step() == 0:
                    time.sleep(poll)
        except BaseException as e:
            failed.append(e)
        for t in threads:
            t.join()
        if failed:
            self.flush_last()
            raise failed[0]
        self.drain()  # which writes the last stats

    def beat_with_stats(self, beat: ScriptCall) -> None:
        """The commits' stats since the last beat and the node's beat, in one round trip
        (harvest.state.tally): no call of their own. Raises as the beat alone did; stats whose
        call did not run are kept for the next beat. The beats, and so the stats, wait while the
        first packer packs a shard (the other packers' stats too)."""
        self.tally.flush(also=[beat])

    def flush_last(self) -> None:
        """The last stats, at a clean stop or after `drain`; an error doing so is logged, not raised
        over the one that may be ending the collector. A collector killed takes its last seconds of
        them along (harvest.state.tally)."""
        try:
            self.tally.flush()
        except Exception as e:
            log.warning("the collector's last stats were not written: %s: %s", type(e).__name__, e)

    def drain(self) -> None:
        """Commit everything spooled now, every packer at once (on stop, `--burst`, benches)."""
        failed: list[BaseException] = []

        def burst(p: Collector) -> None:
            try:
                while True:  # until a step neither commits nor sets a damaged file aside (its shard voided)
                    aside = p.set_aside
                    if not p.step(force=True) and p.set_aside == aside:
                        break
            except BaseException as e:
                failed.append(e)

        threads = [threading.Thread(target=burst, args=(p,), daemon=True) for p in self.packers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.flush_last()
        if failed:
            raise failed[0]
