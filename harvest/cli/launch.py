"""`sglang-args` and `vllm-args`: the engine command, with harvest's plugin or connector and the
run's capture points, for an engine that an operator starts beside the workers."""

from __future__ import annotations

import os

import click

from harvest.cli.options import launch_options
from harvest.settings import EngineSettings


def _capture_points(
    model_path: str, num_layers: int | None, run: str | None, redis_url: str, layers: str
) -> tuple[int, list[int], str | None]:
    """(decoder layers, capture points, the run's model digest) for an engine launch: the run's
    points when named, whose model `model_path` must be (harvest.node.modelcheck). What a user can
    get wrong here (a model config, --layers, the run, the model) raises a ConfigurationError, which the
    CLI tells as one line."""
    from harvest.config import model_layers, parse_layers

    n = num_layers or model_layers(model_path)
    if run:
        from harvest.cli.errors import connect
        from harvest.node.modelcheck import check_model_dir
        from harvest.state.runstore import load_run

        cfg = load_run(connect(redis_url), run)  # a Redis down: told with its URL
        if os.path.isdir(model_path):  # --num-layers given for a checkpoint elsewhere: the plugin checks it
            check_model_dir(cfg, model_path)
        return n, cfg.capture_points, cfg.model_fingerprint["digest"] if cfg.model_fingerprint else None
    return n, parse_layers(layers, n), None


def _dump_dir(dump_dir: str | None, run: str | None) -> str:
    from harvest.node.dumpdir import default_dump_dir

    return dump_dir or default_dump_dir(run)


@click.command("sglang-args")
@launch_options
@click.option(
    "--tp",
    "tp_size",
    default=EngineSettings.tp_size,
    show_default=True,
    type=click.IntRange(1),
    help="Tensor-parallel size (GPUs per server).",
)
@click.option("--port", default=EngineSettings.port, show_default=True, type=int, help="Port the server listens on.")
@click.option(
    "--chunked-prefill-size",
    default=EngineSettings.sglang_chunked_prefill_size,
    show_default=True,
    type=click.IntRange(1),
    help="Tokens per prefill chunk (SGLang's --chunked-prefill-size).",
)
@click.option(
    "--sglang-version",
    default=EngineSettings.sglang_version,
    show_default=True,
    help="Flag spellings differ between versions.",
)
@click.option(
    "--device",
    default=EngineSettings.device,
    show_default=True,
    type=click.Choice(["cuda", "cpu"]),
    help="cpu: SGLang's CPU engine from HARVEST_SGLANG_VENV (scripts/sglang_venv.sh), as CI runs it.",
)
@click.option(
    "--dtype",
    default=EngineSettings.dtype,
    show_default=True,
    help="SGLang --dtype (float32 for exact CPU comparisons).",
)
def sglang_args_cmd(
    model_path: str,
    layers: str,
    num_layers: int | None,
    run: str | None,
    redis_url: str,
    dump_dir: str | None,
    tp_size: int,
    port: int,
    chunked_prefill_size: int,
    sglang_version: str,
    device: str,
    dtype: str,
) -> None:
    """Print the SGLang launch command (with the plugin's environment) for a run."""
    from harvest.engines.sglang_launch import launch_command, venv_python
    from harvest.engines.venvs import VenvMissing

    n, points, digest = _capture_points(model_path, num_layers, run, redis_url, layers)
    python = "python"
    if device == "cpu":
        try:
            python = venv_python()
        except VenvMissing:
            pass
    click.echo(
        launch_command(
            model_path,
            points,
            n,
            dump_dir=_dump_dir(dump_dir, run),
            tp_size=tp_size,
            port=port,
            chunked_prefill_size=chunked_prefill_size,
            sglang_version=sglang_version,
            device=device,
            python=python,
            dtype=dtype,
            fingerprint=digest,
        )
    )


@click.command("vllm-args")
@launch_options
@click.option(
    "--port", default=EngineSettings.vllm_port, show_default=True, type=int, help="Port the server listens on."
)
@click.option(
    "--dtype", default=EngineSettings.dtype, show_default=True, help="vLLM --dtype (float32 for exact CPU comparisons)."
)
@click.option(
    "--kvcache-gib",
    default=EngineSettings.vllm_kvcache_gib,
    show_default=True,
    type=click.IntRange(1),
    help="VLLM_CPU_KVCACHE_SPACE.",
)
@click.option(
    "--python", "python", default=None, help="The vLLM venv's python (default: HARVEST_VLLM_VENV's, else 'python')."
)
@click.option(
    "--enforce-eager", is_flag=True, help="Skip torch.compile (faster start; what `harvest run --engine vllm` uses)."
)
def vllm_args_cmd(
    model_path: str,
    layers: str,
    num_layers: int | None,
    run: str | None,
    redis_url: str,
    dump_dir: str | None,
    port: int,
    dtype: str,
    kvcache_gib: int,
    python: str | None,
    enforce_eager: bool,
) -> None:
    """Print the vLLM server command (connector, capture layers, environment) for a run; vLLM
    writes its files into DUMP_DIR/.vllm."""
    from harvest.engines.venvs import VenvMissing
    from harvest.engines.vllm_launch import launch_command, venv_python

    n, points, _ = _capture_points(model_path, num_layers, run, redis_url, layers)  # vLLM runs no check at load
    if python is None:
        try:
            python = venv_python()
        except VenvMissing:
            python = "python"
    click.echo(
        launch_command(
            model_path,
            points,
            n,
            dump_dir=_dump_dir(dump_dir, run),
            port=port,
            python=python,
            dtype=dtype,
            kvcache_gib=kvcache_gib,
            enforce_eager=enforce_eager,
        )
    )


COMMANDS = (sglang_args_cmd, vllm_args_cmd)
