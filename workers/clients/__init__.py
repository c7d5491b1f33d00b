"""Which engine client a worker uses: chosen by the run's `engine` kind, so every worker of a run
talks to its engine the same way (the kind is part of the run, DESIGN 4.2)."""

from __future__ import annotations

from typing import Protocol

from harvest.config import RunConfig
from workers.clients.sglang import EngineClient, Generated, Rejected


class Engine(Protocol):
    """What workers.job needs of an engine client."""

    url: str

    def health(self) -> bool: ...

    def generate(self, rids: list[str], prompts: list[list[int]]) -> list[Generated | Rejected]: ...

    def close(self) -> None: ...


def make_engine(cfg: RunConfig, engine_url: str, dump_dir: str) -> Engine:
    """SGLang's `/generate` (also the reference engine's) unless the run says vLLM."""
    if cfg.engine == "vllm":
        from workers.clients.vllm import VllmClient

        return VllmClient(engine_url, cfg, dump_dir)
    return EngineClient(engine_url)
