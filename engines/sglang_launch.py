"""The exact SGLang server command a run needs, so an operator never guesses a flag.

The capture points come from the run (harvest.config); the flags turn off what would defeat the
dump plugin (prefill CUDA graphs bypass Python hooks; a prefix-cache hit skips tokens) and
set the chunk size. Flag spellings follow the SGLang version (checked against its source by
tests/system/test_sglang_contract.py).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence

from engines.sglang_plugin import ENV_CAPTURE, ENV_DUMP_DIR, ENV_MODEL, ENV_NUM_LAYERS, FORWARD_HOOK_TARGETS

SUPPORTED = ("0.5.10", "0.5.23")  # 0.5.10 via --forward-hooks, 0.5.11+ via the plugin entry point


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def launch_spec(
    model_path: str,
    capture_points: Sequence[int],
    num_layers: int,
    dump_dir: str,
    tp_size: int = 1,
    port: int = 30000,
    chunked_prefill_size: int = 8192,
    sglang_version: str = "0.5.23",
    skip_warmup: bool = True,
    extra_args: Sequence[str] = (),
) -> tuple[dict[str, str], list[str]]:
    """The environment and argv of an SGLang server that dumps the given capture points."""
    v = _version(sglang_version)
    if v < _version(SUPPORTED[0]):
        raise ValueError(f"SGLang {sglang_version} is not supported: the plugin needs ForwardBatch.rids (0.5.10 or newer)")
    env = {
        ENV_DUMP_DIR: dump_dir,
        ENV_CAPTURE: ",".join(str(p) for p in capture_points),
        ENV_MODEL: os.path.basename(model_path.rstrip("/")),
    }
    args = ["python", "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(tp_size),
            "--host", "127.0.0.1", "--port", str(port), "--trust-remote-code",
            "--disable-radix-cache", "--chunked-prefill-size", str(chunked_prefill_size)]
    if v >= (0, 5, 14):
        args.append("--disable-prefill-cuda-graph")
    else:
        args.append("--disable-piecewise-cuda-graph")
    if skip_warmup:
        args.append("--skip-server-warmup")
    if v >= (0, 5, 11):
        env = {"SGLANG_PLUGINS": "harvest", **env}
    else:
        spec = [{"name": "harvest", "target_modules": FORWARD_HOOK_TARGETS,
                 "hook_factory": "engines.sglang_plugin:forward_hook_factory",
                 "config": {**env, ENV_NUM_LAYERS: str(num_layers)}}]
        args += ["--forward-hooks", json.dumps(spec, separators=(",", ":"))]
        env = {}
    args += list(extra_args)
    return env, args


def launch_command(model_path: str, capture_points: Sequence[int], num_layers: int, **kwargs) -> str:
    """`launch_spec` as one shell command line, for the README and `harvest sglang-args`."""
    env, args = launch_spec(model_path, capture_points, num_layers, **kwargs)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " \\\n  " if prefix else "") + " ".join(shlex.quote(a) for a in args)
