"""The `harvest` command: the composition root that wires producer, workers and collector.

Nothing imports this module; it imports the services lazily so `harvest --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import sys

import click

DEFAULT_REDIS = os.environ.get("HARVEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _fail(msg: str) -> None:
    click.echo(f"harvest: error: {msg}", err=True)
    sys.exit(2)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def _default_run_name(dataset: str) -> str:
    from harvest.ids import safe_id

    return safe_id(os.path.basename(dataset.rstrip("/")).split(".")[0], "run", limit=200)


redis_option = click.option("--redis", "redis_url", default=DEFAULT_REDIS, show_default=True, help="Redis URL (password and user go in the URL).")
run_option = click.option("--run", "run", required=True, help="Run name ([A-Za-z0-9_-]+).")


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """harvest: extract an LLM's hidden states for whole datasets (EAGLE-3 drafter training data)."""
    _logging(verbose)


@main.command("run")
@click.argument("dataset", type=click.Path())
@click.option("--model", required=True, type=click.Path(), help="Local HF model directory.")
@click.option("--out", "out_url", required=True, help="Output folder or fsspec URL (file://, s3://).")
@click.option("--run", "run", default=None, help="Run name; defaults to the dataset's file name.")
@click.option("--layers", default="eagle3", show_default=True, help="'eagle3' or HF hidden_states indices, e.g. 2,4,7.")
@click.option("--dtype", "storage_dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16", "fp32", "fp8_e4m3"]))
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 256),
              help="Workers for the engine: with 2, one batch is in the engine while the other worker spools.")
@click.option("--redis", "redis_url", default=None, help="Use this Redis instead of starting a private one.")
@click.option("--engine-url", default=None, help="Use this engine instead of starting the reference engine.")
@click.option("--engine", "engine", default="reference", show_default=True, type=click.Choice(["reference", "vllm"]),
              help="Engine kind; vllm starts a vLLM CPU server from HARVEST_VLLM_VENV (scripts/vllm_venv.sh) unless --engine-url.")
@click.option("--chunked-prefill-size", default=0, show_default=True, type=click.IntRange(0), help="Reference engine chunk size (0: whole prompts).")
@click.option("--work-dir", default=None, type=click.Path(), help="Node-local state (Redis data, spool, logs).")
@click.option("--dump-dir", default=None, type=click.Path(), help="Engine dump directory (default under /dev/shm).")
@click.option("--max-queued", default=20000, show_default=True, type=click.IntRange(1))
@click.option("--shard-mb", default=1024, show_default=True, type=click.IntRange(1), help="Target shard size in MiB.")
@click.option("--no-progress", is_flag=True)
@click.option("--s3-endpoint", default=None, help="S3-compatible endpoint URL for s3:// output (else HARVEST_S3_ENDPOINT / AWS_ENDPOINT_URL).")
@click.option("--s3-region", default=None, help="S3 region (else AWS_REGION / AWS_DEFAULT_REGION).")
def run_cmd(dataset, model, out_url, run, layers, storage_dtype, workers, redis_url, engine_url, chunked_prefill_size,
            work_dir, dump_dir, max_queued, shard_mb, no_progress, s3_endpoint=None, s3_region=None, engine="reference") -> None:
    """Extract hidden states for DATASET end to end on this machine."""
    _s3_env(s3_endpoint, s3_region)  # before any child starts: the collector inherits it
    from harvest.cli.redisproc import RedisNotInstalled
    from harvest.cli.runner import run_all
    from harvest.config import ConfigError, build_config

    try:
        cfg = build_config(run or _default_run_name(dataset), model, out_url, layers, storage_dtype, engine=engine,
                           shard_bytes=shard_mb << 20)
        summary = run_all(cfg, dataset, workers=workers, redis_url=redis_url, engine_url=engine_url, work_dir=work_dir,
                          dump_dir=dump_dir, chunked_prefill_size=chunked_prefill_size, max_queued=max_queued,
                          progress=not no_progress)
    except (ConfigError, RedisNotInstalled, FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(str(e))
    for line in summary.lines():
        click.echo(line)
    sys.exit(1 if summary.failed else 0)


@main.command("demo")
@click.option("--out", "out_dir", default="harvest-demo", show_default=True, type=click.Path())
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1, 64))
def demo_cmd(out_dir: str, workers: int) -> None:
    """Build a tiny model offline and run the whole pipeline on a bundled dataset."""
    from harvest.cli.demo import build_tiny_model, demo_rows, write_jsonl

    click.echo("building the tiny demo model (cached after the first time)...")
    model = build_tiny_model()
    dataset = write_jsonl(os.path.join(out_dir, "demo.jsonl"), demo_rows())
    ctx = click.get_current_context()
    ctx.invoke(
        run_cmd, dataset=dataset, model=model, out_url=os.path.join(out_dir, "output"), run="demo", layers="eagle3",
        storage_dtype="bf16", workers=workers, redis_url=None, engine_url=None, chunked_prefill_size=64,
        work_dir=os.path.join(out_dir, "work"), dump_dir=None, max_queued=20000, shard_mb=1024, no_progress=False,
    )


