"""A real `harvest run` of random token rows on the tiny model, in a subprocess of its own, for the
tests that strike it mid-run (its Redis killed, filled, restarted empty) and then read what it
committed: one sample a row, small jobs (2 samples) and short packing waits, so a fault meets a run
half way."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harvest.formats.index import committed_samples
from harvest.ids import sample_id
from tests.support.chaos import make_rows
from tests.support.cli import REPO, kill_group


def committed(run_dir: str | Path) -> Counter:
    """Copies of each sample id in the run's index files: the truth of what is committed."""
    copies: Counter = Counter()
    for path in glob.glob(os.path.join(str(run_dir), "index", "*.json")):
        with open(path) as f:
            copies.update(committed_samples(json.load(f)))
    return copies


@dataclass
class LocalRun:
    """A started `harvest run`; `finish` waits for it and returns (exit status, stdout, stderr)."""

    proc: subprocess.Popen
    run: str
    expected: set[str]  # the dataset's sample ids
    tmp: Path
    work: Path
    out: Path

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self.kill()
        return rc, (self.tmp / "stdout").read_text(), (self.tmp / "stderr").read_text()

    def kill(self) -> None:
        """The run and whatever it started."""
        kill_group(self.proc)
        self.proc.wait()

    def stderr(self) -> str:
        return (self.tmp / "stderr").read_text(errors="replace")

    def committed(self) -> Counter:
        return committed(self.out / self.run)


def start_run(
    tiny_model: str, tmp_path: Path, run: str, samples: int, seed: int, *extra: str, env: dict[str, str] | None = None
) -> LocalRun:
    """`harvest run` over `samples` random rows (fp32, 2-sample jobs, 1 s packing waits); `extra`
    are more flags (`--redis URL`). Its stdout and stderr go to files under `tmp_path`."""
    from transformers import AutoConfig

    rows = make_rows(samples, AutoConfig.from_pretrained(tiny_model).vocab_size, random.Random(seed))
    expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)) for r in rows}
    assert len(expected) == samples
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    work, out = tmp_path / "work", tmp_path / "out"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harvest.cli",
                "run",
                str(data),
                "--model",
                tiny_model,
                "--out",
                str(out),
                "--run",
                run,
                "--dtype",
                "fp32",
                "--batch-samples",
                "2",
                "--max-wait",
                "1",
                "--chunked-prefill-size",
                "32",
                "--no-progress",
                "--work-dir",
                str(work),
                "--dump-dir",
                str(tmp_path / "dumps"),
                *extra,
            ],
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    return LocalRun(p, run, expected, tmp_path, work, out)
