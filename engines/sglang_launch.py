"""The exact SGLang server command a run needs, so an operator never guesses a flag.

The capture points come from the run (harvest.config); the flags turn off what would defeat the
dump plugin (prefill CUDA graphs bypass Python hooks; a prefix-cache hit skips tokens) and
set the chunk size. Flag spellings follow the SGLang version (checked against its source by
tests/system/test_sglang_contract.py). The plugin is loaded through SGLang's plugin framework
(`SGLANG_PLUGINS=harvest`, 0.5.11 and newer); older versions are not supported.

`device="cpu"` is the form CI runs (tests/system/test_sglang_live.py): SGLang's CPU engine
from its own venv (scripts/sglang_venv.sh), the torch-native attention backend (the x86
default, intel_amx, needs kernels the venv does not have) and a KV pool sized by
`max_total_tokens` (unsized, SGLang reserves most of the machine's memory and starts slowly).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import Any

from harvest.engines.sglang_plugin import ENV_CAPTURE, ENV_DUMP_DIR, ENV_FINGERPRINT, ENV_MODEL
from harvest.engines.venvs import EngineVenv
from harvest.errors import ConfigurationError
from harvest.settings import EngineSettings

SUPPORTED = ("0.5.11", "0.5.23")  # the oldest with the plugin framework, the newest checked live
ENV_VENV = "HARVEST_SGLANG_VENV"
DEVICES = ("cuda", "cpu")
# The test-only stand-in for SGLang's CPU kernels (PyPI has no CPU sgl-kernel), relative to the repo:
# what a CPU server needs on its path besides the repo itself.
STANDIN_DIR = os.path.join("tests", "support", "sgl_kernel_standin")


def cpu_pythonpath(repo: str) -> str:
    """PYTHONPATH for a CPU server: checkout `repo`'s plugin and kernel stand-in, whichever
    checkout the venv was built from."""
    return os.pathsep.join([repo, os.path.join(repo, STANDIN_DIR)])


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


VENV = EngineVenv("SGLang", ENV_VENV, "sglang-venv", "scripts/sglang_venv.sh", "about 1-2 minutes, 2.7 GB")
default_venv = VENV.default
venv_python = VENV.python


def launch_spec(
    model_path: str,
    capture_points: Sequence[int],
    num_layers: int,
    dump_dir: str,
    tp_size: int = EngineSettings.tp_size,
    port: int = EngineSettings.port,
    host: str = "127.0.0.1",
    chunked_prefill_size: int = EngineSettings.sglang_chunked_prefill_size,
    sglang_version: str = EngineSettings.sglang_version,
    skip_warmup: bool = True,
    device: str = EngineSettings.device,
    python: str = "python",
    dtype: str = EngineSettings.dtype,
    max_total_tokens: int | None = None,
    extra_args: Sequence[str] = (),
    fingerprint: str | None = None,
) -> tuple[dict[str, str], list[str]]:
    """The environment and argv of an SGLang server that dumps the given capture points
    (HF hidden_states indices in [0, num_layers]; the plugin refuses others only once loaded).
    `fingerprint`: the run's model digest, which the plugin checks the loaded checkpoint against."""
    v = _version(sglang_version)
    bad = [p for p in capture_points if not 0 <= int(p) <= num_layers]
    if bad or not capture_points:
        raise ConfigurationError(
            f"capture points {list(capture_points)} must be non-empty and lie in [0, {num_layers}]"
        )
    if v < _version(SUPPORTED[0]):
        raise ConfigurationError(
            f"SGLang {sglang_version} is not supported: the plugin needs SGLang's plugin framework "
            f"({SUPPORTED[0]} or newer)"
        )
    if device not in DEVICES:
        raise ConfigurationError(f"device {device!r}: choose one of {', '.join(DEVICES)}")
    env = {
        "SGLANG_PLUGINS": "harvest",
        ENV_DUMP_DIR: dump_dir,
        ENV_CAPTURE: ",".join(str(p) for p in capture_points),
        ENV_MODEL: os.path.basename(model_path.rstrip("/")),
    }
    if fingerprint:
        env[ENV_FINGERPRINT] = fingerprint
    args = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--tp-size",
        str(tp_size),
        "--host",
        host,
        "--port",
        str(port),
        "--trust-remote-code",
        "--disable-radix-cache",
        "--chunked-prefill-size",
        str(chunked_prefill_size),
    ]
    args.append("--disable-prefill-cuda-graph" if v >= (0, 5, 14) else "--disable-piecewise-cuda-graph")
    if skip_warmup:
        args.append("--skip-server-warmup")
    if dtype != "auto":
        args += ["--dtype", dtype]
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        args += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--max-total-tokens",
            str(max_total_tokens or 16384),
        ]
    elif max_total_tokens:
        args += ["--max-total-tokens", str(max_total_tokens)]
    args += list(extra_args)
    return env, args


def launch_command(model_path: str, capture_points: Sequence[int], num_layers: int, **kwargs: Any) -> str:
    """`launch_spec` as one shell command line, for the README and `harvest sglang-args`."""
    env, args = launch_spec(model_path, capture_points, num_layers, **kwargs)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return prefix + " \\\n  " + " ".join(shlex.quote(a) for a in args)