@main.command("produce")
@click.argument("dataset", type=click.Path())
@run_option
@redis_option
@click.option("--model", default=None, type=click.Path(), help="Model directory (needed when the run is new).")
@click.option("--out", "out_url", default=None, help="Output URL (needed when the run is new).")
@click.option("--layers", default="eagle3", show_default=True)
@click.option("--dtype", "storage_dtype", default="bf16", show_default=True,
              type=click.Choice(["bf16", "fp16", "fp32", "fp8_e4m3"]))
@click.option("--max-queued", default=20000, show_default=True, type=click.IntRange(1),
              help="Samples queued or in flight at most; the producer waits while the queue is full.")
@click.option("--batch-samples", default=None, type=click.IntRange(1),
              help="Samples per job (default: the run's, 32).")
@click.option("--batch-tokens", default=None, type=click.IntRange(1),
              help="Tokens per job (default: the run's, 16384); size it to keep the engine's prefill budget full.")
@click.option("--field", "fields", multiple=True, metavar="NAME=COLUMN",
              help="Read a field from another column, e.g. text=content (repeatable).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Jinja chat template file (default: the tokenizer's).")
@click.option("--max-len", type=click.IntRange(1), default=None, help="Longest sample in tokens.")
@click.option("--overlong", type=click.Choice(["skip", "truncate"]), default="skip", show_default=True,
              help="What to do with samples over --max-len (skipped ones are reported).")
