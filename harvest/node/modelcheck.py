"""Whether the model a node meets is the run's: a checkpoint folder on this node, or the one an
engine beside the workers serves (harvest.formats.fingerprint).

Who checks what:
- `harvest run` and `harvest produce` compare the checkpoint they were given with the stored run
  (harvest.formats.runfile.check_same_run); `sglang-args`/`vllm-args --run` the one they launch;
- a worker, before its first job, the engine's: the fingerprint the reference engine reports, else
  the folder the engine names (SGLang's `/get_model_info`, vLLM's `/v1/models`) fingerprinted here
  (the worker shares the node, and usually the disk, with its engine); an engine whose folder is not
  on this node is not checked by the worker, and it says so once;
- the SGLang plugin, at load, the folder SGLang loaded, against `HARVEST_MODEL_FINGERPRINT`
  (`sglang-args --run` prints it; vLLM runs no harvest code at load);
- `harvest audit --against hf` the checkpoint it loads.

A run that records no fingerprint (a hub id) is known by its name only: nothing is checked here.
The engine's version is compared with the run's where both are known, and only warned about: an
engine upgrade changes kernels, not the model, so its states differ within the storage dtype's
tolerance (`harvest audit` measures it), and refusing would stop a fleet that upgrades its
engines one node at a time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import httpx

from harvest.config import RunConfig
from harvest.errors import ConfigurationError
from harvest.formats.fingerprint import mismatch_line, model_fingerprint, same_model, short

log = logging.getLogger("harvest.modelcheck")

ENV_FINGERPRINT = "HARVEST_MODEL_FINGERPRINT"  # the run's digest, for the SGLang plugin
RUN_CONFIG = "the run's configuration"


def check_model_dir(cfg: RunConfig, model_dir: str, who: str = "") -> None:
    """Refuse (ConfigurationError, one line naming both fingerprints) unless the local checkpoint
    `model_dir` is the run's model."""
    if cfg.model_fingerprint is None:
        return
    found = model_fingerprint(model_dir)
    if not same_model(cfg.model_fingerprint, found):
        raise ConfigurationError(
            mismatch_line(cfg.run, cfg.model_fingerprint, cfg.model, found, model_dir, RUN_CONFIG, who)
        )


def check_digest(expected: str, model_dir: str) -> None:
    """Refuse (ConfigurationError) unless the checkpoint in `model_dir` has the digest `expected` (the
    run's, as `sglang-args --run` passes it to the plugin)."""
    found = model_fingerprint(model_dir)
    if found is None or found["digest"] != expected:
        raise ConfigurationError(
            f"{model_dir} has model fingerprint {short(found)}, not the run's "
            f"{expected[: len(short(found))]} ({ENV_FINGERPRINT}): another checkpoint, or the same path with other weights; start the "
            "engine on the run's checkpoint, or see `harvest accept-model`"
        )


@dataclass(frozen=True)
class EngineModel:
    path: str | None  # the folder (or hub id) the engine loaded, as it names it
    fingerprint: dict | None  # as the engine reports it (the reference engine), else None
    version: str | None  # SGLang's or vLLM's version, where the engine tells it


def _get(http: httpx.Client, url: str) -> dict:
    try:
        r = http.get(url, timeout=10.0)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def engine_model(url: str, engine: str, http: httpx.Client | None = None) -> EngineModel:
    """What the engine at `url` (of the run's engine kind) says it serves; fields it does not tell are None."""
    own = http is None
    http = http or httpx.Client()
    try:
        if engine == "vllm":
            models = _get(http, f"{url}/v1/models").get("data") or [{}]
            first = models[0] if isinstance(models[0], dict) else {}
            return EngineModel(first.get("root") or first.get("id"), None, _get(http, f"{url}/version").get("version"))
        info = _get(http, f"{url}/get_model_info")
        fp = info.get("model_fingerprint")
        version = _get(http, f"{url}/get_server_info").get("version") if engine == "sglang" else None
        return EngineModel(info.get("model_path"), fp if isinstance(fp, dict) else None, version)
    finally:
        if own:
            http.close()


def check_engine(cfg: RunConfig, url: str) -> None:
    """Refuse (ConfigurationError) an engine serving another model than the run's; say once (a warning)
    when it cannot be checked, and when the engine's version is not the run's."""
    url = url.rstrip("/")
    seen = engine_model(url, cfg.engine)
    if cfg.engine_version and seen.version and seen.version != cfg.engine_version:
        log.warning(
            "the engine at %s is %s %s, the run was started with %s: its states may differ within the "
            "storage dtype's tolerance (`harvest audit` measures it)",
            url,
            cfg.engine,
            seen.version,
            cfg.engine_version,
        )
    if cfg.model_fingerprint is None:
        return
    who = f"the engine at {url} serves"
    if seen.fingerprint is not None:
        if not same_model(cfg.model_fingerprint, seen.fingerprint):
            raise ConfigurationError(
                mismatch_line(
                    cfg.run, cfg.model_fingerprint, cfg.model, seen.fingerprint, seen.path or "?", RUN_CONFIG, who
                )
            )
    elif seen.path and os.path.isdir(seen.path):
        check_model_dir(cfg, seen.path, who)
    else:
        log.warning(
            "cannot check the model of the engine at %s against the run's (fingerprint %s): it names %s, "
            "no folder on this node",
            url,
            short(cfg.model_fingerprint),
            seen.path or "none",
        )
