"""The SGLang server command (engines/sglang_launch.py) and the test-only stand-in for SGLang's
CPU kernels (tests/support/sgl_kernel_standin), checked exactly; tests/system/test_sglang_live.py
runs both in a real SGLang server."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from harvest.engines import sglang_launch as sl
from tests.support.cli import REPO


def test_cpu_form_exactly():
    env, argv = sl.launch_spec(
        "/m/tiny",
        [0, 2, 8],
        8,
        dump_dir="/dev/shm/d",
        port=31000,
        device="cpu",
        python="/venv/bin/python",
        dtype="float32",
        chunked_prefill_size=64,
    )
    assert env == {
        "SGLANG_PLUGINS": "harvest",
        "HARVEST_DUMP_DIR": "/dev/shm/d",
        "HARVEST_CAPTURE": "0,2,8",
        "HARVEST_MODEL_NAME": "tiny",
        "SGLANG_USE_CPU_ENGINE": "1",
    }
    assert argv == [
        "/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m/tiny",
        "--tp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--trust-remote-code",
        "--disable-radix-cache",
        "--chunked-prefill-size",
        "64",
        "--disable-prefill-cuda-graph",
        "--skip-server-warmup",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        "16384",
    ]


def test_a_runs_model_digest_goes_to_the_plugin(tiny_model):
    """`sglang-args --run` passes the run's digest; the plugin refuses another checkpoint at load."""
    from harvest.errors import ConfigurationError
    from harvest.formats.fingerprint import model_fingerprint
    from harvest.node.modelcheck import check_digest

    digest = model_fingerprint(tiny_model)["digest"]
    env, _ = sl.launch_spec(tiny_model, [2, 8], 8, dump_dir="/dev/shm/d", fingerprint=digest)
    assert env["HARVEST_MODEL_FINGERPRINT"] == digest
    assert "HARVEST_MODEL_FINGERPRINT" not in sl.launch_spec(tiny_model, [2, 8], 8, dump_dir="/dev/shm/d")[0]
    check_digest(digest, tiny_model)
    with pytest.raises(
        ConfigurationError, match=f"^{tiny_model} has model fingerprint {digest[:12]}, not the run's 0{{12}} "
    ):
        check_digest("0" * 64, tiny_model)


def test_gpu_form_has_no_cpu_flags_and_older_spelling():
    env, argv = sl.launch_spec("/m/x", [2, 8], 8, dump_dir="/d", sglang_version="0.5.12")
    assert "SGLANG_USE_CPU_ENGINE" not in env and "--device" not in argv and "--dtype" not in argv
    assert "--disable-piecewise-cuda-graph" in argv and "--disable-prefill-cuda-graph" not in argv


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"sglang_version": "0.5.10"},
            "SGLang 0.5.10 is not supported: the plugin needs SGLang's plugin framework (0.5.11 or newer)",
        ),
        ({"device": "tpu"}, "device 'tpu': choose one of cuda, cpu"),
    ],
)
def test_refusals(kwargs, message):
    with pytest.raises(ValueError) as e:
        sl.launch_spec("/m/x", [2, 8], 8, dump_dir="/d", **kwargs)
    assert str(e.value) == message


def test_capture_points_outside_the_model_are_refused():
    with pytest.raises(ValueError, match=r"capture points \[2, 9\] must be non-empty and lie in \[0, 8\]"):
        sl.launch_spec("/m/x", [2, 9], 8, dump_dir="/d")


def test_missing_venv_names_the_build_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="build it with scripts/sglang_venv.sh"):
        sl.venv_python(str(tmp_path / "none"))


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, sl.STANDIN_DIR))
    for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    mod = importlib.import_module("sgl_kernel")
    assert mod.__file__.startswith(os.path.join(REPO, sl.STANDIN_DIR))
    return mod


def test_standin_assigns_each_requests_slice(standin):
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109, dtype=torch.int64)  # 3 + 0 + 6 slots, back to back
    standin.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0, 1]), req_to_token, torch.tensor([4, 3, 0]), torch.tensor([7, 3, 6]), out_cache_loc, 10
    )
    want = torch.zeros(4, 10, dtype=torch.int32)
    want[2, 4:7] = torch.tensor([100, 101, 102])
    want[1, 0:6] = torch.tensor([103, 104, 105, 106, 107, 108])
    assert torch.equal(req_to_token, want)


def test_standin_refuses_every_other_op_and_keeps_amx_off(standin):
    assert "test-only stand-in for SGLang's CPU kernels" in standin.__doc__
    with pytest.raises(
        NotImplementedError, match=r"^sgl_kernel.verify_tree_greedy_cpu: not in harvest's test-only stand-in"
    ):
        standin.verify_tree_greedy_cpu()
    mamba = importlib.import_module("sgl_kernel.mamba")
    with pytest.raises(NotImplementedError, match=r"^sgl_kernel.causal_conv1d_fn_cpu: "):
        mamba.causal_conv1d_fn_cpu(None)
    # SGLang's _is_intel_amx_backend_available() looks for this op; the stand-in never registers it.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