@click.option("--dry-run", is_flag=True, help="Tokenize and count; enqueue nothing (with --model, no Redis needed).")
@click.option("--strict", is_flag=True, help="Stop at the first bad row.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--processes", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Tokenizer processes; pays only with cores beyond those the tokenizer's threads fill.")
@click.option("--engine", "engine", default="reference", show_default=True,
              type=click.Choice(["reference", "sglang", "vllm"]),
              help="Engine kind of a new run; workers pick their client by it (vllm: the vLLM client).")
def produce_cmd(dataset, run, redis_url, model, out_url, layers, storage_dtype, max_queued, batch_samples, batch_tokens,
                fields, chat_template, max_len, overlong, dry_run, strict, progress, processes,
                engine="reference") -> None:
    """Tokenize DATASET and enqueue its samples for run RUN (idempotent, bounded).

    Exit status: 0, 1 when some rows were bad (each is reported with its file and line), 2 on errors.
    """
    import redis as redislib
    from tqdm import tqdm

    from harvest.config import ConfigError, build_config
    from harvest.ops.reconcile import reconcile
    from harvest.state.runstore import load_run, publish_run
    from producer.producer import load_tokenizer, produce
    from producer.rowkinds import FieldMap
    from producer.templates import load_chat_template
    from producer.tokenize import LengthPolicy

    conn = None if (dry_run and model) else redislib.Redis.from_url(redis_url)
    try:
        kw = dict(
            fields=FieldMap.parse(fields),
            chat_template=load_chat_template(chat_template) if chat_template else None,
            length=LengthPolicy(max_len, overlong),
            dry_run=dry_run,
            on_bad=lambda r: tqdm.write(f"{r.kind} row {r}", file=sys.stderr),  # above the progress bar
            processes=processes,
        )
        progress = sys.stderr.isatty() if progress is None else progress
        if conn is None:
            s = produce(None, None, dataset, tokenizer=load_tokenizer(model), progress=progress, strict=strict, **kw)
        else:
            if model and out_url and not dry_run:
                cfg = publish_run(conn, build_config(run, model, out_url, layers, storage_dtype, engine=engine))
                reconcile(conn, cfg)
            else:
                cfg = load_run(conn, run)
            cfg = dataclasses.replace(cfg, max_batch_samples=batch_samples or cfg.max_batch_samples,
                                      max_batch_tokens=batch_tokens or cfg.max_batch_tokens)  # job sizes only
            s = produce(conn, cfg, dataset, max_queued=max_queued, progress=progress, strict=strict, **kw)
    except (ConfigError, FileNotFoundError, ValueError, redislib.ConnectionError) as e:
        _fail(str(e))
    click.echo(s.text())
    sys.exit(1 if s.bad else 0)


@main.command("worker")
@run_option
@redis_option
@click.option("--engine-url", default="http://127.0.0.1:30000", show_default=True)
@click.option("--dump-dir", required=True, type=click.Path())
@click.option("--spool-dir", required=True, type=click.Path())
@click.option("--burst", is_flag=True, help="Exit when the queue is empty.")
@click.option("--dump-timeout", default=60.0, show_default=True, help="Seconds to wait for a request's dump files.")
@click.option("--retries", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Retries of a job that meets a transient error (engine down, 5xx, timeout, spool disk).")
@click.option("--retry-backoff", default=10.0, show_default=True, type=click.FloatRange(1),
              help="Seconds before the first retry; x3 each time, at most 300.")
@click.option("--max-jobs", default=None, type=click.IntRange(1), help="Exit after this many jobs.")
@click.option("--max-spool-mb", default=64 << 10, show_default=True, type=click.IntRange(1),
              help="Wait (backpressure) while this node's spool holds more than this.")
@click.option("--engine-wait", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Take no job until the engine is healthy, up to this many seconds (SGLang loads for minutes).")
def worker_cmd(run, redis_url, engine_url, dump_dir, spool_dir, burst, dump_timeout, retries, retry_backoff, max_jobs,
               max_spool_mb, engine_wait) -> None:
    """Take jobs of RUN: engine call, claim dumps, verify, spool."""
    from harvest.config import ConfigError
    from workers.worker import run_worker

    try:
        run_worker(redis_url, run, engine_url, dump_dir, spool_dir, burst=burst, dump_timeout=dump_timeout,
                   retries=retries, retry_backoff=retry_backoff, max_jobs=max_jobs, max_spool_bytes=max_spool_mb << 20, engine_wait=engine_wait)
    except ConfigError as e:
        _fail(str(e))


def _s3_env(endpoint: str | None, region: str | None) -> None:
    """S3 flags override the environment for this process and the ones it starts."""
    if endpoint:
        os.environ["HARVEST_S3_ENDPOINT"] = endpoint
    if region:
        os.environ["HARVEST_S3_REGION"] = region


s3_endpoint_option = click.option("--s3-endpoint", default=None,
                                  help="S3-compatible endpoint URL (MinIO, Ceph...); else HARVEST_S3_ENDPOINT / AWS_ENDPOINT_URL. "
                                       "Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.")
s3_region_option = click.option("--s3-region", default=None, help="S3 region; else AWS_REGION / AWS_DEFAULT_REGION.")


@main.command("collect")
@run_option
@redis_option
@click.option("--spool-dir", required=True, type=click.Path())
@click.option("--max-wait", default=60.0, show_default=True, help="Commit a partial shard once its oldest sample is this old (s).")
@click.option("--shard-mb", default=None, type=click.IntRange(1), help="Target shard size in MiB (default: the run's).")
@click.option("--part-mb", default=None, type=click.IntRange(5), help="Multipart upload part size in MiB (default: s3fs's, 50).")
@click.option("--node", default=None, help="Node name (default: host name).")
@click.option("--burst", is_flag=True, help="Commit what is spooled now, then exit.")
@s3_endpoint_option
@s3_region_option
def collect_cmd(run, redis_url, spool_dir, max_wait, shard_mb, part_mb, node, burst, s3_endpoint, s3_region) -> None:
    """Pack this node's spool into shards and commit them to the run's output."""
    import redis as redislib

    from collector.collector import Collector
    from harvest.config import ConfigError
    from harvest.state.runstore import load_run
    from harvest.storage import StorageError

    _s3_env(s3_endpoint, s3_region)
    conn = redislib.Redis.from_url(redis_url)
    try:
        cfg = load_run(conn, run)
    except ConfigError as e:
        _fail(str(e))
    stop = {"now": burst}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    os.makedirs(spool_dir, mode=0o700, exist_ok=True)
    collector = Collector(conn, cfg, spool_dir, node=node, max_wait=max_wait,
                          shard_bytes=shard_mb << 20 if shard_mb else None, part_bytes=part_mb << 20 if part_mb else None)
    try:
        collector.run(lambda: stop["now"])
    except StorageError as e:
        _fail(f"collector stopped: {e}. The spool in {spool_dir} is intact and the shard in progress is recorded "
              "in Redis; fix the storage and restart `harvest collect` to finish it.")


@main.command("engine")
@click.option("--model", required=True, type=click.Path(exists=True))
@click.option("--dump-dir", required=True, type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@click.option("--layers", default="eagle3", show_default=True)
@click.option("--chunked-prefill-size", default=0, show_default=True, type=click.IntRange(0))
@click.option("--threads", default=0, show_default=True, type=click.IntRange(0),
              help="torch threads for the forward (0: torch's default, all cores).")
def engine_cmd(model, dump_dir, host, port, layers, chunked_prefill_size, threads) -> None:
    """Serve the CPU reference engine (SGLang /generate subset, harvest dump contract)."""
    import torch

    from engines.reference import ReferenceEngine, serve

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


@main.command("reconcile")
@run_option
@redis_option
@click.option("--out", "out_url", default=None,
              help="The run's output URL; needed when Redis lost the run (its run.json is read from there).")
@s3_endpoint_option
@s3_region_option
def reconcile_cmd(run, redis_url, out_url, s3_endpoint, s3_region) -> None:
    """Rebuild the Redis done-set of RUN from the index files in storage."""
    import redis as redislib

    from harvest.config import ConfigError
    from harvest.ops.reconcile import reconcile, restore_run
    from harvest.state.runstore import load_run
    from harvest.storage import StorageError

    _s3_env(s3_endpoint, s3_region)
    conn = redislib.Redis.from_url(redis_url)
    try:
        cfg = restore_run(conn, run, out_url) if out_url else load_run(conn, run)
        n = reconcile(conn, cfg)
    except (ConfigError, StorageError) as e:
        _fail(str(e))
    click.echo(f"marked {n} samples done from storage")


@main.command("export")
@click.option("--run-url", required=True, help="The run's output folder: <out>/<run> (local path or fsspec URL).")
@click.option("--format", "fmt", required=True, type=click.Choice(["specforge", "speculators"]))
@click.argument("dest", type=click.Path())
@click.option("--dtype", "dtype", default=None, type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Hidden-state dtype of the files (default: the run's; fp8 runs export bf16).")
@click.option("--no-progress", is_flag=True)
@s3_endpoint_option
@s3_region_option
def export_cmd(run_url, fmt, dest, dtype, no_progress, s3_endpoint, s3_region) -> None:
    """Write one file per sample of a run in the layout a drafter trainer reads (idempotent)."""
    from harvest.config import ConfigError, storage_torch_dtype
    from harvest.read.dataset import NoFinalState
    from harvest.read.export import export_run

    _s3_env(s3_endpoint, s3_region)
    try:
        rep = export_run(run_url, fmt, dest, dtype=storage_torch_dtype(dtype) if dtype else None, progress=not no_progress)
    except (ConfigError, NoFinalState, OSError) as e:
        _fail(str(e))
    click.echo(f"exported {rep.written} samples to {dest} ({rep.skipped} already there)")


@main.command("status")
@run_option
@redis_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per line).")
@click.option("--watch", "watch", default=None, type=click.FloatRange(0.5), is_flag=False, flag_value=2.0,
              help="Refresh in place every N seconds (default 2) until Ctrl-C.")
def status_cmd(run, redis_url, as_json, watch) -> None:
    """Where RUN stands: counts, throughput, ETA, workers, spool backlog, failure reasons."""
    import json
    import time

    import redis as redislib

    from harvest.ops.status import compute_status, render
    from harvest.state.runstore import load_run

    conn = redislib.Redis.from_url(redis_url)
    try:
        load_run(conn, run)
    except Exception as e:  # ConfigError, or Redis unreachable
        _fail(str(e))
    try:
        while True:
            st = compute_status(conn, run)
            if as_json:
                click.echo(json.dumps(st.to_dict()))
            elif watch:  # clear the screen and redraw (on a terminal; piped output gets one frame after another)
                click.echo("\x1b[H\x1b[2J" + render(st))
            else:
                click.echo(render(st))
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        pass


@main.command("requeue")
@run_option
@redis_option
@click.option("--reason", "reasons", multiple=True, help="Requeue the failed samples with this reason (repeatable).")
@click.option("--sample", "samples", multiple=True, help="Requeue this failed sample id (repeatable).")
@click.option("--all", "all_", is_flag=True, help="Every failed sample, and RQ's failed jobs of the run.")
@click.option("--dry-run", is_flag=True, help="List what would be requeued; change nothing.")
def requeue_cmd(run, redis_url, reasons, samples, all_, dry_run) -> None:
    """Put failed samples of RUN back on the queue, exactly once."""
    import redis as redislib

    from harvest.config import ConfigError
    from harvest.ids import InvalidId
    from harvest.ops.requeue import requeue
    from harvest.state.runstore import load_run

    if not (reasons or samples or all_):
        _fail("say what to requeue: --reason REASON, --sample ID or --all (see `harvest status` for the reasons)")
    conn = redislib.Redis.from_url(redis_url)
    try:
        res = requeue(conn, load_run(conn, run), reasons=reasons, sample_ids=samples, all_=all_, dry_run=dry_run)
    except (ConfigError, InvalidId) as e:
        _fail(str(e))
    verb = "would requeue" if dry_run else "requeued"
    click.echo(f"{verb} {len(res.samples)} failed samples" + (f" in {len(res.jobs)} jobs" if res.jobs else "")
               + "".join(f", {n} {r}" for r, n in sorted(res.reasons.items())))
    if dry_run:
        for sid in res.samples:
            click.echo(f"  {sid}")
    if res.rq_jobs_requeued or res.rq_jobs_dropped:
        click.echo(f"RQ failed jobs: {verb} {len(res.rq_jobs_requeued)}, "
                   f"{'would drop' if dry_run else 'dropped'} {len(res.rq_jobs_dropped)} whose samples the ledger holds")
    if res.no_payload:
        click.echo(f"{len(res.no_payload)} failed samples have no kept tokens and stay failed; "
                   "requeue them from the dataset with `harvest produce` after `harvest reconcile`", err=True)


@main.command("janitor")
@run_option
@redis_option
@click.option("--dump-dir", default=None, type=click.Path(), help="Also clean this node's dump dir.")
@click.option("--interval", default=None, type=click.FloatRange(1), help="Repeat every N seconds (default: once).")
def janitor_cmd(run, redis_url, dump_dir, interval) -> None:
    """Take back dead workers' jobs, release due retries, clean dead claim dirs (workers do this too)."""
    import time

    import redis as redislib

    from harvest.ops.janitor import janitor_pass

    conn = redislib.Redis.from_url(redis_url)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    while not stop["now"]:
        rep = janitor_pass(conn, run, dump_dir)
        click.echo(f"reaped {len(rep.reaped)} jobs, gave up {len(rep.gave_up)}, released {len(rep.promoted)} retries, "
                   f"forgot {len(rep.forgotten_workers)} dead workers, removed {len(rep.claim_dirs_removed)} claim dirs "
                   f"and {rep.stale_dumps_removed} stale dump files")
        if interval is None:
            return
        time.sleep(interval)


@main.command("metrics")
@redis_option
@click.option("--port", default=9108, show_default=True, type=int)
@click.option("--addr", default="0.0.0.0", show_default=True)
@click.option("--run", "runs", multiple=True, help="Export these runs (default: every run in Redis).")
def metrics_cmd(redis_url, port, addr, runs) -> None:
    """Serve Prometheus metrics for the runs in Redis at http://ADDR:PORT/metrics."""
    import threading

    import redis as redislib

    from harvest.ops.metrics import serve

    serve(redislib.Redis.from_url(redis_url), port, addr, runs or None)
    click.echo(f"serving metrics on http://{addr}:{port}/metrics", err=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass


def _capture_points(model_path: str, num_layers: int | None, run: str | None, redis_url: str,
                    layers: str) -> tuple[int, list[int]]:
    """(decoder layers, capture points) for an engine launch: the run's points when named."""
    from harvest.config import model_layers, parse_layers

    n = num_layers or model_layers(model_path)
    if run:
        import redis as redislib

        from harvest.state.runstore import load_run

        return n, load_run(redislib.Redis.from_url(redis_url), run).capture_points
    return n, parse_layers(layers, n)


@main.command("sglang-args")
@click.option("--model", "model_path", required=True, help="Model path as the SGLang server will see it.")
@click.option("--layers", default="eagle3", show_default=True, help="'eagle3' or HF hidden_states indices.")
@click.option("--num-layers", default=None, type=click.IntRange(1), help="Decoder layers (default: read MODEL/config.json).")
@click.option("--run", "run", default=None, help="Take the capture points from this run in Redis instead of --layers.")
@redis_option
@click.option("--tp", "tp_size", default=1, show_default=True, type=click.IntRange(1))
@click.option("--dump-dir", default="/dev/shm/harvest", show_default=True)
@click.option("--port", default=30000, show_default=True, type=int)
@click.option("--chunked-prefill-size", default=8192, show_default=True, type=click.IntRange(1))
@click.option("--sglang-version", default="0.5.23", show_default=True, help="Flag spellings differ between versions.")
def sglang_args_cmd(model_path, layers, num_layers, run, redis_url, tp_size, dump_dir, port, chunked_prefill_size, sglang_version) -> None:
    """Print the SGLang launch command (with the plugin's environment) for a run."""
    from engines.sglang_launch import launch_command
    from harvest.config import ConfigError

    try:
        n, points = _capture_points(model_path, num_layers, run, redis_url, layers)
        click.echo(launch_command(model_path, points, n, dump_dir=dump_dir, tp_size=tp_size, port=port,
                                  chunked_prefill_size=chunked_prefill_size, sglang_version=sglang_version))
    except (ConfigError, ValueError) as e:
        _fail(str(e))


@main.command("vllm-args")
@click.option("--model", "model_path", required=True, help="Model path as the vLLM server will see it.")
@click.option("--layers", default="eagle3", show_default=True, help="'eagle3' or HF hidden_states indices.")
@click.option("--num-layers", default=None, type=click.IntRange(1), help="Decoder layers (default: read MODEL/config.json).")
@click.option("--run", "run", default=None, help="Take the capture points from this run in Redis instead of --layers.")
@redis_option
@click.option("--dump-dir", default="/dev/shm/harvest", show_default=True, help="The workers' dump dir; vLLM writes into DUMP_DIR/.vllm.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--dtype", default="auto", show_default=True, help="vLLM --dtype (float32 for exact CPU comparisons).")
@click.option("--kvcache-gib", default=1, show_default=True, type=click.IntRange(1), help="VLLM_CPU_KVCACHE_SPACE.")
@click.option("--python", "python", default=None, help="The vLLM venv's python (default: HARVEST_VLLM_VENV's, else 'python').")
@click.option("--enforce-eager", is_flag=True, help="Skip torch.compile (faster start; what `harvest run --engine vllm` uses).")
def vllm_args_cmd(model_path, layers, num_layers, run, redis_url, dump_dir, port, dtype, kvcache_gib, python,
                  enforce_eager) -> None:
    """Print the vLLM server command (connector, capture layers, environment) for a run."""
    from engines.vllm_launch import launch_command, venv_python
    from harvest.config import ConfigError

    try:
        n, points = _capture_points(model_path, num_layers, run, redis_url, layers)
        if python is None:
            try:
                python = venv_python()
            except FileNotFoundError:
                python = "python"
        click.echo(launch_command(model_path, points, n, dump_dir=dump_dir, port=port, python=python, dtype=dtype,
                                  kvcache_gib=kvcache_gib, enforce_eager=enforce_eager))
    except (ConfigError, ValueError) as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
