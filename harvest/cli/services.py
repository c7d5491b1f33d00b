"""The services a fleet runs apart, each a long-lived process: `produce`, `worker`, `collect`
and `engine` (the CPU reference engine)."""

from __future__ import annotations

import signal
import sys

import click

from harvest.cli.checks import check_dataset, check_layers, check_model, check_output
from harvest.cli.errors import connect_service, redis_wait_option
from harvest.cli.options import (
    apply_s3_env,
    chunked_prefill_option,
    codec_option,
    dtype_option,
    layers_option,
    max_queued_option,
    node_option,
    produce_engine_option,
    producer_kwargs,
    producer_options,
    redis_option,
    regenerate_options,
    regenerate_settings,
    run_option,
    s3_options,
    service_logging,
    spool_grace_option,
)
from harvest.settings import (
    CollectorSettings,
    EngineSettings,
    WorkerSettings,
)


@click.command("produce")
@click.argument("dataset", type=click.Path())
@run_option
@redis_option
@click.option("--model", default=None, type=click.Path(), help="Model directory (needed when the run is new).")
@click.option("--out", "out_url", default=None, help="Output URL (needed when the run is new).")
@layers_option
@dtype_option
@codec_option
@max_queued_option
@producer_options
@regenerate_options
@click.option("--dry-run", is_flag=True, help="Tokenize and count; enqueue nothing (with --model, no Redis needed).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@produce_engine_option
@spool_grace_option
@s3_options
@redis_wait_option
def produce_cmd(
    dataset: str,
    run: str,
    redis_url: str,
    model: str | None,
    out_url: str | None,
    layers: str,
    storage_dtype: str,
    codec: str,
    max_queued: int,
    batch_samples: int | None,
    batch_tokens: int | None,
    fields: tuple[str, ...],
    chat_template: str | None,
    max_len: int | None,
    overlong: str,
    regenerate: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    on_length: str,
    dry_run: bool,
    strict: bool,
    progress: bool | None,
    processes: int,
    engine: str,
    spool_grace: float,
    s3_endpoint: str | None,
    s3_region: str | None,
    redis_wait: float | None,
) -> None:
    """Tokenize DATASET and enqueue its samples for run RUN (idempotent, bounded).

    Exit status: 0, 1 when some rows were bad (each is reported with its file and line), 2 on errors,
    75 when Redis stayed away past --redis-wait (run it again: it skips what is enqueued).
    """
    apply_s3_env(s3_endpoint, s3_region)
    check_dataset(dataset)
    check_model(model)
    if not dry_run:
        check_output(out_url)
    kw = producer_kwargs(fields, chat_template, max_len, overlong, strict, processes)
    conn = None if (dry_run and model) else connect_service(redis_url, redis_wait)
    from tqdm import tqdm

    from harvest.ops.runs import open_run
    from harvest.producer.producer import load_tokenizer, produce

    kw.update(dry_run=dry_run, on_bad=lambda r: tqdm.write(f"{r.kind} row {r}", file=sys.stderr))  # above the bar
    progress = sys.stderr.isatty() if progress is None else progress
    regen = regenerate_settings(regenerate, max_new_tokens, temperature, top_p, on_length, model)
    if conn is None:
        s = produce(
            None, None, dataset, tokenizer=load_tokenizer(model), progress=progress, regenerate=regenerate, **kw
        )
    else:
        cfg = open_run(
            conn,
            run,
            model=model,
            out_url=out_url,
            layers=layers,
            storage_dtype=storage_dtype,
            codec=codec,
            engine=engine,
            dry_run=dry_run,
            batch_samples=batch_samples,
            batch_tokens=batch_tokens,
            spool_grace_s=spool_grace,
            regenerate=regen,
        )
        if regenerate and cfg.regenerate is None:
            raise click.UsageError(
                f"run {run} exists without --regenerate: a run's samples are regenerated from its "
                "start or not at all; name a new --run"
            )
        s = produce(conn, cfg, dataset, max_queued=max_queued, progress=progress, **kw)
    click.echo(s.text())
    sys.exit(1 if s.bad else 0)


@click.command("worker")
@run_option
@redis_option
@click.option(
    "--engine-url",
    default=f"http://127.0.0.1:{EngineSettings.port}",
    show_default=True,
    help="This node's engine (SGLang, vLLM or the reference engine): where /generate is sent.",
)
@click.option(
    "--dump-dir",
    required=True,
    type=click.Path(),
    help="Where the engine writes its hidden-state dumps (the same folder the engine was given).",
)
@click.option(
    "--spool-dir",
    required=True,
    type=click.Path(),
    help="This node's spool: verified samples wait here for its collector (the collector's --spool-dir).",
)
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option(
    "--dump-timeout",
    default=WorkerSettings.dump_timeout_s,
    show_default=True,
    help="Seconds to wait for a request's dump files.",
)
@click.option(
    "--retries",
    default=WorkerSettings.retries,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Retries of a job that meets a transient error (engine down, 5xx, timeout, spool disk).",
)
@click.option(
    "--retry-backoff",
    default=WorkerSettings.retry_backoff_s,
    show_default=True,
    type=click.FloatRange(1),
    help="Seconds before the first retry; x3 each time, at most 300.",
)
@click.option("--max-jobs", default=None, type=click.IntRange(1), help="Exit after this many jobs.")
@click.option(
    "--max-spool-mb",
    default=WorkerSettings.max_spool_bytes >> 20,
    show_default=True,
    type=click.IntRange(1),
    help="Wait (backpressure) while this node's spool holds more than this.",
)
@click.option(
    "--engine-wait",
    default=WorkerSettings.engine_wait_s,
    show_default=True,
    type=click.FloatRange(0),
    help="Take no job until the engine is healthy, up to this many seconds (SGLang loads for minutes).",
)
@node_option
@s3_options
@redis_wait_option
def worker_cmd(
    run: str,
    redis_url: str,
    engine_url: str,
    dump_dir: str,
    spool_dir: str,
    burst: bool,
    dump_timeout: float,
    retries: int,
    retry_backoff: float,
    max_jobs: int | None,
    max_spool_mb: int,
    engine_wait: float,
    node: str | None,
    s3_endpoint: str | None,
    s3_region: str | None,
    redis_wait: float | None,
) -> None:
    """Take jobs of RUN: engine call, claim dumps, verify, spool.

    A job's rows are read from the run's output (`<out>/<run>/jobs/`), where the producer wrote
    them: a worker needs read access to the output, as its node's collector needs write access (one
    without S3 credentials for an s3:// output stops at once, naming them).

    Exit status: 0, 2 on errors, 75 when Redis stayed away past --redis-wait (its job goes back to
    the queue through the janitor; start the worker again).
    """
    service_logging()
    apply_s3_env(s3_endpoint, s3_region)
    conn = connect_service(redis_url, redis_wait)
    from harvest.state.runstore import load_run
    from harvest.workers.worker import run_worker

    # its jobs' rows are in the output: without credentials every job would only be handed back
    check_output(load_run(conn, run).out_url, reach=False)

    settings = WorkerSettings(
        dump_timeout_s=dump_timeout,
        max_spool_bytes=max_spool_mb << 20,
        retries=retries,
        retry_backoff_s=retry_backoff,
        engine_wait_s=engine_wait,
        max_jobs=max_jobs,
        burst=burst,
        node=node,
    )
    run_worker(redis_url, run, engine_url, dump_dir, spool_dir, settings, conn=conn)


@click.command("collect")
@run_option
@redis_option
@click.option(
    "--spool-dir",
    required=True,
    type=click.Path(),
    help="This node's spool, the folder its workers write verified samples into.",
)
@click.option(
    "--max-wait",
    default=CollectorSettings.max_wait_s,
    show_default=True,
    help="Commit a partial shard once its oldest sample is this old (s).",
)
@click.option("--shard-mb", default=None, type=click.IntRange(1), help="Target shard size in MiB (default: the run's).")
@click.option(
    "--part-mb",
    default=None,
    type=click.IntRange(5),
    help=f"Object storage: multipart part size in MiB (default {CollectorSettings.part_bytes >> 20}; up to 5 "
    "parts in memory per packer).",
)
@click.option(
    "--pack-workers",
    default=None,
    type=click.IntRange(1),
    help="Packers sharing this spool, each streaming its own shards "
    f"[default: the cores, up to {CollectorSettings.MAX_PACK_WORKERS}].",
)
@node_option
@click.option("--burst", is_flag=True, help="Commit what is spooled now, then exit.")
@s3_options
@redis_wait_option
def collect_cmd(
    run: str,
    redis_url: str,
    spool_dir: str,
    max_wait: float,
    shard_mb: int | None,
    part_mb: int | None,
    pack_workers: int | None,
    node: str | None,
    burst: bool,
    s3_endpoint: str | None,
    s3_region: str | None,
    redis_wait: float | None,
) -> None:
    """Pack this node's spool into shards and commit them to the run's output.

    Exit status: 0, 2 on errors, 77 when the output refuses writes (read-only, permission or access
    denied: restarting will not help), 75 when Redis stayed away past --redis-wait; after any, the
    spool and the shard in progress are kept, and a restart finishes it.
    """
    service_logging()
    apply_s3_env(s3_endpoint, s3_region)
    conn = connect_service(redis_url, redis_wait)
    from harvest.collector.service import run_collector
    from harvest.errors import OutputRefused, StorageError, refuses_writes
    from harvest.state.runstore import load_run

    cfg = load_run(conn, run)
    check_output(cfg.out_url, reach=False)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    settings = CollectorSettings(
        max_wait_s=max_wait,
        shard_bytes=shard_mb << 20 if shard_mb else None,
        part_bytes=part_mb << 20 if part_mb else CollectorSettings.part_bytes,
        pack_workers=pack_workers,
        node=node,
        burst=burst,
    )
    try:
        run_collector(conn, cfg, spool_dir, settings, lambda: stop["now"])
    except StorageError as e:
        kind = OutputRefused if refuses_writes(e) else StorageError  # 77 for a wall no restart gets past
        raise kind(
            f"collector stopped: {e}. The spool in {spool_dir} is intact and the shard in progress is "
            "recorded in Redis; fix the storage and start the collector again (`harvest collect`, or the "
            "same `harvest run`) to finish it."
        ) from e


@click.command("engine")
@click.option(
    "--model", required=True, type=click.Path(exists=True), help="Local folder of the transformers model to serve."
)
@click.option("--dump-dir", required=True, type=click.Path(), help="Where to write each request's hidden-state dumps.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=EngineSettings.port, show_default=True, type=int, help="Port to listen on.")
@layers_option
@chunked_prefill_option
@click.option(
    "--threads",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="torch threads for the forward (0: torch's default, all cores).",
)
def engine_cmd(
    model: str, dump_dir: str, host: str, port: int, layers: str, chunked_prefill_size: int, threads: int
) -> None:
    """Serve the CPU reference engine (SGLang /generate subset, harvest dump contract)."""
    check_layers(model, layers)  # before torch loads: a wrong --layers is told at once
    import torch

    from harvest.engines.reference import ReferenceEngine, serve

    if threads:
        torch.set_num_threads(threads)

    engine = ReferenceEngine(model, dump_dir, layers=layers, chunked_prefill_size=chunked_prefill_size)
    server = serve(engine, host, port)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    click.echo(f"reference engine on http://{host}:{port} capturing {engine.capture_points}", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


COMMANDS = (produce_cmd, worker_cmd, collect_cmd, engine_cmd)
