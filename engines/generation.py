"""The reference engine's generation rules: SGLang's `/generate` sampling_params, checked as
SGLang checks them, and one sampling step.

SGLang 0.5.23 (srt/sampling/sampling_params.py) is the model: the same names and defaults
(`temperature` 1.0, `top_p` 1.0, the seed `sampling_seed`), greedy below a temperature of 1e-6,
top-p keeping the smallest set of most likely tokens whose mass reaches top_p, and the same
HTTP 400s (a negative temperature, top_p outside (0, 1], a prompt of at least the model's
context, or prompt + max_new_tokens past it: tokenizer_manager's `_validate_one_request`): each
is a ValueError here, which the reference engine answers as a `BadRequest`.
Unlike SGLang, the seed is always honoured (SGLang uses it only under
`--enable-deterministic-inference`), and a request without one gets a fresh random seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harvest.state.conversation import GEN_RID_PREFIX  # harvest's generation requests: never dumped

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature samples greedily


@dataclass(frozen=True)
class Sampling:
    """One generation request's sampling_params, SGLang's names and defaults."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # sampling_seed; None: a fresh random seed
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


def max_new_tokens(sp: dict) -> int:
    """A sampling_params' max_new_tokens; 1 when absent (this engine's extraction default)."""
    v = sp.get("max_new_tokens", 1)
    if v is None:
        return 1
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ValueError(f"sampling_params.max_new_tokens must be an integer, got {v!r}")
    return int(v)


def parse_sampling(
    body: dict, rids: list[str], prompts: list[list[int]], vocab_size: int, context: int
) -> list[Sampling] | None:
    """Each request's `Sampling` when the body asks for generation (an `hg-` rid, or
    max_new_tokens > 1), else None (extraction: one greedy token). `context`: the model's
    max_position_embeddings (0: unknown, unchecked)."""
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts) or not all(isinstance(x, dict) for x in sps):
        raise ValueError(f"'sampling_params' must be one object, or one per prompt ({len(prompts)} prompts)")
    if not any(r.startswith(GEN_RID_PREFIX) for r in rids) and all(max_new_tokens(x) <= 1 for x in sps):
        return None
    out = []
    for i, (x, p) in enumerate(zip(sps, prompts, strict=False)):
        s = sampling(x)
        if context and len(p) >= context:
            raise ValueError(f"input_ids[{i}]: prompt of {len(p)} tokens reaches the model's context of {context}")
        if context and len(p) + s.max_new_tokens > context:
            raise ValueError(
                f"input_ids[{i}]: prompt of {len(p)} tokens + max_new_tokens {s.max_new_tokens} "
                f"exceeds the model's context of {context}"
            )
        bad = [t for t in s.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})")
        out.append(s)
    return out


def sampling(sp: dict) -> Sampling:
    """SGLang's rules for the sampling_params this engine honours (others are ignored)."""
    n = max_new_tokens(sp)
    if n < 1:
        raise ValueError(f"sampling_params.max_new_tokens must be at least 1 to generate, got {n}")

    def number(name: str, default: float) -> float:
        v = sp.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"sampling_params.{name} must be a finite number, got {v!r}")
        return float(v)

    temperature, top_p = number("temperature", 1.0), number("top_p", 1.0)
    if temperature < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"sampling_seed must be an integer in [0, 2**63), got {seed!r}")
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stops!r}")
    flags = {}
    for name, default in (("ignore_eos", False), ("skip_special_tokens", True), ("no_stop_trim", False)):
        v = sp.get(name, default)
        if not isinstance(v, bool):
            raise ValueError(f"sampling_params.{name} must be true or false, got {v!r}")
        flags[name] = v
    return Sampling(n, temperature, top_p, seed, frozenset(stops), **flags)


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """The model's own stop tokens, which SGLang adds to every request's stop_token_ids
    (generation config, model config and tokenizer EOS)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        ids.update([eos] if isinstance(eos, int) else [int(t) for t in eos or ()])
    return ids


def sample(logits: torch.Tensor, sp: Sampling, gen: torch.Generator) -> int:
    """Greedy below GREEDY_BELOW; else logits / temperature, softmax, top-p (the smallest set of
    most likely tokens whose mass reaches top_p, renormalized: SGLang's rule) and
    `torch.multinomial` with the request's generator, so one seed gives one sequence."""
    if sp.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sp.temperature, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        sorted_p[(torch.cumsum(sorted_p, dim=-1) - sorted_p) > sp.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
