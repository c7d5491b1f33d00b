"""A real SGLang CPU server for the live tests (tests/system/test_sglang_live.py and
test_sglang_servers.py), from the venv scripts/sglang_venv.sh builds, the fp32 test model it
serves, and the checks both files make of what it dumps and what a run stores.

The model is the house's tiny Llama (harvest.cli.demo.build_tiny_model) with its norm weights
set to random non-unit values, so a capture point read before or after the wrong norm differs.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import pytest
from safetensors import safe_open

from harvest.cli.demo import build_tiny_model
from harvest.cli.redisproc import free_port
from harvest.engines.sglang_launch import launch_spec, venv_python
from harvest.health import wait_healthy
from harvest.read.reader import RunReader
from tests.support.need import need
from tests.support.wait import wait_for

L = 8
POINTS = [0, 2, 4, 7, 8]
CHUNK = 64  # SGLang's --chunked-prefill-size in the live tests: long samples arrive in several forwards
# SGLang torch_native fp32 and transformers fp32 differ by a few 1e-6 at most (at L, after the final
# norm; far less at the other points): the bound leaves a margin over that.
ABS_BOUND = 1e-5


def build_model(path: str, seed: int = 7) -> str:
    """The tiny Llama with random norm weights in [0.5, 1.5) (fixed seed), saved in fp32."""
    if os.path.exists(os.path.join(path, ".norms-randomized")):
        return path
    build_tiny_model(path)
    import torch
    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    weights = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for name in sorted(weights):
        if name.endswith("norm.weight"):
            weights[name] = 0.5 + torch.rand(weights[name].shape, generator=g)
    save_file(weights, f, metadata={"format": "pt"})
    open(os.path.join(path, ".norms-randomized"), "w").close()
    return path


class SGLangServer:
    """One SGLang CPU server process (the command `harvest sglang-args --device cpu` prints)."""

    def __init__(
        self,
        python: str,
        model: str,
        points: list[int],
        num_layers: int,
        dump_dir: str,
        log_path: str,
        chunked_prefill_size: int = 8192,
        radix_cache: bool = False,
        tp_size: int = 1,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env, argv = launch_spec(
            model,
            points,
            num_layers,
            dump_dir=dump_dir,
            port=self.port,
            device="cpu",
            python=python,
            dtype="float32",
            chunked_prefill_size=chunked_prefill_size,
            tp_size=tp_size,
            extra_args=extra_args,
        )
        if radix_cache:
            argv.remove("--disable-radix-cache")
        self.env, self.argv = {**env, **(extra_env or {})}, argv
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0

    def start(self, timeout: float = 600) -> SGLangServer:
        log = open(self.log_path, "a")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

        def running() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited {self.proc.returncode} while starting:\n{self.log_tail()}")

        if wait_healthy(self.url, timeout - (time.monotonic() - t0), check=running, interval=0.5, probe_timeout=2):
            self.start_seconds = time.monotonic() - t0
            return self
        self.stop()
        raise RuntimeError(f"SGLang not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (server, scheduler, detokenizer): a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


class Reference:
    """transformers' fp32 forward of the test model: the independent side of every comparison."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.worst_abs = 0.0
        self.worst_rel = 0.0

    def hidden(self, ids: list[int]):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids]), output_hidden_states=True).hidden_states

    def check(self, got, ids: list[int], points: list[int], start: int = 0, end: int | None = None) -> None:
        """Compare `got [T, K, H]` (rows start..end of the prompt `ids`) at every capture point; keep the worst."""
        ref = self.hidden(ids)
        end = len(ids) if end is None else end
        assert tuple(got.shape) == (end - start, len(points), ref[0].shape[-1]), got.shape
        for k, p in enumerate(points):
            want = ref[p][0][start:end]
            diff = (got[:, k].float() - want).abs()
            self.worst_abs = max(self.worst_abs, diff.max().item())
            self.worst_rel = max(self.worst_rel, (diff.max() / want.abs().max().clamp_min(1e-12)).item())


class StripExtraKey:
    """An HTTP pass-through to an SGLang server that drops `extra_key` from /generate: it stands
    for an engine that ignores extra_key, the case the worker's prefix-cache check exists for.
    Everything else (the server, its radix cache, the plugin) is SGLang's own."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import json
        import threading

        up = upstream

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, r: httpx.Response) -> None:
                self.send_response(r.status_code)
                self.send_header("content-type", r.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self) -> None:
                self._reply(httpx.get(up + self.path, timeout=30))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/generate":
                    body.pop("extra_key", None)
                self._reply(httpx.post(up + self.path, json=body, timeout=600))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def check_run(out_url: str, expected: dict, reference: Reference) -> None:
    """Every expected sample exactly once (the reader refuses duplicates), ids, mask and states right."""
    reader = RunReader(out_url)
    assert sorted(reader.sample_ids) == sorted(expected)
    assert reader.capture_points == POINTS
    for sid, (ids, mask) in expected.items():
        got = reader.get(sid)
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == mask
        reference.check(got["hidden_states"], ids, POINTS)


def dump_files(dumps: str) -> dict[str, list[tuple[int, int, object]]]:
    """rid -> [(start, end, hidden_states)] of the plugin's files, in order."""
    out: dict[str, list] = {}
    for name in sorted(os.listdir(dumps)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(dumps, name), "pt") as f:
            meta = f.metadata()
            assert meta["capture_points"] == str(POINTS)
            out.setdefault(meta["rid"], []).append(
                (int(meta["start"]), int(meta["end"]), f.get_tensor("hidden_states"))
            )
    return {rid: sorted(v, key=lambda t: t[0]) for rid, v in out.items()}


def wait_dumped(dumps: str, prompts: dict[str, list[int]], timeout: float = 60) -> None:
    """Until the plugin's files reach the end of every prompt (each file appears whole, by rename)."""

    def done() -> bool:
        ends = {}
        for name in os.listdir(dumps):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(dumps, name), "pt") as f:
                    meta = f.metadata()
                ends[meta["rid"]] = max(ends.get(meta["rid"], 0), int(meta["end"]))
        return all(ends.get(rid) == len(ids) for rid, ids in prompts.items())

    wait_for(done, timeout, f"the plugin's dump files reaching the end of all {len(prompts)} prompts in {dumps}")


def sglang_python_or_skip() -> str:
    """The SGLang venv's python; else the calling test module is skipped, saying how to build it."""
    try:
        return venv_python()
    except FileNotFoundError as e:
        need("the SGLang venv", str(e), module=True)


# The live files' module fixtures (imported into each: pytest finds them there).
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("sglang-model") / "tiny"))


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model)
