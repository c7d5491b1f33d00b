"""The CLI's shared options, each declared once, with choices drawn from the core's vocabulary;
and the one way a command fails (a message naming the fix, exit status 2)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from harvest.config import ENGINE_KINDS
from harvest.formats.codec import CODECS
from harvest.formats.dtypes import READ_DTYPES, STORAGE_DTYPES
from harvest.node.dumpdir import default_dump_dir
from harvest.producer.rows import OVERLONG_POLICIES
from harvest.progress import PLAIN_INTERVAL_S
from harvest.regeneration import ON_LENGTH, Regeneration
from harvest.settings import EngineSettings, IdentityDefaults, ProducerSettings, RunTunables

# --redis: the flag, else HARVEST_REDIS_URL (read by click when the command runs, and never shown
# in --help: it may hold a password), else this.
REDIS_ENV = "HARVEST_REDIS_URL"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
# The engines `harvest run` can start itself when no --engine-url is given.
LAUNCHABLE_ENGINES = ("reference", "sglang", "vllm")
F = TypeVar("F", bound=Callable[..., Any])  # a command function, given options by a decorator


def fail(msg: str) -> NoReturn:
    """The one way a command stops on a mistake it found itself: one line naming the fix, exit 2."""
    click.echo(f"harvest: error: {msg}", err=True)
    sys.exit(2)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


def service_logging() -> None:
    """The long-running services (worker, collector, janitor) log at INFO by default: a start
    line, a line per job and per shard, each one line for `docker compose logs`."""
    logging.getLogger("harvest").setLevel(logging.INFO)


def apply_s3_env(endpoint: str | None, region: str | None) -> None:
    """S3 flags override the environment for this process and the ones it starts."""
    if endpoint:
        os.environ["HARVEST_S3_ENDPOINT"] = endpoint
    if region:
        os.environ["HARVEST_S3_REGION"] = region


redis_option = click.option(
    "--redis",
    "redis_url",
    default=LOCAL_REDIS,
    envvar=REDIS_ENV,
    show_envvar=True,
    show_default=True,
    help="Redis URL (password and user go in the URL).",
)
run_option = click.option("--run", "run", required=True, help="Run name ([A-Za-z0-9_-]+).")
layers_option = click.option(
    "--layers",
    default=IdentityDefaults.layers,
    show_default=True,
    help="'eagle3', HF hidden_states indices (e.g. 2,4,7), or a draft model's config.json "
    "(SpecForge's or speculators': its three aux layers and the final state).",
)
dtype_option = click.option(
    "--dtype",
    "storage_dtype",
    default=IdentityDefaults.storage_dtype,
    show_default=True,
    type=click.Choice(list(STORAGE_DTYPES)),
    help="How the hidden states are stored (a new run's setting): fp8_e4m3 keeps a float32 "
    "scale per token and capture point; export converts on request.",
)
codec_option = click.option(
    "--codec",
    default=IdentityDefaults.codec,
    show_default=True,
    type=click.Choice(list(CODECS)),
    help="How the hidden states are stored (a new run's setting): blosc2-zstd codes each sample "
    "losslessly (readers decode it); `harvest ratio` tells what a run saves.",
)
read_dtype_option = click.option(
    "--dtype",
    "dtype",
    default=None,
    type=click.Choice(list(READ_DTYPES)),
    help="Hidden-state dtype of the files (default: bf16 for specforge, which reads "
    "nothing else; the run's for speculators; fp8 runs export bf16).",
)
max_queued_option = click.option(
    "--max-queued",
    default=ProducerSettings.max_queued,
    show_default=True,
    type=click.IntRange(1),
    help="Samples queued or in flight at most; the producer waits while the queue is full.",
)
chunked_prefill_option = click.option(
    "--chunked-prefill-size",
    default=EngineSettings.chunked_prefill_size,
    show_default=True,
    type=click.IntRange(0),
    help="Reference engine chunk size (0: whole prompts).",
)
s3_endpoint_option = click.option(
    "--s3-endpoint",
    default=None,
    help="S3-compatible endpoint URL (MinIO, Ceph...); else HARVEST_S3_ENDPOINT / "
    "AWS_ENDPOINT_URL. Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.",
)
s3_region_option = click.option("--s3-region", default=None, help="S3 region; else AWS_REGION / AWS_DEFAULT_REGION.")
no_progress_option = click.option(
    "--no-progress",
    is_flag=True,
    help=f"Show no progress (else a bar on a terminal, a line every {PLAIN_INTERVAL_S:.0f}s in a log).",
)
node_option = click.option(
    "--node", default=None, help="Node name in heartbeats, spools and `harvest status` (default: host name)."
)
spool_grace_option = click.option(
    "--spool-grace",
    "spool_grace",
    default=RunTunables.spool_grace_s,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds a node's spool may be silent before its samples are reclaimed and "
    "extracted again elsewhere (a new run's setting).",
)


# The producer's options, shared by `harvest produce` and `harvest run`.
batch_samples_option = click.option(
    "--batch-samples",
    default=None,
    type=click.IntRange(1),
    help=f"Samples per job (default: the run's, {RunTunables.max_batch_samples}).",
)
batch_tokens_option = click.option(
    "--batch-tokens",
    default=None,
    type=click.IntRange(1),
    help=f"Tokens per job (default: the run's, {RunTunables.max_batch_tokens}); size it "
    "to keep the engine's prefill budget full.",
)
fields_option = click.option(
    "--field",
    "fields",
    multiple=True,
    metavar="NAME=COLUMN",
    help="Read a field from another column, e.g. text=content (repeatable).",
)
chat_template_option = click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Jinja chat template file (default: the tokenizer's).",
)
max_len_option = click.option(
    "--max-len",
    type=click.IntRange(1),
    default=None,
    help="Longest sample in tokens (default and upper bound: the model's context, "
    "max_position_embeddings in its config.json).",
)
overlong_option = click.option(
    "--overlong",
    type=click.Choice(list(OVERLONG_POLICIES)),
    default=ProducerSettings.overlong,
    show_default=True,
    help="A sample over its limit (--max-len or the model's context): skip it (reported "
    "with its file and line), truncate it to the limit, or fail (stop, exit 2).",
)
strict_option = click.option("--strict", is_flag=True, help="Stop at the first bad row.")
processes_option = click.option(
    "--processes",
    default=ProducerSettings.processes,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Tokenizer processes; pays only with cores beyond those the tokenizer's threads fill.",
)


regenerate_flag = click.option(
    "--regenerate",
    is_flag=True,
    help="Have the target model write the chat rows' assistant turns, turn by turn, before their hidden states are "
    "extracted (on-policy data); the conversations are kept in the run's output (generated/).",
)
max_new_tokens_option = click.option(
    "--max-new-tokens",
    default=Regeneration.max_new_tokens,
    show_default=True,
    type=click.IntRange(1),
    help="With --regenerate: the longest turn, in tokens.",
)
temperature_option = click.option(
    "--temperature",
    default=Regeneration.temperature,
    show_default=True,
    type=click.FloatRange(0, 100),
    help="With --regenerate: sampling temperature (0: greedy); each turn's seed derives "
    "from the sample id, so a rerun samples the same tokens.",
)
top_p_option = click.option(
    "--top-p",
    default=Regeneration.top_p,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="With --regenerate: nucleus sampling's p.",
)
on_length_option = click.option(
    "--on-length",
    type=click.Choice(list(ON_LENGTH)),
    default=Regeneration.on_length,
    show_default=True,
    help="With --regenerate: a turn that reaches --max-new-tokens without ending fails "
    "its sample (reason generation-length), or is kept cut short.",
)


def regenerate_options(f: F) -> F:
    """The regeneration stage's options (`harvest run`, `harvest produce`)."""
    for opt in reversed((regenerate_flag, max_new_tokens_option, temperature_option, top_p_option, on_length_option)):
        f = opt(f)
    return f


