"""The vLLM engine's parts that need no vLLM: layer-id mapping, the final norm against transformers,
the lock wait, converting a connector file into a harvest dump chunk, and the launch command.

Connector files here are written with the layout and metadata harvest's connector writes
(engines/vllm_connector.py); the real server's files are exercised by tests/system/test_vllm.py."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import zlib

import pytest
import torch
from safetensors.torch import save_file

from harvest.config import RunConfig
from harvest.engines.vllm_launch import launch_spec, needs_final_norm, vllm_layer_ids
from harvest.formats.dump import chunk_name, read_chunk
from harvest.formats.stformat import read_file_header
from harvest.node.dumpdir import vllm_dir as storage_dir
from harvest.read.final_norm import FinalNorm, FinalNormError
from harvest.workers.clients.vllm import (
    CONNECTOR_FORMAT,
    VllmClient,
    VllmDumpError,
    read_vllm_file,
    to_capture_points,
    wait_unlocked,
)
from tests.support.cli import REPO, harvest_cli

RID = "hv-" + "ab" * 16 + "-1"


def test_layer_ids_are_hf_indices_in_ascending_slot_order():
    assert vllm_layer_ids([2, 4, 5, 8], 8) == [2, 4, 5, 8]
    assert vllm_layer_ids([8, 0, 3], 8) == [0, 3, 8]
    assert needs_final_norm([2, 4, 5, 8], 8) is True
    assert needs_final_norm([2, 4, 7], 8) is False
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        vllm_layer_ids([2, 9], 8)
    with pytest.raises(ValueError, match="repeat"):
        vllm_layer_ids([2, 2], 8)


def _hf_forward(model, ids):
    """HF hidden_states and the final norm's input (captured by a hook on the norm itself)."""
    seen = {}

    def hook(module, args, out) -> None:  # returns None: a forward hook's return value replaces the output
        seen["pre"] = args[0].clone()

    handle = model.model.norm.register_forward_hook(hook)
    try:
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return hs, seen["pre"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_final_norm_from_checkpoint_equals_transformers(tiny_model, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype).eval()
    hs, pre = _hf_forward(model, list(range(5, 70)))
    norm = FinalNorm.from_checkpoint(tiny_model)
    assert norm.eps == model.config.rms_norm_eps
    out = norm(pre)
    assert out.dtype == dtype
    assert torch.equal(out, hs[8][0])  # bit for bit: the same operations in the same order
    assert not torch.equal(pre, hs[8][0])  # and the norm does change the state


def test_final_norm_refuses_what_it_cannot_compute(tmp_path):
    with pytest.raises(FinalNormError, match="HARVEST_MODEL_DIR"):
        FinalNorm.from_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "layer_norm_epsilon": 1e-5}))
    with pytest.raises(FinalNormError, match="RMSNorm"):
        FinalNorm.from_checkpoint(str(tmp_path))


def test_gemma_style_norm_multiplies_by_one_plus_weight():
    x = torch.randn(3, 8)
    w = torch.randn(8)
    got = FinalNorm(w, 1e-6, offset=True)(x)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(got, ref, atol=1e-6)


def test_to_capture_points_orders_slots_and_normalizes_only_L(tiny_model):
    norm = FinalNorm.from_checkpoint(tiny_model)
    hs = torch.randn(5, 3, 64)
    points, out = to_capture_points([8, 2, 4], hs, 8, norm)
    assert points == [2, 4, 8]
    assert torch.equal(out[:, 0], hs[:, 1]) and torch.equal(out[:, 1], hs[:, 2])
    assert torch.equal(out[:, 2], norm(hs[:, 0]))
    points, out = to_capture_points([2, 4], hs[:, :2], 8, None)
    assert points == [2, 4] and torch.equal(out, hs[:, :2])
    with pytest.raises(VllmDumpError, match="no final norm"):
        to_capture_points([2, 8], hs[:, :2], 8, None)


