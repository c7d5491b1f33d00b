"""Which engine client a worker uses: chosen by the run's `engine` kind, so every worker of a run
talks to its engine the same way (the kind is part of the run)."""

from __future__ import annotations

from harvest.config import RunConfig
from harvest.workers.clients.base import Engine
from harvest.workers.clients.sglang import SGLangClient


def make_engine(cfg: RunConfig, engine_url: str, dump_dir: str) -> Engine:
    """SGLang's `/generate` (also the reference engine's) unless the run says vLLM."""
    if cfg.engine == "vllm":
        from harvest.workers.clients.vllm import VllmClient

        return VllmClient(engine_url, cfg, dump_dir)
    return SGLangClient(engine_url)
