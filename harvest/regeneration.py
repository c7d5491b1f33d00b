"""The regeneration stage's settings: how the target model writes a `--regenerate` run's answers.

They are part of the run's identity (harvest.config.RunIdentity.regenerate): another temperature
or token budget writes other samples, so two starts of one run must agree on them. Workers read
them from the run, never from their own flags, as they read the capture points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harvest.errors import ConfigurationError

ON_LENGTH = ("fail", "keep")  # a turn that hits max_new_tokens: fail the sample, or keep the turn cut short


class RegenerationError(ConfigurationError, ValueError):
    """Regeneration settings that cannot be used."""


@dataclass(frozen=True)
class Regeneration:
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    on_length: str = "fail"
    # The model's context (harvest.config.model_context), when its config states it: a turn whose
    # prompt and max_new_tokens do not fit fails as context-length before the engine is asked.
    context: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RegenerationError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise RegenerationError(f"--temperature must lie in [0, 100], got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RegenerationError(f"--top-p must lie in (0, 1], got {self.top_p!r}")
        if self.on_length not in ON_LENGTH:
            raise RegenerationError(f"--on-length must be one of {', '.join(ON_LENGTH)}, got {self.on_length!r}")
        if self.context is not None and self.context < 1:
            raise RegenerationError(f"context {self.context!r} must be a positive number of tokens")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: object) -> Regeneration:
        if not isinstance(doc, dict):
            raise RegenerationError(f"the run's regenerate settings must be an object, got {doc!r}")
        unknown = set(doc) - set(cls.__dataclass_fields__)
        if unknown:
            raise RegenerationError(f"unknown regenerate settings {sorted(unknown)}: written by a newer harvest?")
        return cls(**doc)
