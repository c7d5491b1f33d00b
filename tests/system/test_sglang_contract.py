"""The names the SGLang plugin relies on, checked against the real SGLang source of every
supported version (the published wheels, read as zip files; nothing is imported or run).

Supported: 0.5.11-0.5.23 through the `sglang.srt.plugins` entry point (the `--forward-hooks` path
for 0.5.10 was removed: it captured the wrong modules on Llama, see docs/architecture.md).
tests/system/test_sglang_live.py runs 0.5.23 itself.
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import zipfile

import pytest

from harvest.engines import sglang_plugin as sp
from tests.support.need import need

PLUGIN_VERSIONS = ["0.5.23", "0.5.18", "0.5.11"]
CACHE = os.environ.get("HARVEST_SGLANG_WHEELS") or os.path.join(
    os.path.expanduser("~"), ".cache", "harvest", "sglang-wheels"
)


def _wheel(version: str) -> zipfile.ZipFile:
    found = glob.glob(os.path.join(CACHE, f"sglang-{version}-*.whl"))
    if not found:
        os.makedirs(CACHE, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_34_x86_64",
            "-d",
            CACHE,
            "-q",
            f"sglang=={version}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        found = glob.glob(os.path.join(CACHE, f"sglang-{version}-*.whl"))
        if not found:
            need(
                f"the sglang {version} wheel",
                f"cannot download it from the package index (offline?): {r.stderr[-300:]}",
            )
    return zipfile.ZipFile(found[0])


class Source:
    def __init__(self, version: str) -> None:
        self.version = version
        self.zip = _wheel(version)
        self.names = set(self.zip.namelist())

    def text(self, path: str) -> str:
        assert path in self.names, f"sglang {self.version}: {path} is gone"
        return self.zip.read(path).decode()

    def module(self, dotted: str) -> ast.Module:
        return ast.parse(self.text(dotted.replace(".", "/") + ".py"))

    def cls(self, dotted_module: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.module(dotted_module)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"sglang {self.version}: class {name} is gone from {dotted_module}")

    def method(self, dotted_module: str, cls: str, name: str) -> ast.FunctionDef:
        for node in self.cls(dotted_module, cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"sglang {self.version}: {cls}.{name} is gone from {dotted_module}")

    def fields(self, dotted_module: str, cls: str) -> set[str]:
        """Annotated fields of a class and of its bases defined in the same module."""
        node = self.cls(dotted_module, cls)
        out = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for base in node.bases:
            if isinstance(base, ast.Name):
                try:
                    out |= self.fields(dotted_module, base.id)
                except AssertionError:
                    pass  # a base from another module
        return out

    def grep(self, needle: str, under: str = "sglang/srt/") -> bool:
        return any(
            needle in self.zip.read(n).decode(errors="ignore")
            for n in self.names
            if n.startswith(under) and n.endswith(".py")
        )


@pytest.fixture(scope="module", params=PLUGIN_VERSIONS)
def src(request) -> Source:
    return Source(request.param)


def _split(target: str) -> tuple[str, str, str]:
    mod, cls, meth = target.rsplit(".", 2)
    return mod, cls, meth


def test_logits_processor_forward_takes_the_batch_and_aux_states(src):
    mod, cls, meth = _split(sp.LOGITS_FORWARD)
    args = [a.arg for a in src.method(mod, cls, meth).args.args]
    assert args[:6] == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"], args


def test_forward_batch_fields(src):
    fields = src.fields("sglang.srt.model_executor.forward_batch_info", "ForwardBatch")
    assert {"rids", "forward_mode", "input_ids", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"} <= fields
    for m in ("is_extend", "is_decode", "is_target_verify"):
        src.method("sglang.srt.model_executor.forward_batch_info", "ForwardMode", m)


def test_models_expose_eagle3_capture(src):
    for model, cls in [
        ("llama", "LlamaForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("deepseek_v2", "DeepseekV2ForCausalLM"),
    ]:
        src.method(f"sglang.srt.models.{model}", cls, "set_eagle3_layers_to_capture")
    llama = src.text("sglang/srt/models/llama.py")
    assert "layers_to_capture" in llama and "capture_aux_hidden_states" in llama


def test_generate_request_fields(src):
    fields = src.fields("sglang.srt.managers.io_struct", "GenerateReqInput")
    assert {"rid", "input_ids", "sampling_params", "extra_key"} <= fields


def test_server_flags_the_launch_command_uses(src):
    for flag in ("disable_radix_cache", "chunked_prefill_size", "skip_server_warmup", "tp_size"):
        assert src.grep(flag), f"sglang {src.version}: server arg {flag} is gone"
    graph_flag = "disable_prefill_cuda_graph" if src.version >= "0.5.14" else "disable_piecewise_cuda_graph"
    assert src.grep(graph_flag), f"sglang {src.version}: {graph_flag} is gone"
    if src.version >= "0.5.23":  # the plugin reads the resolved cuda_graph_config['prefill'].backend
        text = src.text("sglang/srt/model_executor/cuda_graph_config.py")
        assert "def __getitem__" in text and 'DISABLED = "disabled"' in text and "prefill: PhaseConfig" in text


def test_model_runner_load_model_and_layer_count(src):
    mod, cls, meth = _split(sp.LOAD_MODEL)
    src.method(mod, cls, meth)
    assert "num_hidden_layers" in src.text("sglang/srt/configs/model_config.py")


def test_plugin_framework_and_hook_types(src):
    assert "sglang.srt.plugins" in src.text("sglang/srt/plugins/__init__.py")
    src.method("sglang.srt.plugins.hook_registry", "HookRegistry", "register")
    members = {
        t.id
        for n in src.cls("sglang.srt.plugins.hook_registry", "HookType").body
        if isinstance(n, ast.Assign)
        for t in n.targets
    }
    assert {"AFTER", "AROUND"} <= members
    assert "SGLANG_PLUGINS" in src.text("sglang/srt/environ.py")


def test_tp_rank_is_reachable(src):
    if "sglang/srt/runtime_context.py" in src.names:
        assert "def get_parallel" in src.text("sglang/srt/runtime_context.py")
    else:
        assert "def get_tensor_model_parallel_rank" in src.text("sglang/srt/distributed/parallel_state.py")
