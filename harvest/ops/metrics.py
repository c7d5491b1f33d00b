"""Prometheus metrics: workers record into Redis, one exporter (`harvest metrics`) serves them all.

Why an exporter reading Redis rather than an endpoint per worker: workers are many, scaled with
`docker compose --scale` (no fixed ports), short-lived and spread over nodes; scraping each
needs service discovery and loses a worker's counts when it restarts. Everything a scrape needs
is already in Redis (ledger counters, stats, RQ registries), and the two histograms (job
duration, engine latency) are fixed-bucket hashes each worker adds to at its heartbeat
(harvest.state.tally), so one scrape target gives fleet-wide numbers that survive restarts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import redis

from harvest.errors import ConfigurationError
from harvest.ops.audit_record import last_audit
from harvest.ops.runlist import discover_runs
from harvest.state.keys import Keys
from harvest.state.tally import BUCKETS, le

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

HISTOGRAMS = {
    "job_seconds": "Wall time of one RQ job (engine call, claim, verify, spool).",
    "engine_seconds": "Latency of the engine /generate call of one job.",
}
STATS = {
    # stats field -> (metric name, help)
    "samples_spooled": ("harvest_samples_spooled_total", "Samples verified and spooled by workers."),
    "tokens_spooled": ("harvest_tokens_spooled_total", "Tokens of the samples spooled by workers."),
    "bytes_spooled": ("harvest_spool_bytes_total", "Bytes written to node spools."),
    "dump_bytes": ("harvest_dump_bytes_total", "Bytes of engine dump files claimed by workers."),
    "samples_failed": (
        "harvest_samples_failed_total",
        "Samples failed by workers (each failure, including ones later requeued).",
    ),
    "samples_done": ("harvest_samples_done_total", "Samples committed in shards by collectors."),
    "tokens_done": ("harvest_tokens_done_total", "Tokens committed in shards."),
    "bytes_done": ("harvest_shard_bytes_total", "Shard bytes committed to storage."),
    "shards": ("harvest_shards_total", "Shards committed."),
    "job_retries": ("harvest_job_retries_total", "Jobs put back for a transient error (engine, storage)."),
    "jobs_reaped": ("harvest_jobs_reaped_total", "Jobs taken back from dead workers by the janitor."),
    "spools_reclaimed": (
        "harvest_spools_reclaimed_total",
        "Node spools given up for lost (lease silent past the grace).",
    ),
    "samples_reclaimed": ("harvest_samples_reclaimed_total", "Spooled samples of lost spools put back on the queue."),
    # a --regenerate run's stage (harvest.workers.regenerate); rate() of tokens_generated is its tokens/s
    "conversations_written": (
        "harvest_conversations_written_total",
        "Conversations whose assistant turns the target model wrote (--regenerate).",
    ),
    "tokens_generated": ("harvest_tokens_generated_total", "Tokens the target model generated (--regenerate)."),
    "generation_ms": (
        "harvest_generation_milliseconds_total",
        "Wall time of the jobs' generation step, summed (--regenerate).",
    ),
}


def read_histogram(conn: redis.Redis, run: str, name: str) -> tuple[list[tuple[str, int]], float, int]:
    """(cumulative [(le, count)] ending with +Inf, sum, count)."""
    raw = {k.decode(): v for k, v in conn.hgetall(Keys(run).histogram(name)).items()}
    acc, out = 0, []
    for b in (*BUCKETS, float("inf")):
        acc += int(raw.get(le(b), 0))
        out.append((le(b), acc))
    return out, float(raw.get("sum", 0) or 0), int(raw.get("count", 0) or 0)


class RedisCollector:
    """A prometheus_client collector: each scrape reads the runs' state from Redis."""

    def __init__(self, conn: redis.Redis, runs: Iterable[str] | None = None) -> None:
        self.conn = conn
        self.runs = list(runs) if runs else None

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: the label sets depend on what Redis holds

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        from harvest.ops.status import eta
        from harvest.state.heartbeat import read_collectors, read_workers
        from harvest.state.jobs import run_queue
        from harvest.state.ledger import Ledger

        runs = self.runs if self.runs is not None else discover_runs(self.conn)
        samples = GaugeMetricFamily("harvest_samples", "Samples of the run by ledger state.", labels=["run", "state"])
        queue = GaugeMetricFamily("harvest_queue_jobs", "RQ jobs of the run by registry.", labels=["run", "registry"])
        failed = GaugeMetricFamily("harvest_failed_samples", "Samples now failed, by reason.", labels=["run", "reason"])
        workers = GaugeMetricFamily(
            "harvest_workers", "Workers with a live heartbeat, by host.", labels=["run", "host", "state"]
        )
        spool = GaugeMetricFamily(
            "harvest_spool_bytes", "Spool backlog by node (collector heartbeat).", labels=["run", "node"]
        )
        spool_files = GaugeMetricFamily(
            "harvest_spool_files", "Spooled samples waiting on each node (collector heartbeat).", labels=["run", "node"]
        )
        eta_s = GaugeMetricFamily(
            "harvest_eta_seconds",
            "Seconds until the run's queued and spooled samples are "
            "committed, as `harvest status` says (from the spool rate before the first commit); "
            "absent while nothing moves.",
            labels=["run"],
        )
        audited = GaugeMetricFamily(
            "harvest_audit_timestamp_seconds",
            "When the run was last audited (`harvest audit`), by route and verdict.",
            labels=["run", "route", "verdict"],
        )
        audit_samples = GaugeMetricFamily(
            "harvest_audit_samples",
            "Samples of the last audit by outcome (ok, drift, misaligned, wrong-layer, corrupt, unchecked).",
            labels=["run", "outcome"],
        )
        audit_worst = GaugeMetricFamily(
            "harvest_audit_worst_relative_error",
            "The last audit's largest relative error of a row (its bound: harvest_audit_tolerance).",
            labels=["run"],
        )
        audit_bound = GaugeMetricFamily(
            "harvest_audit_tolerance",
            "The last audit's bound on a row's relative error (the storage dtype's).",
            labels=["run"],
        )
        counters = {f: CounterMetricFamily(m.removesuffix("_total"), h, labels=["run"]) for f, (m, h) in STATS.items()}
        hists = {n: HistogramMetricFamily(f"harvest_{n}", h, labels=["run"]) for n, h in HISTOGRAMS.items()}
        for run in runs:
            led = Ledger(self.conn, run)
            counts = led.counts()
            for state, n in counts.items():
                if state != "total":
                    samples.add_metric([run, state], n)
            q = run_queue(self.conn, run)
            queue.add_metric([run, "queued"], q.count)
            queue.add_metric([run, "started"], q.started_job_registry.get_job_count(cleanup=False))
            queue.add_metric([run, "scheduled"], q.scheduled_job_registry.get_job_count(cleanup=False))
            queue.add_metric([run, "failed"], q.failed_job_registry.get_job_count(cleanup=False))
            for reason, n in failure_reasons(self.conn, run).items():
                failed.add_metric([run, reason], n)
            alive, _ = read_workers(self.conn, run)
            for (host, state), n in Counter((w.get("host", "?"), w.get("state", "?")) for w in alive).items():
                workers.add_metric([run, host, state], n)
            for c in read_collectors(self.conn, run)[0]:
                spool.add_metric([run, c.get("node", "?")], int(c.get("spool_bytes", 0)))
                spool_files.add_metric([run, c.get("node", "?")], int(c.get("spool_files", 0)))
            rates, window = led.rates()
            left, _ = eta(
                counts["queued"] + counts["spooled"],
                rates.get("samples_done", 0) / window,
                rates.get("samples_spooled", 0) / window,
            )
            if left is not None:
                eta_s.add_metric([run], left)
            audit = last_audit(self.conn, run)
            if audit:
                audited.add_metric(
                    [run, str(audit.get("route", "")), str(audit.get("verdict", ""))], audit.get("at", 0)
                )
                for outcome, n in (audit.get("outcomes") or {}).items():
                    audit_samples.add_metric([run, outcome], n)
                audit_worst.add_metric([run], audit.get("worst_rel", 0.0))
                audit_bound.add_metric([run], audit.get("tolerance", 0.0))
            stats = led.stats()
            for f, fam in counters.items():
                fam.add_metric([run], stats.get(f, 0))
            for n, fam in hists.items():
                buckets, total, _ = read_histogram(self.conn, run, n)
                fam.add_metric([run], buckets, total)
        yield from (
            samples,
            queue,
            failed,
            workers,
            spool,
            spool_files,
            eta_s,
            audited,
            audit_samples,
            audit_worst,
            audit_bound,
            *counters.values(),
            *hists.values(),
        )


def failure_reasons(conn: redis.Redis, run: str) -> Counter:
    """Failed samples now in the ledger, counted by reason: the ledger's counters, O(reasons)
    (Ledger.failure_counts)."""
    from harvest.state.ledger import Ledger

    return Counter(Ledger(conn, run).failure_counts()[0])


class CannotListen(ConfigurationError, OSError):
    """The exporter's address is taken or not this host's: another --port or --host."""


def serve(
    conn: redis.Redis, port: int, addr: str = "127.0.0.1", runs: Iterable[str] | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Start the HTTP exporter in a background thread; returns (server, thread). It listens on
    the loopback interface unless told otherwise: the counts name runs, models and hosts."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(conn, runs))
    try:
        return start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise CannotListen(
            f"cannot listen on {addr}:{port} ({e.strerror}): pass another --port, or stop what holds it"
        ) from e
