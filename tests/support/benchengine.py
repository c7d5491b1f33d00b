"""The reference engine a benchmark measures against (bench/pipeline.py, bench/regenerate.py): its
own process on `engine_cores` of this machine's cores, with this process and every child it
starts afterwards moved to the others, as on a GPU node where the forward does not run on the
host CPU (`pin=False`: they share every core)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.cli import REPO


def start_pinned_engine(model: str, dump_dir: str, port: int, engine_cores: int,
                        pin: bool = True) -> tuple[subprocess.Popen, list[int], list[int]]:
    """(the engine process, its cores, the cores left to the caller)."""
    cores = sorted(os.sched_getaffinity(0))
    mine, rest = set(cores[:engine_cores]), set(cores[engine_cores:]) or set(cores)
    engine = subprocess.Popen([sys.executable, "-m", "harvest.cli", "engine", "--model", model, "--dump-dir", dump_dir,
                               "--port", str(port), "--threads", str(len(mine))], cwd=REPO, stderr=subprocess.DEVNULL,
                              preexec_fn=(lambda: os.sched_setaffinity(0, mine)) if pin else None)
    if pin:
        os.sched_setaffinity(0, rest)  # this process and every child it starts from now on
    return engine, sorted(mine), sorted(rest)
