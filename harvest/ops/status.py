"""`harvest status`: where a run stands, computed from Redis (rendering is separate, below).

Counts come from the ledger's exact per-state counters, never from scanning the state hash;
"in flight" is the samples of the jobs live workers say they are running (heartbeats), so
queued = ledger `q` minus in flight. Throughput is the sum of the stats added in the 10 s
buckets of the last minute (harvest.state.ledger.rates), divided by the time those buckets cover.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

import redis

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.ops.audit_record import last_audit, status_line
from harvest.settings import RunTunables
from harvest.state.heartbeat import HEARTBEAT_TTL_S, read_collectors, read_workers
from harvest.state.jobs import run_queue
from harvest.state.ledger import Ledger
from harvest.state.runstore import load_run
from harvest.state.spools import SpoolLeases, redis_time

RATE_WINDOW_S = 60


@dataclass
class WorkerView:
    name: str
    host: str
    engine: str
    state: str
    job: str
    job_samples: int
    job_seconds: float | None
    jobs_done: int
    seen_seconds_ago: float


@dataclass
class CollectorView:
    node: str
    spool_files: int
    spool_bytes: int
    shards_committed: int
    seen_seconds_ago: float


@dataclass
class SpoolStatus:
    spool: str
    node: str
    seen_seconds_ago: float  # since the last lease renewal by one of its workers or collectors
    samples: int  # spooled samples it owns
    state: str  # alive | silent (reclaimed once the grace passes) | reclaimed


@dataclass
class Failure:
    reason: str
    count: int
    example: str


@dataclass
class RunStatus:
    run: str
    at: float
    total: int
    queued: int  # waiting in the queue (or for a retry)
    in_flight: int  # in jobs that live workers are running
    spooled: int  # on a node's spool, not yet in a committed shard
    done: int
    failed: int
    tokens_done: int
    bytes_done: int
    window_seconds: float
    window_counts: dict[str, int]  # stats added in the window (samples_done, tokens_done, bytes_done, ...)
    samples_per_s: float
    tokens_per_s: float
    mb_per_s: float
    spooled_per_s: float
    eta_seconds: float | None
    eta_basis: str  # the rate the ETA divides by: committed | spooled (nothing committed yet) | done | "" (none)
    jobs: dict[str, int]  # RQ: queued, started, scheduled (retry backoff), failed
    workers: dict[str, list[WorkerView]] = field(default_factory=dict)  # by host
    dead_workers: list[str] = field(default_factory=list)  # heartbeat gone, not yet forgotten by the janitor
    collectors: list[CollectorView] = field(default_factory=list)
    dead_collectors: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    spools: list[SpoolStatus] = field(default_factory=list)
    spool_grace_s: float = RunTunables.spool_grace_s
    spools_reclaimed: int = 0
    samples_reclaimed: int = 0
    audit: dict | None = None  # the last `harvest audit`'s summary (harvest.ops.audit_record), None: never
    # A --regenerate run's stage (None otherwise): conversations written, tokens generated, their rate
    # over the window, and the backlogs: to generate (queued, in flight) and written, not yet committed.
    regeneration: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _f(h: dict, k: str, default: float = 0.0) -> float:
    try:
        return float(h.get(k) or default)
    except ValueError:
        return default


def _run_or_none(conn: redis.Redis, run: str) -> RunConfig | None:
    try:
        return load_run(conn, run)
    except ConfigurationError:
        return None


def _spools(conn: redis.Redis, run: str, grace: float) -> list[SpoolStatus]:
    out = []
    for v in SpoolLeases(conn, run).list():
        if v.revoked:
            state = "reclaimed"
        elif v.seen_seconds_ago > HEARTBEAT_TTL_S:
            state = _silent(v.samples, grace - v.seen_seconds_ago)
        else:
            state = "alive"
        if v.revoked and not v.samples and v.seen_seconds_ago > 3600:
            continue  # long gone and empty: not worth a line
        out.append(SpoolStatus(v.spool, v.node, v.seen_seconds_ago, v.samples, state))
    return out


def _silent(samples: int, grace_left: float) -> str:
    """What becomes of a spool no process renews, said as it is: an empty one has nothing to reclaim
    (its node finished, or stopped); one holding samples is reclaimed by a live worker's janitor once
    its grace has passed, and only then."""
    if not samples:
        return "stopped (nothing spooled)"
    if grace_left > 0:
        return f"silent (reclaimed in {_duration(grace_left)})"
    return "silent past its grace (reclaimed at the next janitor pass of a live worker)"


def eta(remaining: int, done_per_s: float, spooled_per_s: float) -> tuple[float | None, str]:
    """(seconds left, what the estimate divides by). From the commit rate once samples are
    committed; before the first commit (a partial shard waits up to the collector's --max-wait)
    from the rate workers spool at, so a young run has an ETA too. None: nothing moved lately."""
    if not remaining:
        return 0.0, "done"
    if done_per_s > 0:
        return remaining / done_per_s, "committed"
    if spooled_per_s > 0:
        return remaining / spooled_per_s, "spooled"
    return None, ""


def compute_status(conn: redis.Redis, run: str, now: float | None = None, top: int = 10) -> RunStatus:
    seen_now = redis_time(conn)  # heartbeats and rate buckets are stamped with Redis's clock
    bucket_now = seen_now if now is None else now  # a skewed node reads the buckets the server wrote
    now = time.time() if now is None else now
    cfg = _run_or_none(conn, run)
    grace = cfg.spool_grace_s if cfg is not None else RunConfig.__dataclass_fields__["spool_grace_s"].default
    led = Ledger(conn, run)
    counts, stats = led.counts(), led.stats()
    rates, window = led.rates(RATE_WINDOW_S, bucket_now)
    alive, dead = read_workers(conn, run)
    workers: dict[str, list[WorkerView]] = defaultdict(list)
    in_flight = 0
    for w in alive:
        busy = w.get("state") == "busy"
        n = int(_f(w, "job_samples")) if busy else 0
        in_flight += n
        workers[w.get("host", "?")].append(
            WorkerView(
                name=w.get("name", "?"),
                host=w.get("host", "?"),
                engine=w.get("engine", "?"),
                state=w.get("state", "?"),
                job=w.get("job", "") if busy else "",
                job_samples=n,
                job_seconds=round(seen_now - _f(w, "job_started"), 1) if busy and w.get("job_started") else None,
                jobs_done=int(_f(w, "jobs_done")),
                seen_seconds_ago=round(seen_now - _f(w, "seen", seen_now), 1),
            )
        )
    in_flight = min(in_flight, counts["queued"])
    cols, dead_cols = read_collectors(conn, run)
    q = run_queue(conn, run)
    samples_per_s = rates.get("samples_done", 0) / window
    spooled_per_s = rates.get("samples_spooled", 0) / window
    eta_s, eta_basis = eta(counts["queued"] + counts["spooled"], samples_per_s, spooled_per_s)
    counted, examples = led.failure_counts()  # the ledger's counters: O(reasons)
    reasons: Counter = Counter(counted)
    return RunStatus(
        run=run,
        at=now,
        total=counts["total"],
        queued=counts["queued"] - in_flight,
        in_flight=in_flight,
        spooled=counts["spooled"],
        done=counts["done"],
        failed=counts["failed"],
        tokens_done=stats.get("tokens_done", 0),
        bytes_done=stats.get("bytes_done", 0),
        window_seconds=window,
        window_counts=rates,
        samples_per_s=samples_per_s,
        tokens_per_s=rates.get("tokens_done", 0) / window,
        mb_per_s=rates.get("bytes_done", 0) / window / 1e6,
        spooled_per_s=spooled_per_s,
        eta_seconds=eta_s,
        eta_basis=eta_basis,
        jobs={
            "queued": q.count,
            "started": q.started_job_registry.get_job_count(cleanup=False),
            "scheduled": q.scheduled_job_registry.get_job_count(cleanup=False),
            "failed": q.failed_job_registry.get_job_count(cleanup=False),
        },
        workers=dict(sorted(workers.items())),
        dead_workers=dead,
        collectors=[
            CollectorView(
                node=c.get("node", "?"),
                spool_files=int(_f(c, "spool_files")),
                spool_bytes=int(_f(c, "spool_bytes")),
                shards_committed=int(_f(c, "shards_committed")),
                seen_seconds_ago=round(seen_now - _f(c, "seen", seen_now), 1),
            )
            for c in cols
        ],
        dead_collectors=dead_cols,
        spools=_spools(conn, run, grace),
        spool_grace_s=grace,
        spools_reclaimed=stats.get("spools_reclaimed", 0),
        samples_reclaimed=stats.get("samples_reclaimed", 0),
        failures=[Failure(r, n, examples.get(r, "")) for r, n in reasons.most_common(top)],
        audit=last_audit(conn, run),
        regeneration=_regeneration(cfg.regenerate if cfg is not None else None, stats, rates, window, counts),
    )


def _regeneration(
    regenerate: dict | None, stats: dict[str, int], rates: dict[str, int], window: float, counts: dict[str, int]
) -> dict | None:
    """The regeneration stage's figures, for a --regenerate run."""
    if not regenerate:
        return None
    ms = stats.get("generation_ms", 0)
    return {
        "conversations_written": stats.get("conversations_written", 0),
        "tokens_generated": stats.get("tokens_generated", 0),
        "tokens_per_s": rates.get("tokens_generated", 0) / window,
        "generation_seconds": ms / 1000,
        "to_generate": counts["queued"],
        "to_commit": counts["spooled"],
        "settings": regenerate,
    }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown (nothing spooled or committed in the last minute)"
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


_ETA_NOTE = {
    "spooled": "   (from the spool rate: nothing committed yet; a partial shard commits once its oldest "
    "sample is the collector's --max-wait old)"
}


def render(st: RunStatus, width: int = 100) -> str:
    """The human view: a few lines readable at a glance."""
    pct = 100.0 * (st.done + st.failed) / st.total if st.total else 0.0
    lines = [
        f"run {st.run}   {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.at))}   {pct:.1f}% settled",
        f"  samples  total {st.total}   queued {st.queued}   in flight {st.in_flight}   spooled {st.spooled}   "
        f"done {st.done}   failed {st.failed}",
        f"  done     {st.tokens_done} tokens, {_size(st.bytes_done)}",
        f"  last {st.window_seconds:.0f}s  {st.samples_per_s:.2f} samples/s   {st.tokens_per_s:.0f} tokens/s   "
        f"{st.mb_per_s:.2f} MB/s committed   ({st.spooled_per_s:.2f} samples/s spooled)",
        f"  ETA      {_duration(st.eta_seconds)}" + _ETA_NOTE.get(st.eta_basis, ""),
        f"  jobs     queued {st.jobs['queued']}   running {st.jobs['started']}   waiting to retry {st.jobs['scheduled']}   "
        f"failed in RQ {st.jobs['failed']}",
    ]
    if st.regeneration is not None:
        g = st.regeneration
        lines.append(
            f"  generate {g['conversations_written']} conversations written, {g['tokens_generated']} tokens "
            f"({g['tokens_per_s']:.0f} tokens/s in the last {st.window_seconds:.0f}s)   backlog: "
            f"{g['to_generate']} to generate and extract, {g['to_commit']} written and spooled, to commit"
        )
    lines.append(status_line(st.audit, st.run))
    n_alive = sum(len(ws) for ws in st.workers.values())
    lines.append(
        f"  workers  {n_alive} alive"
        + (f", {len(st.dead_workers)} dead (janitor will take back their jobs)" if st.dead_workers else "")
    )
    for host, ws in st.workers.items():
        lines.append(f"    {host}: {len(ws)} ({sum(w.state == 'busy' for w in ws)} busy)")
        for w in ws:
            doing = f"job {w.job} ({w.job_samples} samples, {w.job_seconds:.0f}s)" if w.state == "busy" else "idle"
            lines.append(f"      {w.name}  {w.engine}  {doing}  [{w.jobs_done} jobs done]")
    lines.append(
        "  spool    "
        + (
            "   ".join(f"{c.node}: {c.spool_files} files, {_size(c.spool_bytes)}" for c in st.collectors)
            or "no collector heartbeat"
        )
        + (f"   (collector gone on {', '.join(st.dead_collectors)})" if st.dead_collectors else "")
    )
    if st.spools:
        lines.append(
            f"  spools   (lost after {st.spool_grace_s:.0f}s silent; reclaimed so far: {st.spools_reclaimed} spools, "
            f"{st.samples_reclaimed} samples)"
        )
        for sp in st.spools:
            lines.append(
                f"    {sp.spool}  node {sp.node}  {sp.state}, seen {_duration(sp.seen_seconds_ago)} ago, "
                f"{sp.samples} spooled"
            )
    if st.failures:
        lines.append("  failures (reason: count, e.g.)")
        for f in st.failures:
            example = f.example if len(f.example) <= width else f.example[: width - 3] + "..."
            lines.append(f"    {f.reason}: {f.count}   e.g. {example}")
        lines.append(f"  requeue: harvest requeue --run {st.run} --reason REASON  (or --all; --dry-run lists)")
    return "\n".join(lines)