def regenerate_settings(
    regenerate: bool, max_new_tokens: int, temperature: float, top_p: float, on_length: str, model: str | None
) -> dict | None:
    """The run's `regenerate` field (harvest.config.RunIdentity), with the model's context when its
    config states it; None without --regenerate."""
    if not regenerate:
        return None
    from harvest.config import model_context

    found = model_context(model) if model else None
    return Regeneration(max_new_tokens, temperature, top_p, on_length, found[0] if found else None).to_dict()


def producer_options(f: F) -> F:
    """Every option of the producer's reading and tokenizing (not its run or Redis options)."""
    for opt in reversed(
        (
            batch_samples_option,
            batch_tokens_option,
            fields_option,
            chat_template_option,
            max_len_option,
            overlong_option,
            strict_option,
            processes_option,
        )
    ):
        f = opt(f)
    return f


def producer_kwargs(
    fields: tuple[str, ...], chat_template: str | None, max_len: int | None, overlong: str, strict: bool, processes: int
) -> dict:
    """`harvest.producer.producer.produce`'s keyword arguments from the shared producer options."""
    from harvest.producer.rowkinds import FieldMap
    from harvest.producer.templates import load_chat_template
    from harvest.producer.tokenize import LengthPolicy

    # A bad --field or length policy is a ConfigurationError, an unreadable --chat-template an OSError on a
    # path the user named: both told by harvest.cli.errors.HarvestGroup.
    return dict(
        fields=FieldMap.parse(fields),
        length=LengthPolicy(max_len, overlong),
        strict=strict,
        chat_template=load_chat_template(chat_template) if chat_template else None,
        processes=processes,
    )


