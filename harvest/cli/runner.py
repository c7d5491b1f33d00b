"""`harvest run`: the whole pipeline on one machine, as separate processes.

Part of the composition root (with the CLI): it starts a private Redis unless given one, and
runs one node in this process: `harvest.cli.node.Node`, the code `harvest node` runs, with its
engines (the reference engine, or SGLang or vLLM servers sized by `--tp`/`--dp`:
harvest.cli.engineplan) unless given an engine URL, its workers and its collector as child
processes of the `harvest` CLI, kept alive by the run's one harvest.cli.supervisor.Supervisor.
It produces the dataset in-process, and waits until every sample of the dataset is committed or
failed. (In-process, not a `harvest node` child: the producer's backpressure starts the node's
consumers, and one supervisor stops them in order.)

Done means done. The producer pass collects the dataset's sample ids and the runner keeps them
beside the index files (harvest.formats.datasetids), so after the extraction it can tell the
samples no state holds (a Redis that came back without them: the index files give back the
committed ones, nothing gives back the queued ones) and run the producer pass again for them, a
bounded number of times (`AGAIN_PASSES`); what is still missing after that is exit status 75,
naming how many and the command that finishes them (harvest.cli.summary). The same comparison
tells a rerun which of the run's samples its dataset no longer holds (rows edited or removed):
said at the start and in the summary; `--prune` drops the queued ones before any worker starts,
committed ones are never deleted (harvest.ops.coverage).

Redis away. Its Redis client (harvest.state.connection) waits an outage out inside each call, as
every child's does, and its private redis-server is restarted by `RedisKeeper` on the same port
with the same AOF, so a killed Redis costs the run a pause. Each monitor iteration asks the
run's `Recovery` (harvest.ops.recovery) whether Redis came back with a new identity, which
reconciles the ledger from storage. Past `outage_s` the run stops (RedisLost, exit 75) with
everything kept for the next `harvest run` to resume.

One runner per work dir and dump dir (harvest.cli.workdir: a second is refused at once, naming
the first), every check before the first write (the run is published only once Redis and the
stored configuration agreed), children in sessions of their own (a terminal's Ctrl-C reaches
this process, which stops them in order: harvest.cli.supervisor), no engine started for a rerun
with nothing to do (the producer runs first when the ledger knows the run and nothing is
queued or spooled), workers paused while the work dir's disk is full (harvest.cli.diskwatch),
and the summary's tokens and bytes read from the index files, the truth, not from counters that
an interrupted commit skipped. When nothing is left queued or spooled it writes the run's
`settled.json` (harvest.formats.settled), which ends the training feeds following the run, and
it removes that marker as soon as the run has work again (queued or spooled samples at the
start, or new ones from the producer); a rerun with nothing to do leaves it as it was.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from harvest.cli.diskwatch import DiskWatch
from harvest.cli.engineplan import plan_engines
from harvest.cli.errors import connect, connect_service
from harvest.cli.node import Node, hurry_on_signals
from harvest.cli.redisproc import RedisKeeper, RedisServer
from harvest.cli.summary import RunSummary, committed_totals
from harvest.cli.supervisor import Supervisor
from harvest.cli.workdir import REDIS_SUBDIR, RunnerLocks, default_work_dir
from harvest.config import RunConfig
from harvest.formats.datasetids import SampleIds, write_manifest
from harvest.formats.runfile import run_location
from harvest.formats.settled import settle, unsettle
from harvest.node.dumpdir import default_dump_dir
from harvest.ops.coverage import Coverage, coverage, prune_queued
from harvest.ops.recovery import Recovery
from harvest.progress import progress as progress_display
from harvest.settings import RunnerSettings
from harvest.state.connection import RedisLost, redact
from harvest.state.ledger import Ledger
from harvest.state.runstore import check_run, publish_run

if TYPE_CHECKING:
    import redis

    from harvest.cli.engineplan import EnginePlan
    from harvest.producer.producer import ProduceSummary
    from harvest.producer.rows import BadRow
    from harvest.storage import Location

AGAIN_PASSES = 3  # producer passes after the extraction for samples a Redis lost: each follows a Redis that lost more


def _report_bad(row: BadRow) -> None:
    tqdm.write(f"{row.kind} row {row}", file=sys.stderr)  # above the progress bar


def _where(work: str, redis_url: str | None) -> str:
    """The option that reaches the run's Redis in the operator's commands, as a user types it."""
    return f"--redis {shlex.quote(redact(redis_url))}" if redis_url else f"--work-dir {shlex.quote(work)}"


def run_all(
    cfg: RunConfig, dataset: str, settings: RunnerSettings = RunnerSettings(), produce_kw: dict | None = None
) -> RunSummary:
    """`settings`: where and how (harvest.settings.RunnerSettings; its `outage_s`: how long this
    process and its children wait for a Redis that went away, None: the default,
    harvest.state.connection.outage_limit); `produce_kw`: the producer's options
    (`harvest.cli.options.producer_kwargs`). Raises RedisLost past the outage limit, WorkDirBusy
    (before anything is started) when another runner holds the work dir or the dump dir."""
    plan = plan_engines(cfg.engine, settings.tp_size, settings.dp_size, settings.engine_url)  # refusals first
    work = os.path.abspath(settings.work_dir or default_work_dir(cfg.run))
    dumps = os.path.abspath(settings.dump_dir or default_dump_dir(cfg.run))
    # The run as stored (a shared Redis, the output's run.json) before anything of this run is
    # created: a refused start leaves no work dir behind (a private Redis's copy is checked by
    # publish_run, once that Redis runs in its own work dir).
    check_run(connect(settings.redis_url) if settings.redis_url else None, cfg)
    locks = RunnerLocks(work, dumps, cfg.run).acquire(run=cfg.run)
    try:
        return _run_locked(cfg, dataset, settings, produce_kw, work, dumps, locks, plan)
    finally:
        locks.release()  # last: the private Redis is stopped by now


def _summary(
    cfg: RunConfig,
    ledger: Ledger,
    produced: ProduceSummary,
    cov: Coverage,
    pruned: int,
    again: int,
    seconds: float,
    restarts: dict[str, int],
    where: str,
    started: bool,
) -> RunSummary:
    """What `harvest run` reports: the ledger's counts, the committed output's totals (the collectors'
    counters where the output cannot be read just now), the failures by reason."""
    c = ledger.counts()
    stats = ledger.stats()
    totals = committed_totals(cfg) or (stats.get("tokens_done", 0), stats.get("bytes_done", 0))
    reasons = Counter(f["reason"] for f in ledger.failures().values())
    return RunSummary(
        run=cfg.run,
        out=cfg.out_url,
        enqueued=produced.enqueued,
        skipped=produced.skipped,
        bad_rows=produced.bad,
        done=c["done"],
        failed=c["failed"],
        tokens=totals[0],
        bytes=totals[1],
        seconds=seconds,
        failure_reasons=dict(reasons),
        restarts=restarts,
        produced=produced.text(),
        where=where,
        started=started,
        missing=cov.missing_line(),
        stray=cov.stray_line(pruned),
        again=again,
        generated=(stats.get("conversations_written", 0), stats.get("tokens_generated", 0)) if cfg.regenerate else None,
    )


def _produce(
    conn: redis.Redis,
    cfg: RunConfig,
    out: Location,
    dataset: str,
    ids: SampleIds,
    produce_pass: Callable[..., ProduceSummary],
    prune: bool,
) -> tuple[ProduceSummary, int]:
    """The producer's pass over the dataset: its ids written beside the output (the manifest), the
    queued samples it no longer holds dropped with `prune` (how many), the others it lacks told."""
    summary = produce_pass(on_bad=_report_bad, ids=ids)
    write_manifest(out, ids.freeze())
    pruned = prune_queued(conn, cfg.run, ids) if prune else 0
    if line := coverage(conn, cfg.run, ids).stray_line(pruned):
        tqdm.write(f"harvest: run {cfg.run} holds samples that {dataset} no longer holds: {line}", file=sys.stderr)
    if summary.enqueued:
        unsettle(out)
    return summary, pruned


def _run_locked(
    cfg: RunConfig,
    dataset: str,
    settings: RunnerSettings,
    produce_kw: dict | None,
    work: str,
    dumps: str,
    locks: RunnerLocks,
    plan: EnginePlan | None,
) -> RunSummary:
    t0 = time.monotonic()
    redis_url, outage_s = settings.redis_url, settings.outage_s
    logs, spool = os.path.join(work, "logs"), os.path.join(work, "spool")
    os.makedirs(logs, exist_ok=True)
    server = keeper = None
    children = Supervisor(logs)
    node: Node | None = None
    try:
        if redis_url is None:
            server = RedisServer(os.path.join(work, REDIS_SUBDIR)).start()
            keeper = RedisKeeper(server, note=children.note)
            keeper.start()
        conn = connect_service(server.url if server else redis_url, outage_s)
        cfg = publish_run(conn, cfg)  # checks Redis's and run.json's configuration first, then writes
        out = run_location(cfg.out_url, cfg.run)
        if server is not None:
            locks.update(run=cfg.run, redis=server.url)  # `harvest status --work-dir` talks to it meanwhile
        recovery = Recovery(conn, cfg)
        ledger = Ledger(conn, cfg.run)
        disk = DiskWatch(work, spool, server.data_dir if server else None, settings.min_free_bytes)
        node = Node(children, cfg, settings.node(), plan, server.url if server else redis_url, dumps, spool, disk)
        before = ledger.counts()
        if before["queued"] or before["spooled"]:
            unsettle(out)
        if (before["total"] == 0 or before["queued"] or before["spooled"]) and not settings.prune:
            # Work ahead: overlap the start-up (imports, the engine's model load) with reconcile and
            # the producer. A rerun of a run with nothing pending produces first instead, and
            # starts them only if the dataset brings something new; so does --prune, whose queued
            # samples the dataset no longer holds must be dropped before a worker takes them.
            node.start_workers()
        from harvest.ops.reconcile import reconcile

        reconcile(conn, cfg)
        if node.started or (ledger.counts()["queued"] and not settings.prune):
            node.ensure()

        def on_wait(_: int) -> None:  # the queue is full: its consumers must run
            node.ensure()
            node.tend()

        from harvest.producer.producer import produce

        def produce_pass(**kw: Any) -> ProduceSummary:
            return produce(
                conn,
                cfg,
                dataset,
                max_queued=settings.max_queued,
                progress=settings.progress,
                on_wait=on_wait,
                **kw,
                **(produce_kw or {}),
            )

        ids = SampleIds()
        summary, pruned = _produce(conn, cfg, out, dataset, ids, produce_pass, settings.prune)
        cov, again = _finish(conn, cfg, ids, ledger, recovery, node, produce_pass, settings.progress)
        node.stop()
        c = ledger.counts()
        if c["queued"] == 0 and c["spooled"] == 0 and not cov.missing:  # every index is written: followers may end
            settle(out, cfg.run, c["done"], c["failed"])
        return _summary(
            cfg,
            ledger,
            summary,
            cov,
            pruned,
            again,
            time.monotonic() - t0,
            children.restarts(),
            _where(work, settings.redis_url),
            node.started,
        )
    except RedisLost as e:
        if keeper is not None and keeper.last_error:
            e.hint = f"its private redis-server did not start again: {keeper.last_error}"
        raise
    except KeyboardInterrupt:
        hurry_on_signals(children)
        tqdm.write(
            "harvest: stopping: the workers finish their jobs, the collector commits what is spooled, then "
            "the engine and Redis stop (Ctrl-C again: the workers hand their jobs back at once)",
            file=sys.stderr,
        )
        raise
    finally:
        hurry_on_signals(children)
        if node is not None:
            node.stop()
        if keeper is not None:
            keeper.stop()  # before the server: a server stopped on purpose is not restarted
        if server is not None and server.proc is not None and server.proc.poll() is None:
            children.note("stopping redis-server")
            server.stop()
            children.note(f"redis-server stopped (exit status {server.proc.returncode})")


def _finish(
    conn: redis.Redis,
    cfg: RunConfig,
    ids: SampleIds,
    ledger: Ledger,
    recovery: Recovery,
    node: Node,
    produce_pass: Callable[..., ProduceSummary],
    progress: bool,
) -> tuple[Coverage, int]:
    """Extract until nothing is queued or spooled; then, while samples of the dataset are in no
    state (a Redis that came back without them: the index files gave back the committed ones,
    nothing the queued ones), a producer pass enqueues them again and the extraction goes on, at
    most AGAIN_PASSES times. Returns the dataset's coverage at the end and the samples enqueued again."""
    again = 0
    for n in range(AGAIN_PASSES + 1):
        recovery.check(force=True)  # the ledger read below is one reconciled on the server answering
        c = ledger.counts()
        if c["queued"] or c["spooled"]:
            node.ensure()
        if node.started:
            _extract(ledger, recovery, node, progress)
        cov = coverage(conn, cfg.run, ids)
        if not cov.by_state["absent"] or n == AGAIN_PASSES:
            return cov, again
        line = (
            f"harvest: {cov.by_state['absent']} samples of the dataset are in no state (a Redis that came back "
            "without them): enqueuing them again"
        )
        node.children.note(line)
        tqdm.write(line, file=sys.stderr)
        again += produce_pass(on_bad=lambda _: None).enqueued  # its bad rows were reported by the first pass
    return cov, again


def _extract(ledger: Ledger, recovery: Recovery, node: Node, progress: bool) -> None:
    """Until nothing is queued or spooled: the progress bar, Redis's identity, the children."""
    bar = progress_display("extract", " samples", total=ledger.counts()["total"], enabled=progress)  # TTY: a bar
    while True:
        recovery.check()  # rate-limited by itself: one INFO every few seconds
        c = ledger.counts()
        bar.total = c["total"]
        bar.n = c["done"] + c["failed"]
        bar.set_postfix_str(f"queued {c['queued']} spooled {c['spooled']} failed {c['failed']}")
        bar.refresh()
        if c["queued"] == 0 and c["spooled"] == 0:
            if recovery.unchanged():  # nothing left, judged on a ledger reconciled on the server answering
                break
            continue
        node.tend()
        time.sleep(0.1)
    bar.close()
