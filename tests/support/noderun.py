"""A run produced into a shared Redis of the test's own, and `harvest node` processes joining it:
random token rows on the tiny model (fp32, 2-sample jobs), so that a node stopped mid-run meets
a run half way."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harvest.ids import sample_id
from tests.support.chaos import make_rows
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.localrun import committed


@dataclass
class SharedRun:
    """Run `run` in the Redis at `redis_url`, its dataset at `data`, its output under `out`."""

    tmp: Path
    redis_url: str
    model: str
    run: str
    data: Path
    expected: set[str]
    out: Path
    nodes: list[subprocess.Popen] = field(default_factory=list)

    def produce(self) -> subprocess.CompletedProcess:
        res = harvest_cli(
            "produce",
            str(self.data),
            "--run",
            self.run,
            "--redis",
            self.redis_url,
            "--model",
            self.model,
            "--out",
            str(self.out),
            "--dtype",
            "fp32",
            "--batch-samples",
            "2",
        )
        assert res.returncode == 0, res.stdout + res.stderr
        return res

    def node(self, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`harvest node` for the run, its output in TMP/NAME.out and TMP/NAME.err, its work dir TMP/work-NAME."""
        with open(self.tmp / f"{name}.out", "w") as out, open(self.tmp / f"{name}.err", "w") as err:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "harvest.cli",
                    "node",
                    "--run",
                    self.run,
                    "--redis",
                    self.redis_url,
                    "--work",
                    str(self.work(name)),
                    "--node",
                    name,
                    *extra,
                ],
                cwd=REPO,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        self.nodes.append(p)
        return p

    def work(self, name: str) -> Path:
        return self.tmp / f"work-{name}"

    def said(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text() + (self.tmp / f"{name}.err").read_text()

    def log(self, name: str) -> str:
        return (self.work(name) / "logs" / "supervisor.log").read_text()

    def committed(self):
        return committed(self.out / self.run)

    def kill(self) -> None:
        for p in self.nodes:
            kill_group(p)
            p.wait()


def shared_run(tmp: Path, redis_url: str, model: str, run: str, samples: int, seed: int) -> SharedRun:
    from transformers import AutoConfig

    rows = make_rows(samples, AutoConfig.from_pretrained(model).vocab_size, random.Random(seed))
    expected = {sample_id(np.array(r, np.int32), np.ones(len(r), np.uint8)) for r in rows}
    assert len(expected) == samples
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return SharedRun(tmp, redis_url, model, run, data, expected, tmp / "out")
