"""A real SGLang CPU server for the live tests (tests/system/test_sglang_live.py), from the venv
scripts/sglang_venv.sh builds, and the fp32 test model it serves.

The model is the house's tiny Llama (harvest.cli.demo.build_tiny_model) with its norm weights
set to random non-unit values, so a capture point read before or after the wrong norm differs.
"""

from __future__ import annotations

import os
import subprocess
import time

import httpx

from engines.sglang_launch import launch_spec
from harvest.cli.demo import build_tiny_model
from harvest.cli.redisproc import free_port


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

    def __init__(self, python: str, model: str, points: list[int], num_layers: int, dump_dir: str, log_path: str,
                 chunked_prefill_size: int = 8192, radix_cache: bool = False, tp_size: int = 1,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env, argv = launch_spec(model, points, num_layers, dump_dir=dump_dir, port=self.port, device="cpu",
                                python=python, dtype="float32", chunked_prefill_size=chunked_prefill_size,
                                tp_size=tp_size, extra_args=extra_args)
        if radix_cache:
            argv.remove("--disable-radix-cache")
        self.env, self.argv = env, argv
        self.proc: subprocess.Popen | None = None
        self.start_seconds = 0.0

    def start(self, timeout: float = 600) -> SGLangServer:
        log = open(self.log_path, "a")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.start_seconds = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
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
