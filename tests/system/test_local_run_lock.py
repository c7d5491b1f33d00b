"""One run, one runner: two `harvest run`s racing for one work dir, one of them refused at once
naming the other, which finishes untouched with a consistent ledger; two runs of different names
side by side both finish; a ledger whose counters disagree with its states (what two servers on
one append-only file left behind) is named by `harvest status --check` and repaired by
`harvest reconcile`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.cli.workdir import read_holder
from harvest.config import build_config
from harvest.read.reader import RunReader
from harvest.sample import Sample
from harvest.state.keys import Keys
from harvest.state.ledger import Ledger
from harvest.state.payload import payload_row
from harvest.state.runstore import publish_run
from tests.support.cli import REPO, harvest_cli, kill_group
from tests.support.wait import wait_for


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def _finish(p: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_group(p)
    return p.returncode, out, err


def test_two_runners_racing_for_one_work_dir_one_is_refused_naming_the_other(tmp_path, tiny_model):
    dataset = write_jsonl(str(tmp_path / "d.jsonl"), demo_rows(10, seed=9))
    work = str(tmp_path / "work")
    args = [
        "run",
        dataset,
        "--model",
        tiny_model,
        "--out",
        str(tmp_path / "out"),
        "--run",
        "twice",
        "--work-dir",
        work,
        "--dump-dir",
        str(tmp_path / "dumps"),
        "--no-progress",
    ]
    # the same command in two terminals, the second while the first runs (its engine answers after 5 s:
    # it surely still runs when the second has started, however loaded the machine)
    winner = _start(args, {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "5"})
    try:
        wait_for(
            lambda: read_holder(os.path.join(work, "runner.lock")).get("pid") == winner.pid,
            120,
            "the first runner holding its work dir",
        )
        lost = _finish(_start(args), timeout=120)
        assert winner.poll() is None  # untouched
    finally:
        won = _finish(winner)
    assert won[0] == 0 and lost[0] == 2, (won, lost)
    command = f"harvest run {dataset} --model {tiny_model}"
    assert lost[2] == (
        f"harvest: error: work dir {work} (run twice) is in use by pid {winner.pid} (`{command} --out "
        f"{tmp_path / 'out'} --run twice --work-dir {work} --dump-dir {tmp_path / 'dumps'} "
        f"--no-progress`): one runner at a time; wait for it to finish or stop it (Ctrl-C in its "
        f"terminal, or kill -INT {winner.pid})\n"
    ), lost[2]
    assert lost[1] == ""
    n = len(RunReader(str(tmp_path / "out" / "twice")))  # each sample once: the reader refuses duplicates
    assert f"samples: {n} done, 0 failed ({n} enqueued now, 0 already known)" in won[1]
    res = harvest_cli("status", "--run", "twice", "--work-dir", work, "--check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == f"ledger of run twice: consistent ({n} samples: queued 0, spooled 0, done {n}, failed 0)\n"


def test_two_runs_side_by_side_both_finish(tmp_path, tiny_model):
    tag = uuid.uuid4().hex[:8]
    env = {"HARVEST_WORK": str(tmp_path / "works")}  # the default work dir: $HARVEST_WORK/<run>
    procs = {}
    for name, seed in ((f"left-{tag}", 1), (f"right-{tag}", 2)):
        dataset = write_jsonl(str(tmp_path / f"{name}.jsonl"), demo_rows(8, seed=seed))
        procs[name] = _start(
            [
                "run",
                dataset,
                "--model",
                tiny_model,
                "--out",
                str(tmp_path / "out"),
                "--run",
                name,
                "--dump-dir",
                str(tmp_path / f"dumps-{name}"),
                "--no-progress",
            ],
            env,
        )
    for name, p in procs.items():
        rc, out, err = _finish(p)
        assert rc == 0, out + err
        n = len(RunReader(str(tmp_path / "out" / name)))
        assert f"samples: {n} done, 0 failed" in out
        assert f"  status: harvest status --run {name} --work-dir {tmp_path / 'works' / name}\n" in out


def test_status_check_names_a_drifted_ledger_and_reconcile_repairs_it(tmp_path, tiny_model, redis_server, conn):
    cfg = publish_run(conn, build_config("drift", tiny_model, str(tmp_path / "out")))
    led = Ledger(conn, cfg.run)
    samples = [Sample.build(np.arange(1, i + 3)) for i in range(6)]
    ids = [x.id for x in samples]
    led.add_queued(ids)
    led.keep_failed_payloads({ids[0]: payload_row(cfg.run, samples[0])})  # as a worker does, before the move
    led.mark_failed({ids[0]: ("nonfinite", "NaN at row 3")})
    # What two redis-servers appending to one file left: counters no move made, a failure of a queued sample.
    k = Keys(cfg.run)
    conn.hincrby(k.counts, "d", 6)
    conn.hincrby(k.counts, "f", 5)
    conn.hset(k.failed, ids[1], json.dumps({"reason": "bad-chunks", "message": "claimed by someone else"}))
    url = redis_server.url
    res = harvest_cli("status", "--run", "drift", "--redis", url, "--check")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.splitlines() == [
        "ledger of run drift: 3 inconsistencies (6 samples in the state hash: queued 5, spooled 0, done 0, failed 1)",
        "  count of done: the counters say 6, the state hash holds 0",
        "  count of failed: the counters say 6, the state hash holds 1",
        f"  failed without state: 1 (e.g. {ids[1]})",
    ]
    res = harvest_cli("reconcile", "--run", "drift", "--redis", url)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[0] == (
        "repaired the ledger of run drift from its state hash: count of done: the counters say 6, the state hash "
        f"holds 0; count of failed: the counters say 6, the state hash holds 1; failed without state: 1 (e.g. {ids[1]})"
    )
    res = harvest_cli("status", "--run", "drift", "--redis", url, "--check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == "ledger of run drift: consistent (6 samples: queued 5, spooled 0, done 0, failed 1)\n"
    res = harvest_cli("requeue", "--run", "drift", "--redis", url, "--all", "--dry-run")
    assert res.stdout.splitlines()[:2] == ["would requeue 1 failed samples, 1 nonfinite", f"  {ids[0]}"], res.stdout
