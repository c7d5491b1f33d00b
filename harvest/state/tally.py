"""A process's throughput stats and latency observations, added up in its memory and written to
Redis in one call at each heartbeat, not with every job or shard: a worker's (its jobs'), and a
collector's (its commits', harvest.collector.packers: one tally for the node's packers).

Why: these counters decide nothing, and written with each job or commit they cost the fleet's
one Redis a measured share of a sample's CPU (docs/reference/control-plane.md); added up here
they cost one call per heartbeat
(HEARTBEAT_INTERVAL_S), none of its own for a collector, whose stats ride in its beat's round trip.

What that costs. The counters lag by up to one heartbeat (a collector's beat also waits while
its first packer packs a shard), and a process that dies without a clean
exit (kill -9, a lost node, Redis given up) takes what it had not flushed along: the throughput
stats (`samples_spooled`, `tokens_spooled`, `bytes_spooled`, `dump_bytes`, a regenerating run's
turn stats; `samples_done`, `tokens_done`, `bytes_done`, `shards`) and the `job_seconds` and
`engine_seconds` histograms undercount by those seconds. Nothing exact depends on them: what is
committed is the ledger's `d` count and, in the end, the output's indexes (`harvest audit`, and
`harvest run`'s summary reads them). What is exact stays written with the move it counts: the
ledger's state counts, `samples_failed` (harvest.state.ledger.Ledger.settle_job), `job_retries`,
the janitor's, and the commits of a revoked node's shards that another collector finishes
(harvest.collector.records.tend_revoked).

Who owns it: the process that adds to it. The job loop adds, the heartbeat thread flushes
(harvest.workers.worker); the packers add, the node's beat flushes (harvest.collector.packers); a clean exit
flushes last. A flush that raises gives back what it took, so the next flush sends it again (one whose
reply was lost after the script ran, an outage the client rode out, harvest.state.connection,
may then count it twice, as any call retried that way); one Redis answered with an error drops it,
since part of it may have landed (the worker logs it; a collector stops, as on an error of its beat).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

import redis

from harvest.state import scripts
from harvest.state.keys import Keys
from harvest.state.roundtrip import ScriptCall, send_together

# A histogram's upper bounds in seconds (harvest.ops.metrics reads them): an engine call is ~10 ms
# on a tiny CPU model, minutes for a long batch.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def le(v: float) -> str:
    """A bucket's field: its upper bound."""
    return "+Inf" if v == float("inf") else repr(float(v))


def bucket_of(value: float) -> str:
    """The field of the histogram bucket `value` falls in."""
    i = bisect.bisect_left(BUCKETS, value)
    return le(BUCKETS[i]) if i < len(BUCKETS) else "+Inf"


class _Histogram:
    def __init__(self) -> None:
        self.buckets: Counter[str] = Counter()
        self.count = 0
        self.sum = 0.0

    def merge(self, other: _Histogram) -> None:
        self.buckets.update(other.buckets)
        self.count += other.count
        self.sum += other.sum


class Tally:
    """Thread-safe: a job (or a packer) adds, the heartbeat thread (or the beat) flushes."""

    def __init__(self, conn: redis.Redis, run: str) -> None:
        self.conn, self.keys = conn, Keys(run)
        self._lock = threading.Lock()
        self._stats: Counter[str] = Counter()
        self._hists: dict[str, _Histogram] = {}

    def add(self, stats: Mapping[str, int]) -> None:
        with self._lock:
            self._stats.update({k: int(v) for k, v in stats.items() if int(v)})

    def observe(self, name: str, seconds: float) -> None:
        """One observation of the run's histogram `name` (harvest.ops.metrics.HISTOGRAMS)."""
        with self._lock:
            h = self._hists.setdefault(name, _Histogram())
            h.buckets[bucket_of(seconds)] += 1
            h.count += 1
            h.sum += float(seconds)

    def flush(self, also: Sequence[ScriptCall] = ()) -> bool:
        """Write what was added since the last flush, in one call; False when there was nothing.
        `also`: calls sent after it in the same round trip (harvest.state.roundtrip: the
        collector's beat, which so lands after the counts it reports on, unless Redis lost its
        scripts and one is sent again alone), sent alone when there is nothing to write. Raises
        what the calls raised (the flush's error first): having given back what it took where
        the script did not run (the connection failed), having dropped it where Redis answered
        with an error (a script stops at its failing command, its writes before it kept)."""
        with self._lock:
            stats, hists = self._stats, self._hists
            self._stats, self._hists = Counter(), {}
        if not stats and not hists:
            if also:
                send_together(self.conn, list(also))
            return False
        call = scripts.add_stats(
            self.keys, stats, {name: scripts.Histogram(h.buckets, h.count, h.sum) for name, h in hists.items()}
        )
        try:
            send_together(self.conn, [call, *also])
        except redis.ResponseError:
            raise  # the script ran, and may have written part of it: sent again, that part would count twice
        except BaseException:
            with self._lock:
                self._stats.update(stats)
                for name, h in hists.items():
                    self._hists.setdefault(name, _Histogram()).merge(h)
            raise
        return True
