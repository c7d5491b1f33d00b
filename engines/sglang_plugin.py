"""The harvest dump plugin for SGLang servers.

Loaded in every SGLang process through the `sglang.srt.plugins` entry point (SGLang >= 0.5.11;
select it with `SGLANG_PLUGINS=harvest`). It is inert unless `HARVEST_DUMP_DIR` is set. Configuration is by
environment, printed by `harvest sglang-args`:

- `HARVEST_DUMP_DIR`: where chunk files go (harvest.node.dumpdir)
- `HARVEST_CAPTURE`: the run's capture points as HF hidden_states indices, e.g. 2,16,29,32
- `HARVEST_MODEL_NAME`: written into each file's metadata (optional)
- `HARVEST_MODEL_FINGERPRINT`: the run's model digest (optional; `sglang-args --run` prints it): the
  checkpoint SGLang loaded must have it, or the server stops at load (harvest.node.modelcheck)

Index i < L is the residual stream entering decoder layer i: SGLang's inner model captures it
when i is in `model.layers_to_capture` (what `set_eagle3_layers_to_capture(i - 1)` sets, hence
the +1 of docs/architecture.md, capture points). Index L is the final post-norm state, the logits processor's input.
Per forward, the rows of every `hv-` request are cut with `harvest.engines.batch.cut_batch` (the same
code the reference engine runs) and written by a bounded background `DumpWriter` on TP rank 0.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harvest.engines.batch import cut_batch
from harvest.engines.dump_writer import DumpWriter
from harvest.formats.dump import Chunk
from harvest.ids import RID_PREFIX
from harvest.node.modelcheck import ENV_FINGERPRINT, check_digest
from harvest.node.paths import private_dir

if TYPE_CHECKING:
    from sglang.srt.layers.logits_processor import LogitsMetadata, LogitsProcessor, LogitsProcessorOutput
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

log = logging.getLogger("harvest.sglang_plugin")

ENV_DUMP_DIR, ENV_CAPTURE, ENV_MODEL = "HARVEST_DUMP_DIR", "HARVEST_CAPTURE", "HARVEST_MODEL_NAME"
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
LOGITS_FORWARD = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"


@dataclass(frozen=True)
class PluginConfig:
    dump_dir: str
    capture_points: list[int]
    model_name: str
    fingerprint: str = ""  # the run's model digest, when given: checked at load

    @classmethod
    def from_env(cls) -> PluginConfig | None:
        dump_dir = os.environ.get(ENV_DUMP_DIR)
        if not dump_dir:
            return None
        raw = os.environ.get(ENV_CAPTURE, "")
        try:
            points = sorted({int(x) for x in raw.split(",") if x.strip()})
        except ValueError:
            raise ValueError(f"{ENV_CAPTURE}={raw!r}: expected comma-separated HF hidden_states indices") from None
        if not points:
            raise ValueError(f"{ENV_CAPTURE} is empty: `harvest sglang-args` prints the value for a run")
        return cls(dump_dir, points, os.environ.get(ENV_MODEL, ""), os.environ.get(ENV_FINGERPRINT, ""))


def stack_states(
    hidden_states: torch.Tensor, aux: object, num_aux: int, include_final: bool, rows: int
) -> torch.Tensor:
    """`[rows, K, H]` in capture-point order from SGLang's aux states (a list of `[N, H]`, or one
    packed `[N, K_aux * H]` as DeepSeek returns since 0.5.23) and the final hidden state.
    `rows` trims the padding a static prefill batch may carry."""
    parts: list[torch.Tensor] = []
    if num_aux:
        if isinstance(aux, torch.Tensor):
            parts.extend(aux[:rows].reshape(rows, num_aux, -1).unbind(1))
        elif isinstance(aux, (list, tuple)) and len(aux) == num_aux:
            parts.extend(a[:rows] for a in aux)
        else:
            got = (
                "none"
                if aux is None
                else f"{type(aux).__name__} of {len(aux) if isinstance(aux, (list, tuple)) else '?'}"
            )
            raise ValueError(f"expected {num_aux} aux hidden states, got {got}: is aux capture configured?")
    if include_final:
        parts.append(hidden_states[:rows])
    return torch.stack(parts, dim=1)


def chunks_for_forward(
    forward_batch: ForwardBatch, hidden_states: torch.Tensor, aux: object, num_aux: int, include_final: bool
) -> list[Chunk]:
    """The chunk files of one forward: nothing for decode, speculative verify, or batches
    without an `hv-` request (warmup, health checks, foreign traffic)."""
    mode = forward_batch.forward_mode
    if not mode.is_extend() or (hasattr(mode, "is_target_verify") and mode.is_target_verify()):
        return []
    rids = getattr(forward_batch, "rids", None)
    if not rids or not any(isinstance(r, str) and r.startswith(RID_PREFIX) for r in rids):
        return []
    prefix, seq = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
    if prefix is None or seq is None:
        raise ValueError("forward batch has no extend_prefix_lens_cpu / extend_seq_lens_cpu")
    rows = int(sum(seq))
    states = stack_states(hidden_states, aux, num_aux, include_final, rows)
    return cut_batch(list(rids), list(prefix), list(seq), forward_batch.input_ids[:rows], states)


def _tp_writer() -> bool:
    """Rank 0 of the tensor-parallel group writes (of each attention-DP group, under DP attention).

    Asked once, on the first forward with an `hv-` request, when SGLang has published its
    parallel state. Outside a server (no state published: 0.5.14+ raises ValueError, older
    versions AssertionError) or without SGLang, this process is the only rank and writes."""
    try:
        from sglang.srt.runtime_context import get_parallel  # 0.5.14+

        p = get_parallel()
        if getattr(p, "attn_dp_size", 1) > 1:
            return getattr(p, "attn_tp_rank", 0) == 0
        return p.tp_rank == 0
    except ImportError:
        pass
    except ValueError:  # "config namespace 'parallel' not published"
        return True
    try:
        from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except (ImportError, AssertionError):
        return True


def _unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """Multimodal wrappers (e.g. Kimi-K2.5) hold the causal LM as `language_model`."""
    return getattr(model, "language_model", None) or model


class Capture:
    """Per-process plugin state: what to capture, whether this rank writes, the writer."""

    def __init__(self, cfg: PluginConfig) -> None:
        self.cfg = cfg
        self.num_layers: int | None = None
        self.aux_layers: list[int] = []
        self.include_final = False
        self._writer: DumpWriter | None = None
        self._writes: bool | None = None
        self._warned: set[str] = set()

    def warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("harvest: " + msg, *args)

    def set_layers(self, num_layers: int) -> None:
        bad = [p for p in self.cfg.capture_points if p > num_layers]
        if bad:
            raise ValueError(f"capture points {bad} exceed the model's {num_layers} layers")
        self.num_layers = num_layers
        self.aux_layers = [p for p in self.cfg.capture_points if p < num_layers]
        self.include_final = num_layers in self.cfg.capture_points

    def configure_model(self, model: torch.nn.Module, num_layers: int) -> None:
        """Turn on SGLang's EAGLE-3 aux capture for exactly our layers. The models' setters add
        1 to each id (and DeepSeek's does so only when the first id is 1), so the resulting
        inner list is checked and, if a model disagrees, set directly."""
        self.set_layers(num_layers)
        if not self.aux_layers:
            return
        lm = _unwrap_causal_lm(model)
        if hasattr(lm, "set_eagle3_layers_to_capture"):
            lm.set_eagle3_layers_to_capture([p - 1 for p in self.aux_layers])
        lm.capture_aux_hidden_states = True
        inner = getattr(lm, "model", None)
        if inner is None:
            raise ValueError(f"{type(lm).__name__} has no inner .model to capture layers from")
        if list(getattr(inner, "layers_to_capture", [])) != self.aux_layers:
            inner.layers_to_capture = list(self.aux_layers)
        log.info(
            "harvest: capturing layers %s (+ final: %s) into %s", self.aux_layers, self.include_final, self.cfg.dump_dir
        )

    def writer(self) -> DumpWriter | None:
        if self._writes is None:
            self._writes = _tp_writer()
            log.info(
                "harvest: %s",
                "this rank writes the dumps" if self._writes else "not TP rank 0: this rank writes no dumps",
            )
        if not self._writes:
            return None
        if self._writer is None:
            private_dir(self.cfg.dump_dir, "dump dir")
            self._writer = DumpWriter(self.cfg.dump_dir, self.cfg.capture_points, self.cfg.model_name)
        return self._writer

    def on_logits(self, forward_batch: ForwardBatch | LogitsMetadata, hidden_states: torch.Tensor, aux: object) -> None:
        if self.num_layers is None:
            self.warn_once("unconfigured", "the model was never configured for capture; no dumps will be written")
            return
        if not hasattr(forward_batch, "forward_mode") or not hasattr(forward_batch, "rids"):
            self.warn_once(
                "metadata",
                "the logits processor got %s, not a ForwardBatch with rids; cannot dump",
                type(forward_batch).__name__,
            )
            return
        chunks = chunks_for_forward(forward_batch, hidden_states, aux, len(self.aux_layers), self.include_final)
        if chunks:
            w = self.writer()
            if w is not None:
                w.submit(chunks)


def _prefill_backend(server_args: ServerArgs) -> str | None:
    """The resolved prefill graph backend of 0.5.23+ (`cuda_graph_config['prefill'].backend`,
    which folds in every legacy flag and the platform default: disabled on CPU), else None."""
    cfg = getattr(server_args, "cuda_graph_config", None)
    if cfg is None:
        return None
    try:
        phase = cfg["prefill"]
    except (KeyError, TypeError):
        return None
    backend = phase.get("backend") if isinstance(phase, dict) else getattr(phase, "backend", None)
    return None if backend is None else str(backend)


def prefill_graphs_on(server_args: ServerArgs) -> bool:
    """Whether prefill runs as a CUDA graph, in any supported SGLang version's spelling."""
    sa = server_args
    if getattr(sa, "disable_cuda_graph", False):
        return False
    backend = _prefill_backend(sa)
    if backend is not None:  # 0.5.23+: the resolved config is the truth
        return backend != "disabled"
    if hasattr(sa, "disable_prefill_cuda_graph"):  # 0.5.14-0.5.22: on by default
        return not (sa.disable_prefill_cuda_graph or getattr(sa, "cuda_graph_backend_prefill", None) == "disabled")
    if hasattr(sa, "disable_piecewise_cuda_graph"):  # 0.5.11-0.5.13: piecewise on by default
        return not sa.disable_piecewise_cuda_graph
    return bool(getattr(sa, "enable_piecewise_cuda_graph", False))


def check_server_args(server_args: ServerArgs | None, warn: Callable[[str, str], None]) -> None:
    """Say once, clearly, when the server runs with an option that defeats the plugin."""
    if server_args is None:
        return
    if prefill_graphs_on(server_args):
        warn(
            "prefill-graph",
            "prefill CUDA graphs are on and can bypass the capture hooks: restart with "
            "--disable-prefill-cuda-graph (0.5.14+) or --disable-piecewise-cuda-graph (0.5.11-0.5.13)",
        )
    if getattr(server_args, "enable_dp_attention", False) or (getattr(server_args, "attn_dp_size", 1) or 1) > 1:
        warn(
            "dp-attention",
            "DP attention is on: dumps come from attention-TP rank 0 of each DP group; this mode is untested",
        )


_capture: Capture | None = None


def _after_load_model(result: object, runner: ModelRunner, *args: object, **kwargs: object) -> object:
    """AFTER hook on ModelRunner.load_model: before CUDA graphs are captured."""
    if _capture is None or getattr(runner, "is_draft_worker", False):
        return result
    mc = getattr(runner, "model_config", None)
    if _capture.cfg.fingerprint:  # the run's model, or no server: another checkpoint's states would be committed
        sa = getattr(runner, "server_args", None)
        check_digest(_capture.cfg.fingerprint, getattr(sa, "model_path", None) or getattr(mc, "model_path", ""))
    num_layers = getattr(mc, "num_hidden_layers", None) or mc.hf_text_config.num_hidden_layers
    _capture.configure_model(runner.model, int(num_layers))
    check_server_args(getattr(runner, "server_args", None), _capture.warn_once)
    return result


def _around_logits(
    orig: Callable[..., LogitsProcessorOutput],
    processor: LogitsProcessor,
    input_ids: torch.Tensor,
    hidden_states: torch.Tensor,
    lm_head: VocabParallelEmbedding,
    logits_metadata: LogitsMetadata | ForwardBatch,
    *args: object,
    **kwargs: object,
) -> LogitsProcessorOutput:
    aux = args[0] if args else kwargs.get("aux_hidden_states")
    if _capture is not None:
        _capture.on_logits(logits_metadata, hidden_states, aux)
    return orig(processor, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)


def register() -> None:
    """The `sglang.srt.plugins` entry point: runs once in every SGLang process."""
    global _capture
    cfg = PluginConfig.from_env()
    if cfg is None:
        log.info("harvest plugin installed but %s is unset: inactive", ENV_DUMP_DIR)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _capture = Capture(cfg)
    HookRegistry.register(LOAD_MODEL, _after_load_model, HookType.AFTER)
    HookRegistry.register(LOGITS_FORWARD, _around_logits, HookType.AROUND)
