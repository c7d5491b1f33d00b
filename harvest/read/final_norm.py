"""The model's final norm, read from the checkpoint's own weights: applied where an engine gives
the state before it, undone where a trainer wants that state.

harvest's capture point L (docs/architecture.md, "Capture points") is the state after the final
norm (the lm_head input, HF's `hidden_states[L]`), whatever the engine. Two places cross that
line, and both use this one reading of the checkpoint:

- the vLLM client (workers/clients/vllm.py): vLLM's aux id L is the last decoder layer's output
  before the norm, so the worker applies the norm, computed the way transformers computes it
  (float32 statistics, cast back to the input dtype, then the weight), so the stored state
  equals an HF forward's;
- the speculators export (harvest/read/speculators.py): speculators' last slot is that pre-norm
  state, and its trainer applies the norm and lm_head itself. `FinalNorm.unapply` gives
  `y / w`, which is `x / rms(x)`: not x, but RMSNorm is scale-invariant (up to eps), so the
  trainer's norm of it is the stored post-norm state again, to a relative 1e-6.

Only RMSNorm families are supported; anything else is refused with a clear error rather than
stored subtly wrong. `(1 + w)` norms (Gemma) and zero weights are refused by `unapply`.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from harvest.errors import InputError

# model_type -> whether the checkpoint stores the norm weight as an offset from 1 (Gemma: x * (1 + w)).
RMSNORM_MODELS: dict[str, bool] = {
    "llama": False,
    "mistral": False,
    "mixtral": False,
    "qwen2": False,
    "qwen2_moe": False,
    "qwen3": False,
    "qwen3_moe": False,
    "granite": False,
    "olmo2": False,
    "phi3": False,
    "deepseek_v3": False,
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
}
# Where checkpoints keep the final norm's weight (plain causal LMs first, then multimodal wrappers).
NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "transformer.norm.weight",
)


class FinalNormError(InputError, ValueError):
    """The checkpoint's final norm cannot be found or is not a supported kind."""


class FinalNorm:
    def __init__(self, weight: torch.Tensor, eps: float, offset: bool = False) -> None:
        self.weight, self.eps, self.offset = weight, float(eps), offset
        self.model_type = "this model"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm of `x [..., H]`, in `x`'s dtype."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma computes the whole product in float32
            return (h * (1.0 + self.weight.to(torch.float32))).to(x.dtype)
        return self.weight.to(x.dtype) * h.to(x.dtype)

    def unapply(self, y: torch.Tensor) -> torch.Tensor:
        """A pre-norm state for the post-norm `y [..., H]`, in float32: `y / w` (= x / rms(x)).
        Refused for `(1 + w)` norms and for a weight with zeros, where it is not the trainer's input."""
        if self.offset:
            raise FinalNormError(
                f"model type {self.model_type!r} scales its final norm by (1 + w): harvest derives the pre-norm state that speculators "
                "reads only for plain RMSNorm (x * w) models; train this model with --format specforge"
            )
        w = self.weight.to(torch.float32)
        zeros = (w == 0).nonzero().flatten().tolist()
        if zeros:
            raise FinalNormError(
                f"the final norm's weight is 0 at {len(zeros)} channels (first {zeros[:4]}): the state before it cannot "
                "be recovered from the one after it; train this model with --format specforge"
            )
        return y.to(torch.float32) / w

    @classmethod
    def from_checkpoint(cls, model_dir: str, fix: str = "set HARVEST_MODEL_DIR to its path on this node") -> FinalNorm:
        """Read the final norm's weight and eps from a local HF checkpoint (config.json + safetensors).
        `fix`: how the caller's user points harvest at the checkpoint, named when it is missing."""
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                cfg = json.load(f)
        except OSError as e:
            raise FinalNormError(
                f"cannot read {model_dir}/config.json ({e.strerror}): the run's checkpoint holds the final norm ({fix})"
            ) from None
        text = cfg.get("text_config") or cfg
        model_type = text.get("model_type") or cfg.get("model_type")
        if model_type not in RMSNORM_MODELS:
            raise FinalNormError(
                f"model type {model_type!r}: harvest applies or undoes the final norm itself (vLLM runs, speculators "
                f"exports) for RMSNorm models only ({', '.join(sorted(RMSNORM_MODELS))}); for vLLM capture L-1 "
                "instead of L or use another engine, for training use --format specforge"
            )
        eps = text.get("rms_norm_eps", cfg.get("rms_norm_eps"))
        if eps is None:
            raise FinalNormError(f"{model_dir}/config.json has no rms_norm_eps")
        norm = cls(_norm_weight(model_dir), float(eps), RMSNORM_MODELS[model_type])
        norm.model_type = model_type
        return norm


def _norm_weight(model_dir: str) -> torch.Tensor:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        for key in NORM_KEYS:
            if key in weight_map:
                with safe_open(os.path.join(model_dir, weight_map[key]), framework="pt") as f:
                    weight: torch.Tensor = f.get_tensor(key)
                    return weight
        raise FinalNormError(f"{index} names none of {NORM_KEYS}")
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            keys = set(f.keys())
            for key in NORM_KEYS:
                if key in keys:
                    weight = f.get_tensor(key)
                    return weight
    raise FinalNormError(f"no safetensors file in {model_dir} holds one of {NORM_KEYS}")
