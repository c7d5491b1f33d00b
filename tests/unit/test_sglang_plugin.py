"""The SGLang dump plugin, driven with real torch tensors laid out as SGLang lays them out.

SGLang's ForwardBatch and ForwardMode are stand-ins here carrying the same fields (rids,
extend_prefix_lens_cpu, extend_seq_lens_cpu, input_ids, forward_mode.is_extend()/is_target_verify());
tests/system/test_sglang_contract.py checks those names against the real SGLang source, and
tests/system/test_sglang_live.py runs the plugin in a real SGLang CPU server and also runs this
file inside SGLang's venv (where `sglang` is importable, the real classes are used below).
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load

from harvest.engines import sglang_plugin as sp
from harvest.ids import rid_for
from harvest.sample import Sample
from harvest.workers.claim import assemble, claim

L, H = 8, 6
POINTS = [2, 4, 5, 8]  # eagle3 for 8 layers: aux 2, 4, 5 and the final post-norm state


class Mode:
    def __init__(self, extend=True, verify=False):
        self.extend, self.verify = extend, verify

    def is_extend(self):
        return self.extend

    def is_target_verify(self):
        return self.verify


def fb(rids, prefix, seq, input_ids, mode=None):
    return SimpleNamespace(
        forward_mode=mode or Mode(),
        rids=rids,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=seq,
        input_ids=input_ids,
    )


def states(rows, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = [torch.randn(rows + pad, H, generator=g) for _ in range(3)]
    final = torch.randn(rows + pad, H, generator=g)
    return aux, final


def capture_for(tmp_path):
    c = sp.Capture(sp.PluginConfig(str(tmp_path), POINTS, "tiny"))
    c.set_layers(L)
    return c


def expected_bytes(rid, start, end, ids, hs):
    """The file written independently: sorted header JSON (with each tensor's crc32), padded so the
    data starts on a 4 KiB block (a worker's kernel copy can then clone it), then the raw tensors."""
    import json
    import struct
    import zlib

    hs_bytes = hs.contiguous().numpy().tobytes()
    ids_bytes = ids.to(torch.int64).numpy().tobytes()
    sums = f'{{"hidden_states":{zlib.crc32(hs_bytes)},"input_ids":{zlib.crc32(ids_bytes)}}}'
    meta = {
        "capture_points": "[2, 4, 5, 8]",
        "crc32": sums,
        "end": str(end),
        "format": "harvest-dump-1",
        "model": "tiny",
        "rid": rid,
        "start": str(start),
    }
    doc = {
        "__metadata__": meta,
        "hidden_states": {"dtype": "F32", "shape": list(hs.shape), "data_offsets": [0, len(hs_bytes)]},
        "input_ids": {
            "dtype": "I64",
            "shape": [len(ids)],
            "data_offsets": [len(hs_bytes), len(hs_bytes) + len(ids_bytes)],
        },
    }
    js = json.dumps(doc, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 4096)
    data = struct.pack("<Q", len(js)) + js + hs_bytes + ids_bytes
    assert torch.equal(load(data)["hidden_states"], hs)  # and the safetensors library reads it
    return data


A = rid_for("a" * 32, 1)
B = rid_for("b" * 32, 2)


def test_flat_batch_with_warmup_writes_exact_files(tmp_path):
    cap = capture_for(tmp_path)
    ids = torch.arange(100, 112)
    aux, final = states(12, pad=4)  # a static prefill batch may carry padding rows
    # A: new request, 5 tokens; a warmup request, 3 tokens; B: continues at prefix 4 with 4 tokens.
    cap.on_logits(fb([A, "warmup_0", B], [0, 0, 4], [5, 3, 4], ids), final, aux)
    cap.writer().flush()
    assert sorted(os.listdir(tmp_path)) == sorted([f"{A}.0-5.safetensors", f"{B}.4-8.safetensors"])
    for rid, (a, b), (s, e) in [(A, (0, 5), (0, 5)), (B, (8, 12), (4, 8))]:
        hs = torch.stack([aux[0][a:b], aux[1][a:b], aux[2][a:b], final[a:b]], dim=1)
        with open(tmp_path / f"{rid}.{s}-{e}.safetensors", "rb") as f:
            assert f.read() == expected_bytes(rid, s, e, ids[a:b], hs)


def test_packed_aux_like_deepseek_gives_the_same_rows():
    aux, final = states(7)
    packed = torch.cat(aux, dim=-1)  # [N, 3H]
    assert torch.equal(sp.stack_states(final, packed, 3, True, 7), sp.stack_states(final, aux, 3, True, 7))


def test_one_request_over_three_chunks_assembles_exactly(tmp_path):
    dump, claimed = tmp_path / "d", tmp_path / "c"
    dump.mkdir()
    claimed.mkdir()
    cap = capture_for(dump)
    sample = Sample.build(list(range(200, 210)))
    rid = rid_for(sample.id, 1)
    aux, final = states(10, seed=3)
    ids = torch.tensor(sample.input_ids, dtype=torch.int64)
    for a, b in [(0, 4), (4, 8), (8, 10)]:  # chunked prefill: three forwards
        cap.on_logits(fb([rid], [a], [b - a], ids[a:b]), final[a:b], [x[a:b] for x in aux])
        cap.on_logits(
            fb([A], [20], [1], ids[:1], mode=Mode(extend=False)), final[:1], [x[:1] for x in aux]
        )  # decode step
    cap.writer().flush()
    assert sorted(os.listdir(dump)) == [f"{rid}.0-4.safetensors", f"{rid}.4-8.safetensors", f"{rid}.8-10.safetensors"]
    ok, failed = claim(str(dump), str(claimed), {rid: 10}, timeout=1)
    assert failed == {}
    got = assemble(ok[rid], sample, POINTS, torch.float32)
    assert torch.equal(got.hidden_states, torch.stack([*aux, final], dim=1))


def test_decode_verify_and_foreign_batches_write_nothing(tmp_path):
    cap = capture_for(tmp_path)
    aux, final = states(3)
    ids = torch.arange(3)
    cap.on_logits(fb([A, B, "x"], [9, 9, 9], [1, 1, 1], ids, mode=Mode(extend=False)), final, aux)
    cap.on_logits(fb([A], [0], [3], ids, mode=Mode(verify=True)), final, aux)
    cap.on_logits(fb(["warmup", "health_check"], [0, 0], [2, 1], ids), final, aux)
    assert os.listdir(tmp_path) == []


def test_non_zero_tp_rank_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(sp, "_tp_writer", lambda: False)
    cap = capture_for(tmp_path)
    aux, final = states(3)
    cap.on_logits(fb([A], [0], [3], torch.arange(3)), final, aux)
    assert os.listdir(tmp_path) == []


def test_missing_aux_states_is_a_clear_error():
    with pytest.raises(ValueError, match="expected 3 aux hidden states, got none: is aux capture configured"):
        sp.stack_states(torch.zeros(2, H), None, 3, True, 2)


class _Inner:
    layers_to_capture: list = []


class _Llama:  # SGLang's Llama/Qwen setter: +1 on every id
    def __init__(self):
        self.model = _Inner()

    def set_eagle3_layers_to_capture(self, ids):
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [v + 1 for v in ids]


class _DeepSeek(_Llama):  # 0.5.14+ quirk: +1 only when the first id is 1
    def set_eagle3_layers_to_capture(self, ids):
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)


@pytest.mark.parametrize("model", [_Llama(), _DeepSeek(), SimpleNamespace(language_model=_DeepSeek())])
def test_configure_model_captures_hf_indices_whatever_the_setter_does(tmp_path, model):
    cap = sp.Capture(sp.PluginConfig(str(tmp_path), [0, 2, 30, 58, 61], ""))
    cap.configure_model(model, 61)
    lm = getattr(model, "language_model", model)
    assert lm.model.layers_to_capture == [0, 2, 30, 58] and lm.capture_aux_hidden_states is True
    assert cap.include_final


def test_register_is_inert_without_dump_dir(monkeypatch):
    monkeypatch.delenv("HARVEST_DUMP_DIR", raising=False)
    before = set(sys.modules)
    sp.register()
    assert not [m for m in set(sys.modules) - before if m.startswith("sglang")] and sp._capture is None


def test_bad_capture_env_is_refused(monkeypatch):
    monkeypatch.setenv("HARVEST_DUMP_DIR", "/tmp/x")
    monkeypatch.setenv("HARVEST_CAPTURE", "2,four")
    with pytest.raises(ValueError, match="HARVEST_CAPTURE='2,four': expected comma-separated HF hidden_states indices"):
        sp.PluginConfig.from_env()


def test_tp_writer_outside_a_server_is_the_only_rank(monkeypatch):
    """With sglang importable but no server in this process, 0.5.23's get_parallel() raises
    ValueError (not ImportError): this process writes. Where sglang is not installed, its
    runtime_context is a stand-in raising exactly what the real one raises (read from 0.5.23)."""
    try:
        import sglang.srt.runtime_context  # noqa: F401
    except ImportError:

        def get_parallel():
            raise ValueError("config namespace 'parallel' not published")

        for name in ("sglang", "sglang.srt"):
            monkeypatch.setitem(sys.modules, name, SimpleNamespace())
        monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", SimpleNamespace(get_parallel=get_parallel))
    assert sp._tp_writer() is True


def _graph_config(prefill_backend):
    """0.5.23's resolved `server_args.cuda_graph_config`: the real class where sglang is importable."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    except ImportError:
        return {"decode": {"backend": "full"}, "prefill": {"backend": prefill_backend}}
    return CudaGraphConfig(decode=PhaseConfig(backend="full"), prefill=PhaseConfig(backend=prefill_backend))


@pytest.mark.parametrize(
    "args, on",
    [
        # 0.5.23: the resolved config decides; on CPU its prefill backend is "disabled" without any flag
        (
            {
                "disable_prefill_cuda_graph": False,
                "cuda_graph_backend_prefill": None,
                "cuda_graph_config": _graph_config("disabled"),
            },
            False,
        ),
        (
            {
                "disable_prefill_cuda_graph": False,
                "cuda_graph_backend_prefill": None,
                "cuda_graph_config": _graph_config("breakable"),
            },
            True,
        ),
        ({"disable_cuda_graph": True, "cuda_graph_config": _graph_config("full")}, False),
        ({"disable_prefill_cuda_graph": False, "cuda_graph_config": None}, True),  # not resolved: the flags decide
        ({"disable_prefill_cuda_graph": False}, True),  # 0.5.14-0.5.22 default
        ({"disable_prefill_cuda_graph": True}, False),
        ({"disable_prefill_cuda_graph": False, "cuda_graph_backend_prefill": "disabled"}, False),
        ({"disable_cuda_graph": True, "disable_prefill_cuda_graph": False}, False),
        ({"disable_piecewise_cuda_graph": False}, True),  # 0.5.11-0.5.13 default
    ],
)
def test_prefill_graph_detection(args, on):
    assert sp.prefill_graphs_on(SimpleNamespace(**args)) is on
    warned = []
    sp.check_server_args(SimpleNamespace(**args), lambda key, *a: warned.append(key))
    assert ("prefill-graph" in warned) is on