def engine_option(kinds: tuple[str, ...], help: str) -> Callable[[F], F]:
    return click.option(
        "--engine",
        "engine",
        default=IdentityDefaults.engine,
        show_default=True,
        type=click.Choice(list(kinds)),
        help=help,
    )


run_engine_option = engine_option(
    LAUNCHABLE_ENGINES,
    "Engine kind; unless --engine-url, sglang starts an SGLang CPU server from HARVEST_SGLANG_VENV "
    "(scripts/sglang_venv.sh), vllm a vLLM CPU server from HARVEST_VLLM_VENV (scripts/vllm_venv.sh).",
)
produce_engine_option = engine_option(
    ENGINE_KINDS, "Engine kind of a new run; workers pick their client by it (vllm: the vLLM client)."
)


tp_option = click.option(
    "--tp",
    "tp_size",
    default=EngineSettings.tp_size,
    show_default=True,
    type=click.IntRange(1),
    help="Tensor-parallel size of each SGLang/vLLM server started (GPUs per server; on a "
    "machine without GPUs, the CPU engine's processes).",
)
dp_option = click.option(
    "--dp",
    "dp_size",
    default=EngineSettings.dp_size,
    show_default=True,
    type=click.IntRange(1),
    help="Engine servers started, each on its own --tp GPUs and with its own --workers.",
)


def s3_options(f: F) -> F:
    return s3_endpoint_option(s3_region_option(f))


# Engine launch commands (`sglang-args`, `vllm-args`): where the engine will see the model, and
# which capture points it dumps.
launch_model_option = click.option(
    "--model", "model_path", required=True, help="Model path as the engine server will see it."
)
num_layers_option = click.option(
    "--num-layers", default=None, type=click.IntRange(1), help="Decoder layers (default: read MODEL/config.json)."
)
launch_run_option = click.option(
    "--run", "run", default=None, help="Take the capture points from this run in Redis instead of --layers."
)
launch_dump_dir_option = click.option(
    "--dump-dir",
    default=None,
    help=f"The workers' dump dir (default: {default_dump_dir('<run>')}, {default_dump_dir()} without --run).",
)


def launch_options(f: F) -> F:
    for opt in reversed(
        (launch_model_option, layers_option, num_layers_option, launch_run_option, redis_option, launch_dump_dir_option)
    ):
        f = opt(f)
    return f
