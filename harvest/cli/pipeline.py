"""The commands that run the whole pipeline on this machine: `run` and `demo`. The services a
fleet runs apart are harvest.cli.services."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import click

from harvest.cli.checks import check_dataset, check_model, check_output
from harvest.cli.errors import connect, redis_wait_option
from harvest.cli.options import (
    apply_s3_env,
    chunked_prefill_option,
    codec_option,
    dp_option,
    dtype_option,
    layers_option,
    max_queued_option,
    no_progress_option,
    producer_kwargs,
    producer_options,
    regenerate_options,
    regenerate_settings,
    run_engine_option,
    s3_endpoint_option,
    s3_region_option,
    spool_grace_option,
    tp_option,
)
from harvest.settings import (
    ProducerSettings,
    RunnerSettings,
    RunTunables,
)


def _default_run_name(dataset: str) -> str:
    from harvest.ids import safe_id

    return safe_id(os.path.basename(dataset.rstrip("/")).split(".")[0], "run", limit=200)


@click.command("run")
@click.argument("dataset", type=click.Path())
@click.option("--model", required=True, type=click.Path(), help="Local HF model directory.")
@click.option("--out", "out_url", required=True, help="Output folder or fsspec URL (file://, s3://).")
@click.option("--run", "run", default=None, help="Run name; defaults to the dataset's file name.")
@layers_option
@dtype_option
@codec_option
@click.option(
    "--workers",
    default=RunnerSettings.workers,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Workers per engine: with 2, one batch is in the engine while the other worker spools.",
)
@click.option("--redis", "redis_url", default=None, help="Use this Redis instead of starting a private one.")
@click.option("--engine-url", default=None, help="Use this engine instead of starting the reference engine.")
@run_engine_option
@tp_option
@dp_option
@chunked_prefill_option
@click.option(
    "--work-dir",
    default=None,
    type=click.Path(),
    help="Node-local state (Redis data, spool, logs); one runner at a time "
    "[default: $HARVEST_WORK/RUN, else ~/.cache/harvest/work/RUN].",
)
@click.option("--dump-dir", default=None, type=click.Path(), help="Engine dump directory (default under /dev/shm).")
@max_queued_option
@click.option(
    "--shard-mb",
    default=RunTunables.shard_bytes >> 20,
    show_default=True,
    type=click.IntRange(1),
    help="Target shard size in MiB.",
)
@click.option(
    "--max-wait",
    default=RunnerSettings.max_wait_s,
    show_default=True,
    type=click.FloatRange(0),
    help="Commit a partial shard once its oldest sample is this old (s).",
)
@producer_options
@regenerate_options
@no_progress_option
@spool_grace_option
@s3_endpoint_option
@s3_region_option
@redis_wait_option
@click.option(
    "--min-free-mb",
    "min_free_mb",
    default=RunnerSettings.min_free_bytes >> 20,
    show_default=True,
    type=click.IntRange(0),
    help="Pause the workers while the work dir's filesystem has less free space (spool, Redis's "
    "append-only file); they go on once there is room again. 0: never pause.",
)
@click.option(
    "--prune",
    is_flag=True,
    help="Drop the run's queued samples that DATASET no longer holds (rows edited or removed since they "
    "were enqueued) instead of extracting them; committed samples are never deleted.",
)
def run_cmd(
    dataset: str,
    model: str,
    out_url: str,
    run: str | None,
    layers: str,
    storage_dtype: str,
    codec: str,
    workers: int,
    redis_url: str | None,
    engine_url: str | None,
    chunked_prefill_size: int,
    work_dir: str | None,
    dump_dir: str | None,
    max_queued: int,
    shard_mb: int,
    no_progress: bool,
    spool_grace: float,
    s3_endpoint: str | None,
    s3_region: str | None,
    engine: str,
    max_wait: float,
    batch_samples: int | None,
    batch_tokens: int | None,
    fields: tuple[str, ...],
    chat_template: str | None,
    max_len: int | None,
    overlong: str,
    strict: bool,
    processes: int,
    regenerate: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    on_length: str,
    redis_wait: float | None,
    min_free_mb: int,
    prune: bool,
    tp_size: int,
    dp_size: int,
) -> None:
    """Extract hidden states for DATASET end to end on this machine.

    The node's engines: the reference engine, or SGLang or vLLM servers from this Python environment
    (or HARVEST_SGLANG_VENV / HARVEST_VLLM_VENV) with harvest's plugin, --dp of them on --tp GPUs each
    (the CPU engine where no GPU is visible); --workers workers per engine.

    Redis going away is waited out, up to --redis-wait (its private redis-server is restarted on
    the same port with its data). Exit status: 0 when every sample of DATASET is committed or
    failed with a reason, 1 when samples failed or rows were bad (the summary says how many), 2 on
    errors, 75 when the run is unfinished (Redis stayed away past --redis-wait, or samples of
    DATASET are neither committed nor failed: the summary says how many), 130 when interrupted
    (Ctrl-C, SIGTERM); after 75 or 130 the same command resumes.
    """
    apply_s3_env(s3_endpoint, s3_region)  # before any child starts: the collector inherits it
    check_dataset(dataset)
    check_model(model, local_only=engine == "reference" and not engine_url)
    check_output(out_url)
    if redis_url:
        connect(redis_url)  # reached before run.json is written
    produce_kw = producer_kwargs(fields, chat_template, max_len, overlong, strict, processes)
    sizes = {k: v for k, v in (("max_batch_samples", batch_samples), ("max_batch_tokens", batch_tokens)) if v}
    settings = RunnerSettings(
        workers=workers,
        redis_url=redis_url,
        engine_url=engine_url,
        work_dir=work_dir,
        dump_dir=dump_dir,
        chunked_prefill_size=chunked_prefill_size,
        max_queued=max_queued,
        max_wait_s=max_wait,
        progress=not no_progress,
        outage_s=redis_wait,
        min_free_bytes=min_free_mb << 20,
        prune=prune,
        tp_size=tp_size,
        dp_size=dp_size,
    )
    _run_here(
        dataset,
        settings,
        produce_kw,
        run=run or _default_run_name(dataset),
        model=model,
        out_url=out_url,
        layers=layers,
        storage_dtype=storage_dtype,
        codec=codec,
        engine=engine,
        shard_bytes=shard_mb << 20,
        spool_grace_s=spool_grace,
        regenerate=regenerate_settings(regenerate, max_new_tokens, temperature, top_p, on_length, model),
        **sizes,
    )


def _run_here(dataset: str, settings: RunnerSettings, produce_kw: dict[str, Any], **config: Any) -> None:
    """The run `harvest.config.build_config(**config)`, on this machine (harvest.cli.runner); prints
    its summary and exits with its status (`run`'s exit statuses)."""
    import dataclasses

    from harvest.cli.runner import run_all
    from harvest.cli.workdir import default_work_dir
    from harvest.config import build_config

    cfg = build_config(**config)  # every check of the configuration before anything is written
    work = os.path.abspath(settings.work_dir or default_work_dir(config["run"]))
    settings = dataclasses.replace(settings, work_dir=work)
    # SIGTERM stops the run as Ctrl-C does: the children are stopped in order (harvest.cli.runner),
    # and the next `harvest run` resumes from the ledger and the spool.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        summary = run_all(cfg, dataset, settings, produce_kw)
    except KeyboardInterrupt:
        import shlex

        where = f"--work-dir {shlex.quote(work)}" if settings.redis_url is None else "--redis URL"
        click.echo(
            "harvest: interrupted: the run's processes are stopped; run the same command again to resume "
            f"(where it stands: harvest status --run {config['run']} {where})",
            err=True,
        )
        sys.exit(130)
    for line in summary.lines():
        click.echo(line)
    sys.exit(summary.exit_status)


@click.command("demo")
@click.option(
    "--out",
    "out_dir",
    default="harvest-demo",
    show_default=True,
    type=click.Path(),
    help="Folder the demo writes its run (shards and index) and its export into.",
)
@click.option(
    "--workers",
    default=RunnerSettings.workers,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Worker processes against the demo's engine.",
)
@click.option(
    "--regenerate",
    is_flag=True,
    help="Have the tiny model write the demo chats' answers first (the regeneration stage, greedy, at most "
    "32 tokens a turn), then extract them; the conversations land in OUT/output/demo-regenerate/generated/.",
)
@click.option(
    "--prepare",
    "prepare_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Only write the tiny model to DIR/models/tiny and the dataset to DIR/data/demo.jsonl (what the "
    "docker compose quickstart mounts), then exit.",
)
def demo_cmd(out_dir: str, workers: int, regenerate: bool, prepare_dir: str | None) -> None:
    """Build a tiny model offline and run the whole pipeline on a bundled dataset."""
    from harvest.cli.demo import (
        DEMO_CHUNKED_PREFILL,
        DEMO_MAX_NEW_TOKENS,
        build_tiny_model,
        demo_chats,
        demo_rows,
        write_jsonl,
    )

    if prepare_dir:
        model = build_tiny_model(os.path.join(prepare_dir, "models", "tiny"))
        dataset = write_jsonl(os.path.join(prepare_dir, "data", "demo.jsonl"), demo_rows())
        click.echo(f"model: {model}\ndataset: {dataset}")
        return
    click.echo("building the tiny demo model (cached after the first time)...")
    model = build_tiny_model()
    dataset = write_jsonl(
        os.path.join(out_dir, "demo-chats.jsonl" if regenerate else "demo.jsonl"),
        demo_chats() if regenerate else demo_rows(),
    )
    out_url = os.path.join(out_dir, "output")
    check_dataset(dataset)
    check_model(model)
    check_output(out_url)
    settings = RunnerSettings(
        workers=workers, chunked_prefill_size=DEMO_CHUNKED_PREFILL, work_dir=os.path.join(out_dir, "work")
    )
    produce_kw = producer_kwargs((), None, None, ProducerSettings.overlong, False, ProducerSettings.processes)
    regen = regenerate_settings(regenerate, DEMO_MAX_NEW_TOKENS, 0.0, 1.0, "keep", model)
    _run_here(
        dataset,
        settings,
        produce_kw,
        run="demo-regenerate" if regenerate else "demo",
        model=model,
        out_url=out_url,
        regenerate=regen,
    )


COMMANDS = (run_cmd, demo_cmd)
