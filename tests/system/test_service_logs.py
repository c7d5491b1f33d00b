"""Workers, collectors and the janitor log at INFO by default (no -v), each line whole: a start
line (run, node, engine, spool), one line per job (samples, tokens, seconds, failures by
reason), one line per committed shard. Real processes, a real engine, a run with failures."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.sample import Sample
from harvest.state.ledger import Ledger
from harvest.state.runstore import load_run
from tests.support.ops import REPO, Procs, cli, enqueue, new_run


@pytest.fixture
def procs(tmp_path):
    p = Procs(str(tmp_path / "logs"))
    yield p
    p.close()


def _quiet(*args: str) -> str:
    """A service run to its end the way an operator starts it (no -v); its stderr."""
    res = subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


def test_services_log_start_job_and_shard_lines(tmp_path, conn, redis_server, tiny_model, procs):
    run, url = "logs1", redis_server.url
    new_run(conn, run, tiny_model, str(tmp_path / "out"), batch=4)
    data = write_jsonl(str(tmp_path / "data.jsonl"), demo_rows(8, seed=3))
    assert cli("produce", data, "--run", run, "--redis", url).returncode == 0
    enqueue(conn, load_run(conn, run), [Sample.build([10**6, 3]), Sample.build([10**6])])  # the engine rejects both
    dumps, spool = str(tmp_path / "dumps"), str(tmp_path / "spool")
    engine = procs.engine("engine", tiny_model, dumps)

    w = _quiet(
        "worker",
        "--run",
        run,
        "--redis",
        url,
        "--engine-url",
        engine,
        "--dump-dir",
        dumps,
        "--spool-dir",
        spool,
        "--burst",
        "--node",
        "nodeA",
    )
    start = re.findall(
        r"worker started: \S+, run logs1, node nodeA, engine reference at (\S+), spool (\S+) "
        r"\(id [0-9a-f]{32}\), dump dir (\S+)$",
        w,
        re.M,
    )
    assert start == [(engine, spool, dumps)], w
    jobs = re.findall(r"job (\S+): (\d+) samples, (\d+) tokens, [0-9.]+s: spooled (\d+), failed (\d+)(.*)$", w, re.M)
    assert len(jobs) == 4, w  # 9 rows (demo_rows adds a long one) in jobs of 4, and the two rejected samples
    assert sum(int(j[1]) for j in jobs) == 11 and sum(int(j[3]) for j in jobs) == 9
    assert [(j[1], j[2], j[4], j[5]) for j in jobs if j[4] != "0"] == [("2", "3", "2", ", engine-rejected 2")]
    assert sum(int(j[2]) for j in jobs) == Ledger(conn, run).stats()["tokens_spooled"] + 3, w

    c = _quiet("collect", "--run", run, "--redis", url, "--spool-dir", spool, "--node", "nodeA", "--burst")
    assert re.search(
        rf"collector started: run logs1, node nodeA, spool {re.escape(spool)} \(id [0-9a-f]{{32}}\), "
        r"output file://\S+/out/logs1, shards of 1024 MiB, max wait 60s, \d packer\(s\)$",
        c,
        re.M,
    ), c
    shards = re.findall(r"committed shard [0-9a-f]{32}: (\d+) samples, (\d+) tokens, [0-9.]+ MB to file://", c)
    assert sum(int(n) for n, _ in shards) == 9, c
    assert sum(int(t) for _, t in shards) == Ledger(conn, run).stats()["tokens_done"]

    j = _quiet("janitor", "--run", run, "--redis", url)
    assert j == ""  # one pass: its report is the command's output, nothing logged
