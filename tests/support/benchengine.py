"""The reference engine a benchmark measures against (bench/pipeline.py, bench/regenerate.py): its
own process, its dump dir (under /dev/shm where there is one), on `engine_cores` of this machine's
cores, with this process and every child it starts afterwards moved to the others, as on a GPU
node where the forward does not run on the host CPU (`pin=False`: they share every core)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from harvest.cli.redisproc import free_port
from tests.support.cli import REPO


@dataclass
class BenchEngine:
    proc: subprocess.Popen
    url: str
    dump_dir: str
    cores: list[int]  # the engine's
    rest: list[int]  # this process's and its later children's


def start_pinned_engine(model: str, tmp: str, tag: str, engine_cores: int, pin: bool = True) -> BenchEngine:
    dump_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tmp, f"harvest-bench-{tag}-{os.getpid()}")
    os.makedirs(dump_dir, mode=0o700)
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    mine, rest = set(cores[:engine_cores]), set(cores[engine_cores:]) or set(cores)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harvest.cli",
            "engine",
            "--model",
            model,
            "--dump-dir",
            dump_dir,
            "--port",
            str(port),
            "--threads",
            str(len(mine)),
        ],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
        preexec_fn=(lambda: os.sched_setaffinity(0, mine)) if pin else None,
    )
    if pin:
        os.sched_setaffinity(0, rest)  # this process and every child it starts from now on
    return BenchEngine(proc, f"http://127.0.0.1:{port}", dump_dir, sorted(mine), sorted(rest))
