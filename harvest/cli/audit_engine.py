"""`harvest audit --against engine`: the run's own engine recomputes each audited sample.

It lives in the composition root because it is the worker's path, reused rather than copied: the
engine client the run's workers use (`harvest.workers.clients.make_engine`, by the run's engine kind:
SGLang's native `/generate`, also the reference engine's, or vLLM's completions), and the worker's
`claim` and `assemble` (workers/claim.py), so the recomputed states pass the very checks the
extraction's did. The core (`harvest/`) may not import the wings; `harvest.cli` is the one
place that imports every wing, so the route is here and `harvest.ops.audit` takes it as a
`Route`.

What differs from the extraction, on purpose: each sample is sent alone (no batch), under a fresh
rid (`hv-<random>-0`: never a sample id, so no janitor takes its files for a done sample's, and
never a prefix the cache has seen: the client sends the rid as SGLang's `extra_key`), and, where
the audit starts the engine itself (the reference engine of a reference run), with a prefill chunk
that is a prime (61 by default), so chunk boundaries fall elsewhere than in the run. A given
server (`--engine-url`, with the `--dump-dir` it writes to) keeps the chunk size it was launched
with: launch the audit's own with another `--chunked-prefill-size` where the fleet's is known.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

import httpx

from harvest.cli.redisproc import free_port
from harvest.config import RunConfig
from harvest.errors import ConfigurationError, ServiceError
from harvest.health import wait_healthy
from harvest.node.dumpdir import claim_dir, default_dump_dir
from harvest.node.modelcheck import check_engine
from harvest.ops.audit import Unchecked
from harvest.sample import Sample
from harvest.settings import AuditSettings

if TYPE_CHECKING:
    import torch


class AuditEngineDown(ServiceError, RuntimeError):
    """The engine the audit started did not come up (its log says why), or a given one does not answer."""


def _chunk_of(url: str) -> int | None:
    """The server's prefill chunk, where it says (the reference engine and SGLang do)."""
    for path in ("/get_server_info", "/get_model_info"):
        try:
            r = httpx.get(f"{url}{path}", timeout=10.0)
            if r.status_code == 200 and isinstance(r.json(), dict) and r.json().get("chunked_prefill_size") is not None:
                return int(r.json()["chunked_prefill_size"])
        except (httpx.HTTPError, ValueError):
            continue
    return None


class EngineRoute:
    name = "engine"

    def __init__(
        self,
        cfg: RunConfig,
        engine_url: str | None,
        dump_dir: str | None,
        model: str | None,
        chunked_prefill_size: int,
        settings: AuditSettings = AuditSettings(),
    ) -> None:
        self.cfg, self.settings = cfg, settings
        self.engine_points = list(cfg.capture_points)  # what the engine dumps: the run's, or every layer
        self._proc: subprocess.Popen | None = None
        self._own_dumps: str | None = None
        if engine_url is None:
            if cfg.engine != "reference":
                raise ConfigurationError(
                    f"run {cfg.run} was extracted by {cfg.engine}: pass --engine-url URL and --dump-dir "
                    f"DIR of a {cfg.engine} server on this node (harvest {cfg.engine}-args --run "
                    f"{cfg.run} prints its command), or --against hf"
                )
            engine_url, dump_dir = self._start_reference(model or cfg.model, chunked_prefill_size)
            chunk, how = chunked_prefill_size, "started by the audit"
        else:
            if dump_dir is None:
                raise ConfigurationError(
                    "--engine-url needs --dump-dir: the folder that server writes its dump files to "
                    "(its HARVEST_DUMP_DIR)"
                )
            if not wait_healthy(engine_url.rstrip("/"), 10.0):
                raise AuditEngineDown(
                    f"no engine answers at {engine_url.rstrip('/')}/health: start the server, or "
                    "pass the URL of one on this node"
                )
            chunk, how = _chunk_of(engine_url.rstrip("/")), "given"
        check_engine(cfg, engine_url)  # the run's model, or the audit proves nothing
        from harvest.workers.clients import make_engine

        self.url, self.dump_dir = engine_url.rstrip("/"), dump_dir
        os.makedirs(dump_dir, mode=0o700, exist_ok=True)
        self.client = make_engine(cfg, self.url, dump_dir)
        chunking = f"chunked prefill {chunk}" if chunk else "chunked prefill as launched"
        self.detail = f"{cfg.engine} engine at {self.url} ({how}), {chunking}, each sample alone with a fresh rid"

    def _start_reference(self, model: str, chunk: int) -> tuple[str, str]:
        self._own_dumps = tempfile.mkdtemp(prefix="audit-", dir=_dump_base())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self._log = os.path.join(self._own_dumps, "engine.log")
        dumps = os.path.join(self._own_dumps, "dumps")
        if self.cfg.num_layers:  # every layer, so a capture point taken from the wrong one is named
            self.engine_points = list(range(self.cfg.num_layers + 1))
        argv = [
            sys.executable,
            "-m",
            "harvest.cli",
            "engine",
            "--model",
            model,
            "--dump-dir",
            dumps,
            "--port",
            str(port),
            "--layers",
            ",".join(map(str, self.engine_points)),
            "--chunked-prefill-size",
            str(chunk),
        ]
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def alive() -> None:
            if self._proc.poll() is not None:
                raise AuditEngineDown(
                    f"the reference engine the audit started exited with status "
                    f"{self._proc.returncode}: {_tail(self._log)}"
                )

        if not wait_healthy(url, self.settings.engine_wait_s, interval=0.2, check=alive):
            raise AuditEngineDown(
                f"the reference engine the audit started at {url} did not answer /health within "
                f"{self.settings.engine_wait_s:.0f}s: {_tail(self._log)}"
            )
        return url, dumps

    def recompute(self, sample: Sample) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        import torch

        from harvest.state.failures import SampleFailure
        from harvest.workers.claim import assemble, claim
        from harvest.workers.clients.base import Rejected

        rid = f"hv-{os.urandom(16).hex()}-0"
        got = self.client.generate([rid], [sample.input_ids.tolist()])[0]  # EngineUnavailable: the audit stops
        if isinstance(got, Rejected):
            raise Unchecked(got.message)
        if got.cached_tokens:
            raise Unchecked(
                f"the engine served {got.cached_tokens} of its tokens from its prefix cache: relaunch it "
                "with the cache off (harvest sglang-args)"
            )
        mine = claim_dir(self.dump_dir, f"audit-{os.getpid()}-{rid[3:11]}")  # made now, gone in a second
        os.makedirs(mine, mode=0o700)
        try:
            claimed, failed = claim(self.dump_dir, mine, {rid: sample.num_tokens}, self.settings.dump_timeout_s)
            if rid in failed:
                raise Unchecked(str(failed[rid]))
            try:
                hs = assemble(claimed[rid], sample, self.engine_points, torch.float32).hidden_states.clone()
            except SampleFailure as e:
                raise Unchecked(str(e)) from None
        finally:
            shutil.rmtree(mine, ignore_errors=True)
        if self.engine_points == list(self.cfg.capture_points):
            return hs, None
        layers = {p: hs[:, j] for j, p in enumerate(self.engine_points)}
        return torch.stack([layers[p] for p in self.cfg.capture_points], dim=1), layers

    def close(self) -> None:
        self.client.close()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._own_dumps is not None:
            shutil.rmtree(self._own_dumps, ignore_errors=True)


def _dump_base() -> str:
    base = default_dump_dir()
    os.makedirs(base, mode=0o700, exist_ok=True)
    return base


def _tail(path: str, n: int = 600) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace").strip().replace("\n", " | ")
    except OSError:
        return "(no log)"
