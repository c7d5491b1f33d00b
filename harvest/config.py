"""The run: what every node of one extraction must agree on.

A run fixes model, capture points, storage dtype and output; it is written to Redis when the
run starts and copied to `<out>/<run>/run.json`. Workers and collectors read it from there,
never from their own flags, so two nodes can never capture different layers into one run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from harvest.errors import ConfigurationError
from harvest.formats.codec import CODECS, NONE
from harvest.formats.dtypes import STORAGE_DTYPES, storage_torch_dtype
from harvest.ids import check_id
from harvest.regeneration import Regeneration
from harvest.settings import IdentityDefaults, RunTunables

if TYPE_CHECKING:
    import torch

# The engine kinds a run may name; workers pick their client by it (harvest.workers.clients).
ENGINE_KINDS = ("reference", "sglang", "vllm")
# What capture point L holds in every run, whatever the engine: HF's `hidden_states[L]`, the state
# after the model's final norm (the lm_head input). SGLang hands that state over; the vLLM client
# applies the norm to vLLM's pre-norm id L; the speculators export, whose trainer wants the state
# before the norm, derives it (harvest.read.final_norm). Recorded in run.json and in every index.
FINAL_POST_NORM = "post-norm"
FINAL_STATES = (FINAL_POST_NORM,)


# The name harvest.read promises trainers (harvest.read.__all__), and harvest.read and
# harvest.formats import: one class with harvest.errors.ConfigurationError.
ConfigError = ConfigurationError


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3 preset `[2, L//2, L-3, L]` in HF hidden_states indices (docs/architecture.md, capture points),
    deduplicated and sorted so tiny models with L < 6 still get a valid list."""
    if num_layers < 1:
        raise ConfigurationError(f"model has {num_layers} layers; need at least 1")
    pts = {min(2, num_layers), num_layers // 2, max(num_layers - 3, 0), num_layers}
    return sorted(pts)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`eagle3`, a comma list of HF hidden_states indices in [0, L], or a draft model's config
    file or model dir (its aux layers and the final state: `draft_layers`)."""
    spec = spec.strip()
    if spec == "eagle3":
        return eagle3_layers(num_layers)
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        return draft_layers(os.path.join(spec, "config.json"), num_layers)
    if spec.endswith(".json") or os.path.isfile(spec):
        return draft_layers(spec, num_layers)
    try:
        pts = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ConfigurationError(
            f"--layers {spec!r}: expected 'eagle3', comma-separated integers like 2,4,7, or a draft model's config.json"
        ) from None
    if not pts:
        raise ConfigurationError("--layers is empty")
    bad = [p for p in pts if p < 0 or p > num_layers]
    if bad:
        raise ConfigurationError(
            f"--layers {bad}: capture points must lie in [0, {num_layers}] for a {num_layers}-layer model"
        )
    return pts


def draft_layers(path: str, num_layers: int) -> list[int]:
    """The capture points a draft model trains on, from its config file: its three aux layers as
    HF indices, then the final state L. Two conventions name those layers:

    - speculators (and vLLM) put `eagle_aux_hidden_state_layer_ids` at the top level, in vLLM's
      ids: id k is the input of decoder layer k, HF index k;
    - SpecForge (and SGLang) put them in `eagle_config`, in SGLang's ids
      (`set_eagle3_layers_to_capture`): id k is the output of layer k, HF index k + 1.

    Without ids both trainers default to HF [2, L//2, L-3] (speculators `[2, L//2, L-3]`,
    SpecForge `[1, L//2-1, L-4]`), so a config naming none gives the `eagle3` preset."""
    where = f"--layers {path}"
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigurationError(f"{where}: cannot read it as a draft model's JSON config ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigurationError(f"{where}: a draft config is a JSON object")
    eagle = doc.get("eagle_config") if isinstance(doc.get("eagle_config"), dict) else {}
    vllm_ids, sglang_ids = doc.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
    found = []
    if vllm_ids is not None:
        found.append(("eagle_aux_hidden_state_layer_ids", _aux_ids(where, vllm_ids, 0)))
    if sglang_ids is not None:
        found.append(("eagle_config.eagle_aux_hidden_state_layer_ids", _aux_ids(where, sglang_ids, 1)))
    if len({tuple(hf) for _, hf in found}) > 1:
        raise ConfigurationError(
            f"{where}: {found[0][0]} {vllm_ids} (vLLM ids) and {found[1][0]} {sglang_ids} (SGLang ids, "
            "+1) name different layers; fix the config or pass the HF indices, e.g. --layers 2,4,5,8"
        )
    if found:
        aux = found[0][1]
    elif _is_eagle3_draft(doc):
        aux = [2, num_layers // 2, num_layers - 3]
    else:
        raise ConfigurationError(
            f"{where}: not an EAGLE-3 draft config (no eagle_aux_hidden_state_layer_ids, "
            "no eagle_config, no Eagle3 architecture)"
        )
    if aux != sorted(aux):
        raise ConfigurationError(
            f"{where}: aux layers {aux} (HF indices) are not ascending; harvest stores them ascending, "
            "the order the draft's fc layer would then read: list them ascending"
        )
    bad = [p for p in aux if not 0 <= p < num_layers]
    if bad or len(set(aux)) != 3:
        raise ConfigurationError(
            f"{where}: aux layers {aux} (HF indices) must be 3 distinct indices in [0, {num_layers}) "
            f"for a {num_layers}-layer model: is it this model's draft?"
        )
    return aux + [num_layers]


def _aux_ids(where: str, ids: object, offset: int) -> list[int]:
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ConfigurationError(f"{where}: aux layer ids {ids!r}: expected a list of three integers")
    return [i + offset for i in ids]


def _is_eagle3_draft(doc: dict) -> bool:
    archs = doc.get("architectures") or []
    return doc.get("speculators_model_type") == "eagle3" or any("eagle3" in str(a).lower() for a in archs)


@dataclass(frozen=True)
class RunIdentity:
    """What every node of a run must agree on: what is stored, and where. Two starts of one run
    name that differ in any of it are refused (harvest.formats.runfile.check_same_run)."""

    run: str
    model: str
    capture_points: list[int]
    hidden_size: int
    out_url: str
    storage_dtype: str = IdentityDefaults.storage_dtype
    engine: str = IdentityDefaults.engine
    tokenizer: str | None = None
    allow_nonfinite: bool = False
    final_state: str = FINAL_POST_NORM  # what capture point L holds (FINAL_POST_NORM)
    # A --regenerate run: the target model writes the chat rows' assistant turns before they are
    # extracted (harvest.regeneration.Regeneration's fields; None: the rows' own answers).
    regenerate: dict | None = None
    # What the model is (harvest.formats.fingerprint.model_fingerprint of a local checkpoint; None:
    # a hub id, known by its name only). Where it records one, it names the model, not `model`'s
    # path: a symlink or a copy is the same run, the same path with other weights is not.
    model_fingerprint: dict | None = None
    # How the hidden states are coded in the shards (harvest.formats.codec). A run.json without it
    # stores them as they are: this default is `none`, whatever a new run's is (IdentityDefaults).
    codec: str = NONE

    def __post_init__(self) -> None:
        check_id(self.run, "run name")
        if self.codec not in CODECS:
            raise ConfigurationError(f"codec {self.codec!r}: choose one of {', '.join(CODECS)}")
        if self.regenerate is not None:
            Regeneration.from_dict(self.regenerate)
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ConfigurationError(f"storage dtype {self.storage_dtype!r}: choose one of {', '.join(STORAGE_DTYPES)}")
        if self.engine not in ENGINE_KINDS:
            raise ConfigurationError(f"engine {self.engine!r}: choose one of {', '.join(ENGINE_KINDS)}")
        if self.final_state not in FINAL_STATES:
            raise ConfigurationError(f"final state {self.final_state!r}: this harvest stores {', '.join(FINAL_STATES)}")
        if list(self.capture_points) != sorted(set(self.capture_points)) or not self.capture_points:
            raise ConfigurationError(f"capture points {self.capture_points} must be a non-empty ascending list")


@dataclass(frozen=True)
class RunConfig(RunTunables, RunIdentity):
    """The run: its identity (RunIdentity), its tunables (harvest.settings.RunTunables) and what
    follows from the model. One flat JSON object in run.json and in Redis."""

    num_layers: int = 0  # the model's decoder layers (0: not known, in a RunConfig built without its model)
    # The engine's version (SGLang's or vLLM's) where the first start knew it: workers warn when their
    # engine reports another one, and do not refuse (see harvest.node.modelcheck).
    engine_version: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        RunIdentity.__post_init__(self)
        if not self.spool_grace_s > 0:
            raise ConfigurationError(f"spool grace {self.spool_grace_s!r}: must be a positive number of seconds")

    @property
    def regeneration(self) -> Regeneration | None:
        return None if self.regenerate is None else Regeneration.from_dict(self.regenerate)

    @property
    def torch_dtype(self) -> torch.dtype:
        return storage_torch_dtype(self.storage_dtype)

    @property
    def final_point(self) -> int | None:
        """The capture point holding the final (post-norm) hidden state, if the run captured it.
        A run that does not know its layer count follows the EAGLE-3 preset, which ends at L."""
        last = self.capture_points[-1]
        return last if self.num_layers in (0, last) else None

    def slots(self) -> list[str]:
        """What each slot of the capture axis holds: `input:i` (the residual stream entering decoder
        layer i, HF `hidden_states[i]`) or `final:post-norm` (HF `hidden_states[L]`)."""
        return [f"final:{self.final_state}" if p == self.final_point else f"input:{p}" for p in self.capture_points]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        data = json.loads(text)
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigurationError(f"run config has unknown fields {sorted(unknown)}: written by a newer harvest?")
        return cls(**data)

    def identity(self) -> dict:
        """The fields that change what is stored (RunIdentity's); two runs of one name must agree on
        all of them. `num_layers` follows from the model, so it is no part of them."""
        return {k: v for k, v in asdict(self).items() if k in _IDENTITY}


_IDENTITY = frozenset(f.name for f in fields(RunIdentity))


def build_config(
    run: str,
    model: str,
    out_url: str,
    layers: str = IdentityDefaults.layers,
    storage_dtype: str = IdentityDefaults.storage_dtype,
    engine: str = IdentityDefaults.engine,
    tokenizer: str | None = None,
    codec: str = IdentityDefaults.codec,
    **extra: Any,
) -> RunConfig:
    """A RunConfig from a model directory: its layer count and width come from its config.json.
    A local model, tokenizer and output are stored absolute: run.json is read from other folders
    (`harvest export`) and other nodes, where a path typed relative to one shell means nothing."""
    from harvest.formats.fingerprint import model_fingerprint

    num_layers, hidden_size = _model_shape(model)
    return RunConfig(
        run=run,
        model=absolute_model(model),
        capture_points=parse_layers(layers, num_layers),
        hidden_size=hidden_size,
        out_url=absolute_location(out_url),
        storage_dtype=storage_dtype,
        engine=engine,
        codec=codec,
        tokenizer=absolute_model(tokenizer) if tokenizer else tokenizer,
        model_fingerprint=model_fingerprint(os.path.expanduser(model)),
        num_layers=num_layers,
        engine_version=installed_engine_version(engine),
        **extra,
    )


def installed_engine_version(engine: str) -> str | None:
    """The version of the SGLang or vLLM distribution installed beside harvest (a GPU image ships
    both), read from its metadata without importing it; None for the reference engine, or when
    the engine runs from another environment (harvest run's CPU venvs, another container)."""
    from importlib.metadata import PackageNotFoundError, version

    if engine not in ("sglang", "vllm"):
        return None
    try:
        return version(engine)
    except PackageNotFoundError:
        return None


def absolute_model(model: str) -> str:
    """A model folder on this machine as an absolute path; a hub id (`org/name`) as given."""
    path = os.path.expanduser(model)
    return os.path.abspath(path) if os.path.isdir(path) else model


def absolute_location(url: str) -> str:
    """An output given as a local path (or `file://` one) made absolute; other URLs as given."""
    if url.startswith("file://"):
        path = url[len("file://") :]
        return "file://" + os.path.abspath(os.path.expanduser(path)) if path else url
    if "://" in url:
        return url
    return os.path.abspath(os.path.expanduser(url))


def model_config_json(model: str) -> dict:
    """A local model's config.json, or its `text_config` when that holds the decoder (multimodal
    wrappers). Read as JSON: transformers' AutoConfig imports torch, seconds at every start.
    Raises OSError (no such file) or ValueError (not JSON)."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    text = raw.get("text_config") if isinstance(raw, dict) else None
    return text if isinstance(text, dict) and "num_hidden_layers" in text else raw


# The keys a model config states its context length by, in the order SGLang reads them
# (sglang.srt.configs.model_config.get_context_length): the first one present is the limit.
CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def model_context(model_dir: str) -> tuple[int, str] | None:
    """(context length, where it was read) of the local model in `model_dir`, from its config.json
    as SGLang derives it: the first of CONTEXT_KEYS it states, times its `rope_scaling` factor
    unless that scaling already states its original length (or is llama3's, whose length is stated
    whole). None: no config.json there, or no such key. Past this length an engine refuses a prompt
    (SGLang, vLLM), or computes positions the model never saw (the reference engine)."""
    try:
        c = model_config_json(model_dir)
    except (OSError, ValueError):
        return None
    if not isinstance(c, dict):
        return None
    key = next((k for k in CONTEXT_KEYS if _positive_int(c.get(k))), None)
    if key is None:
        return None
    n, why = c[key], key
    rs = c.get("rope_scaling")
    if (
        isinstance(rs, dict)
        and "original_max_position_embeddings" not in rs
        and (rs.get("rope_type") or rs.get("type")) != "llama3"
    ):
        factor = rs.get("factor")
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
            n, why = int(n * factor), f"{key} {n} x rope_scaling factor {factor:g}"
    return n, why


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def model_layers(model_dir: str) -> int:
    """Decoder layer count from a local checkpoint's config.json (text_config for multimodal wrappers)."""
    path = os.path.join(model_dir, "config.json")
    try:
        n = model_config_json(model_dir).get("num_hidden_layers")
    except OSError as e:
        raise ConfigurationError(f"cannot read {path}: {e.strerror}; pass --num-layers") from None
    except ValueError as e:  # not JSON
        raise ConfigurationError(f"cannot read {path}: {e}; pass --num-layers") from None
    if not isinstance(n, int):
        raise ConfigurationError(f"{path} has no num_hidden_layers; pass --num-layers")
    return n


def _model_shape(model: str) -> tuple[int, int]:
    """(num_hidden_layers, hidden_size) of a local model: from config.json when it names both,
    else transformers resolves the model type's own key names (and says why it cannot)."""
    try:
        c = model_config_json(model)
        if isinstance(c.get("num_hidden_layers"), int) and isinstance(c.get("hidden_size"), int):
            return c["num_hidden_layers"], c["hidden_size"]
    except (OSError, ValueError, AttributeError):
        pass
    from transformers import AutoConfig

    try:
        mc = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigurationError(f"cannot read the model config in {model!r}: {e}") from None
    mc = getattr(mc, "text_config", None) or mc
    return mc.num_hidden_layers, mc.hidden_size
