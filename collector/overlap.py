"""Uploading shard N on a thread while shard N+1 is packed (object-storage outputs only).

Who owns what: the collector's own thread chooses, packs and records shards; the upload thread
owns exactly one recorded shard at a time, from its hand-over until it is finished (ledger done,
spool files gone, record cleared) or its error is raised again on the collector's thread. The
packed-ahead shard is unrecorded and owned by the collector's thread alone, so a kill at any
point leaves at most one record per node, and the restart rules of `collector.collector` hold.
"""

from __future__ import annotations

import threading
from typing import Protocol

from collector.records import Voided
from harvest.formats.shard import ShardPlan
from harvest.formats.spool import SpoolEntry


class Packer(Protocol):
    """What the overlap drives: `collector.collector.Collector`'s public commit steps."""

    def choose(self, force: bool, busy: frozenset[str] = frozenset()) -> list[SpoolEntry]: ...

    def plan(self, entries: list[SpoolEntry]) -> ShardPlan: ...

    def record(self, plan: ShardPlan) -> None: ...

    def pack(self, plan: ShardPlan) -> tuple[str, str]: ...

    def publish(self, plan: ShardPlan, tmp: str, sha: str) -> None: ...

    def finish(self, plan: ShardPlan) -> int: ...

    def discard(self, tmp: str) -> None: ...

    def void(self, plan: ShardPlan, why: str) -> None: ...


class Overlap:
    """Packing the next shard while the last one uploads, with still one record per node.

    Shard N is recorded, packed, and handed to a thread that uploads it, writes its index and
    finishes it (ledger, spool files, record). Meanwhile the next due shard is packed into its
    local temp file, unrecorded: it is recorded only once N's record is cleared, then handed
    to the thread in turn. A kill while packing ahead leaves only that temp file (cleared on
    restart, like any other) and its samples spooled, to be chosen again; so the commit order
    and the restart rules of `Collector` hold unchanged.
    """

    def __init__(self, collector: Packer) -> None:
        self.c = collector
        self.thread: threading.Thread | None = None
        self.uploading: ShardPlan | None = None  # the thread's shard, while there is a thread
        self.committed = 0  # the thread's result ...
        self.error: BaseException | None = None  # ... or what it raised
        self.ahead: tuple[ShardPlan, str, str] | None = None  # packed, unrecorded: (plan, tmp, sha)

    @property
    def busy(self) -> bool:
        return self.thread is not None

    def wait(self, seconds: float) -> None:
        """Idle time: spent waiting on the upload rather than asleep."""
        if self.thread is not None:
            self.thread.join(seconds)

    def step(self) -> int:
        """Returns the samples committed since the last call."""
        committed = self._reap(wait=0.0)
        if self.thread is None:
            if self.ahead:
                self._start_ahead()
            elif chosen := self.c.choose(force=False):
                plan = self.c.plan(chosen)
                self.c.record(plan)
                self._start(plan, *self.c.pack(plan))
        if self.uploading is not None and self.ahead is None:
            if chosen := self.c.choose(force=False, busy=frozenset(self.uploading.sample_ids)):
                plan = self.c.plan(chosen)
                self.ahead = (plan, *self.c.pack(plan))
        return committed

    def drain(self) -> None:
        """On stop: finish the upload in flight and commit the shard packed ahead."""
        while self.thread is not None or self.ahead is not None:
            self._reap(wait=None)
            if self.ahead:
                self._start_ahead()

    def _start_ahead(self) -> None:
        plan, tmp, sha = self.ahead
        self.ahead = None
        self.c.record(plan)
        self._start(plan, tmp, sha)

    def _start(self, plan: ShardPlan, tmp: str, sha: str) -> None:
        def upload() -> None:
            try:
                self.c.publish(plan, tmp, sha)
                self.committed = self.c.finish(plan)
            except Voided as e:  # the fence refused it: given up, nothing committed
                self.c.void(plan, str(e))
            except BaseException as e:  # raised again on the collector's own thread by _reap
                self.error = e

        self.uploading, self.committed, self.error = plan, 0, None
        self.thread = threading.Thread(target=upload, name="harvest-upload", daemon=True)
        self.thread.start()

    def _reap(self, wait: float | None) -> int:
        if self.thread is None:
            return 0
        self.thread.join(wait)
        if self.thread.is_alive():
            return 0
        self.thread, self.uploading = None, None
        if self.error is not None:
            if self.ahead:  # the stop leaves the packed-ahead shard to the restart: drop its temp
                self.c.discard(self.ahead[1])
                self.ahead = None
            raise self.error
        return self.committed
