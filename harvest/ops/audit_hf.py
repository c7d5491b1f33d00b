"""`harvest audit --against hf`: an independent transformers forward of the run's model.

The oracle the test suite compares every engine with (tests/system/test_run_e2e.py and the live
SGLang test), offered to users for models that fit on the machine. Nothing of harvest's
extraction path is in it: no engine, no chunking, no batching, no dump files; one whole-prompt
forward per sample, `output_hidden_states`.

Capture point i < L is HF's `hidden_states[i]`, the very definition of harvest's capture points;
point L is `hidden_states[L]`, the state after the final norm, which is what every run stores
(`RunConfig.final_state` = post-norm: SGLang and the reference engine hand it over, the vLLM
client applies the checkpoint's norm, harvest.read.final_norm). A run that recorded another
convention is refused rather than compared against the wrong state. All L + 1 states are kept for
the comparison, so a capture point taken from the wrong layer is named (harvest.ops.audit_compare).

Compute dtype: float32 for fp32 runs (their bound is near-exact), else bfloat16, what the engines
compute half-precision runs in; `device` as given (a GPU where the model fits).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING

from harvest.config import FINAL_POST_NORM, RunConfig
from harvest.errors import ConfigurationError
from harvest.sample import Sample

if TYPE_CHECKING:
    import torch


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class HFRoute:
    name = "hf"

    def __init__(self, cfg: RunConfig, model_dir: str, device: str | None = None) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        if cfg.final_state != FINAL_POST_NORM:
            raise ConfigurationError(
                f"run {cfg.run} stores its final state {cfg.final_state!r}; the transformers route "
                f"compares {FINAL_POST_NORM} only"
            )
        self.points = list(cfg.capture_points)
        self.device = device or default_device()
        self.dtype = torch.float32 if cfg.storage_dtype == "fp32" else torch.bfloat16
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        except OSError as e:
            raise ConfigurationError(
                f"cannot load the run's model from {model_dir!r} ({e}): pass --model DIR, its "
                "checkpoint on this machine"
            ) from None
        layers = self.model.config.get_text_config().num_hidden_layers
        if cfg.num_layers and layers != cfg.num_layers:
            raise ConfigurationError(
                f"{model_dir} has {layers} layers, run {cfg.run} was extracted from {cfg.num_layers}: "
                "pass --model DIR, the run's checkpoint"
            )
        # lm_head on the last position only, where the model takes it: the logits are not compared
        self._kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        self.detail = (
            f"transformers {transformers.__version__} forward of {model_dir} on {self.device} in "
            f"{str(self.dtype).removeprefix('torch.')}, each sample whole"
        )

    def recompute(self, sample: Sample) -> tuple[torch.Tensor, Mapping[int, torch.Tensor]]:
        import torch

        ids = torch.from_numpy(sample.input_ids.astype("int64")).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            hs = self.model(ids, output_hidden_states=True, **self._kw).hidden_states
        layers = {i: h[0].cpu() for i, h in enumerate(hs)}
        return torch.stack([layers[p] for p in self.points], dim=1), layers