def _connector_file(directory, rid, hs, ids, layer_ids, fmt=CONNECTOR_FORMAT) -> str:
    """A file as harvest's connector writes it (engines/vllm_connector.py, `_write_tensors`)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"cmpl-{rid}-0-1a2b3c4d.safetensors")
    tensors = {"hidden_states": hs.contiguous(), "token_ids": ids}
    sums = {k: zlib.crc32(v.reshape(-1).view(torch.uint8).numpy()) for k, v in sorted(tensors.items())}
    meta = {"format": fmt, "layer_ids": json.dumps(layer_ids), "crc32": json.dumps(sums, separators=(",", ":"))}
    save_file(tensors, path, metadata=meta)
    open(path + ".lock", "w").close()
    return path


def test_wait_unlocked_waits_for_the_writer_and_times_out(tmp_path):
    path = str(tmp_path / "x.safetensors")
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with pytest.raises(VllmDumpError, match="still locked"):
        wait_unlocked(path, timeout=0.2)
    threading.Timer(0.3, os.close, [fd]).start()
    t0 = time.monotonic()
    wait_unlocked(path, timeout=10)
    assert 0.25 <= time.monotonic() - t0 < 5
    wait_unlocked(str(tmp_path / "no-lock"), timeout=0)  # no lock file: nothing to wait for


def _cfg(model: str, points=(2, 4, 8)) -> RunConfig:
    return RunConfig(
        run="r",
        model=model,
        capture_points=list(points),
        hidden_size=64,
        out_url="file:///x",
        engine="vllm",
        num_layers=8,
    )


def test_convert_writes_a_verified_chunk_and_removes_vllm_files(tmp_path, tiny_model):
    dump = tmp_path / "dump"
    client = VllmClient("http://127.0.0.1:1", _cfg(tiny_model), str(dump))
    try:
        hs, ids = torch.randn(6, 3, 64), torch.arange(10, 16)
        path = _connector_file(storage_dir(str(dump)), RID, hs, ids, [2, 4, 8])
        client._convert(RID, path)
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")
        chunk = read_chunk(str(dump / chunk_name(RID, 0, 6)))
        assert chunk.capture_points == [2, 4, 8] and chunk.input_ids.tolist() == ids.tolist()
        assert torch.equal(chunk.hidden_states[:, :2], hs[:, :2])
        assert torch.equal(chunk.hidden_states[:, 2], FinalNorm.from_checkpoint(tiny_model)(hs[:, 2]))

        # A server launched with other layers: converted truthfully, so claim's check names the mismatch.
        rid2 = RID[:-1] + "2"
        client._convert(rid2, _connector_file(storage_dir(str(dump)), rid2, hs[:, :2], ids, [3, 4]))
        assert read_chunk(str(dump / chunk_name(rid2, 0, 6))).capture_points == [3, 4]
    finally:
        client.close()


def test_convert_refuses_foreign_paths_and_files(tmp_path, tiny_model):
    dump = tmp_path / "dump"
    client = VllmClient("http://127.0.0.1:1", _cfg(tiny_model), str(dump))
    try:
        hs, ids = torch.randn(4, 3, 64), torch.arange(4)
        outside = _connector_file(str(tmp_path / "elsewhere"), RID, hs, ids, [2, 4, 8])
        with pytest.raises(VllmDumpError, match="not a file of this request"):
            client._convert(RID, outside)
        assert os.path.exists(outside)  # a path from a response is never deleted outside the storage dir
        other = _connector_file(storage_dir(str(dump)), RID[:-1] + "7", hs, ids, [2, 4, 8])
        with pytest.raises(VllmDumpError, match="not a file of this request"):
            client._convert(RID, other)
        stock = _connector_file(storage_dir(str(dump)), RID, hs, ids, [2, 4, 8], fmt="other")
        with pytest.raises(VllmDumpError, match="harvest vllm-args"):
            client._convert(RID, stock)
        with pytest.raises(VllmDumpError, match="wrote no hidden states"):
            read_vllm_file(str(tmp_path / "missing.safetensors"))
        # a file changed after vLLM wrote it: refused, and removed like any file of the request
        path = _connector_file(storage_dir(str(dump)), RID, hs, ids, [2, 4, 8])
        span = read_file_header(path)[0]["hidden_states"]
        with open(path, "r+b") as f:
            f.seek(span.begin + 5)
            byte = f.read(1)
            f.seek(span.begin + 5)
            f.write(bytes([byte[0] ^ 0x08]))
        with open(path, "rb") as f:
            found = zlib.crc32(f.read()[span.begin : span.end])
        recorded = json.loads(read_file_header(path)[1]["crc32"])["hidden_states"]
        with pytest.raises(VllmDumpError) as e:
            client._convert(RID, path)
        assert str(e.value) == (
            f"{path}: hidden_states has crc32 {found}, the connector recorded {recorded}: the file "
            "changed after the connector wrote it (a disk or memory fault on this node?)"
        )
        assert not os.path.exists(path)
        assert [n for n in os.listdir(dump) if n.startswith("hv-")] == []
    finally:
        client.close()


def test_launch_spec_names_connector_layers_and_storage():
    env, args = launch_spec(
        "/m", [8, 2, 4, 5], 8, dump_dir="/dev/shm/h", port=8123, python="/v/bin/python", dtype="float32"
    )
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert args[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in args
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "HarvestHiddenStatesConnector",
        "kv_connector_module_path": "harvest.engines.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/h/.vllm"},
    }
    # The connector module really defines the class the config names (checked without importing vLLM).
    src = open(os.path.join(REPO, "engines", "vllm_connector.py")).read()
    assert "class HarvestHiddenStatesConnector(ExampleHiddenStatesConnector):" in src
    assert f'FORMAT = "{CONNECTOR_FORMAT}"' in src


def test_cli_vllm_args_prints_the_run_layers(tiny_model):
    res = harvest_cli("vllm-args", "--model", tiny_model, "--dump-dir", "/dev/shm/x", "--python", "py")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("VLLM_CPU_KVCACHE_SPACE=1 \\\n  py -m vllm.entrypoints.openai.api_server")
    assert '"eagle_aux_hidden_state_layer_ids":[2,4,5,8]' in res.stdout
    assert '"shared_storage_path":"/dev/shm/x/.vllm"' in res.stdout


def test_sweep_removes_only_old_harvest_files_in_vllm_storage(tmp_path, tiny_model):
    dump = tmp_path / "dump"
    client = VllmClient("http://127.0.0.1:1", _cfg(tiny_model), str(dump))
    try:
        assert client.sweep() == 0  # no storage dir yet
        store, hs, ids = storage_dir(str(dump)), torch.zeros(1, 3, 64), torch.arange(1)
        old = _connector_file(store, RID, hs, ids, [2, 4, 8])
        fresh = _connector_file(store, RID[:-1] + "3", hs, ids, [2, 4, 8])
        foreign = os.path.join(storage_dir(str(dump)), "cmpl-1234-0.safetensors")
        open(foreign, "w").close()
        for p in (old, old + ".lock", foreign):
            os.utime(p, (time.time() - 3600, time.time() - 3600))
        assert client.sweep() == 2
        assert sorted(os.listdir(storage_dir(str(dump)))) == sorted(
            [os.path.basename(fresh), os.path.basename(fresh) + ".lock", "cmpl-1234-0.safetensors"]
        )
    finally:
        client.close()


def test_produce_records_the_vllm_engine_kind_for_workers(tmp_path, tiny_model, redis_server, conn):
    from harvest.state.runstore import load_run
    from harvest.workers.clients import make_engine

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    res = harvest_cli(
        "produce",
        str(data),
        "--run",
        "v",
        "--redis",
        redis_server.url,
        "--model",
        tiny_model,
        "--out",
        f"file://{tmp_path}/out",
        "--engine",
        "vllm",
    )
    assert res.returncode == 0, res.stderr
    cfg = load_run(conn, "v")
    assert cfg.engine == "vllm" and cfg.num_layers == 8
    engine = make_engine(cfg, "http://127.0.0.1:1", str(tmp_path / "dump"))
    try:
        assert isinstance(engine, VllmClient)
    finally:
        engine.close()


def test_unreachable_server_is_transient(tmp_path, tiny_model):
    from harvest.cli.redisproc import free_port
    from harvest.workers.clients.base import EngineUnavailable

    client = VllmClient(
        f"http://127.0.0.1:{free_port()}", _cfg(tiny_model), str(tmp_path / "dump"), retries=1, backoff=0.01
    )
    try:
        assert client.health() is False
        with pytest.raises(EngineUnavailable, match="failed 2 times"):
            client.generate([RID, RID[:-1] + "2"], [[1, 2, 3], [4, 5]])
    finally:
        client.close()


def test_compose_vllm_service_matches_harvest_vllm_args():
    """docker-compose's vllm service runs what `harvest vllm-args` prints (one source of truth)."""
    import re

    import yaml

    from harvest.config import eagle3_layers

    root = REPO
    with open(os.path.join(root, "docker-compose.yml")) as f:
        spec = yaml.safe_load(f)
    svc = spec["services"]["vllm"]
    assert svc["profiles"] == ["vllm"] and "engine" in svc["networks"]["default"]["aliases"]
    assert svc["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert (
        "./engines:/opt/harvest/harvest/engines:ro" in svc["volumes"]
        and svc["environment"]["PYTHONPATH"] == "/opt/harvest"
    )
    # The compose file's capture points come from .env; substitute the example's (eagle3 on 8 layers).
    compose_args = [re.sub(r"\$\{CAPTURE_POINTS:\?[^}]*\}", "2,4,5,8", a) for a in svc["command"]]
    flags = dict(a.split("=", 1) if "=" in a else (a, None) for a in compose_args)
    _, args = launch_spec("/models/m", eagle3_layers(8), 8, dump_dir="/dumps", port=30000)
    for i, a in enumerate(args):
        if a.startswith("--") and a not in ("--model", "--host", "--dtype"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            assert a in flags, a
            if a.endswith("-config"):
                assert json.loads(flags[a]) == json.loads(value), a
            elif value is not None:
                assert flags[a] == value, a
    # Workers of a vLLM run read the final norm from the checkpoint; the producer sets the run's engine.
    assert "${MODEL_DIR:-./models}:/models:ro" in spec["services"]["worker"]["volumes"]
    assert "${ENGINE:-reference}" in spec["services"]["producer"]["command"]
