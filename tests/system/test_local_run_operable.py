"""A finished local `harvest run` stays operable: its summary's commands work as printed (from
another folder, after the run's private Redis stopped), its failures can be requeued and the same
command extracts them, it is exported from another folder (the model and the output are stored
absolute), its summary counts what the index files hold, a rerun with nothing to do starts no
engine, and a rejected configuration leaves nothing behind."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from harvest.cli.demo import demo_rows, write_jsonl
from harvest.read.reader import RunReader
from tests.support.cli import REPO

# One finished run, built once per worker and shared by the module's tests (each stands alone: the
# fixture brings the run to the state every test starts from, and no test changes it).
pytestmark = pytest.mark.xdist_group("local_run_operable")

RUN = "ops"


def _cli(*args: str, cwd: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`harvest ...` typed in `cwd` (its own session: whatever it starts goes with it)."""
    return subprocess.run(
        [sys.executable, "-m", "harvest.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        timeout=timeout,
        start_new_session=True,
    )


def _printed(stdout: str, label: str) -> list[str]:
    """The command the summary prints after `label:` (up to two spaces and a note), as argv."""
    line = next(x for x in stdout.splitlines() if x.strip().startswith(f"{label}: harvest "))
    command = line.split(": ", 1)[1].split("  (")[0]
    return shlex.split(command)


STATUS = ["harvest", "status", "--run", RUN, "--work-dir"]  # + the run's work dir, absolute
REQUEUE = ["harvest", "requeue", "--run", RUN, "--work-dir"]  # + the work dir, "--all"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model):
    """A run typed with relative paths in its own folder, two of whose samples fail (the engine's
    test-only `nan` fault), then operated as its summary says, from another folder after its Redis
    stopped: `status`, `status --check`, `runs`, `requeue --all`, and the same run command again,
    which extracts the two. Every step's output is kept, and the fixture ends on a finished run with
    nothing failed, whichever of the module's tests runs first, alone or on any xdist worker."""
    home = tmp_path_factory.mktemp("ops")
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # another folder, long after the run's Redis stopped
    os.symlink(tiny_model, home / "tiny")
    write_jsonl(str(home / "data.jsonl"), demo_rows(10, seed=5))
    args = [
        "run",
        "data.jsonl",
        "--model",
        "tiny/",
        "--out",
        "out",
        "--run",
        RUN,
        "--work-dir",
        "work",
        "--dump-dir",
        str(home / "dumps"),
        "--no-progress",
    ]
    work = str(home / "work")
    first = _cli(*args, cwd=str(home), env={"HARVEST_ENGINE_FAULTS": "nan:2"})
    status = [*STATUS, work]
    steps = {
        "status": _cli(*status[1:], cwd=str(elsewhere)),
        "check": _cli(*status[1:], "--check", cwd=str(elsewhere)),
        "runs": _cli("runs", "--work-dir", work, cwd=str(elsewhere)),
        "requeue": _cli(*REQUEUE[1:], work, "--all", cwd=str(elsewhere)),
    }
    again = _cli(*args, cwd=str(home))  # the same command, no fault now: extracts the two
    return {"home": home, "args": args, "first": first, "steps": steps, "again": again}


def test_the_summary_prints_commands_that_work_as_printed_and_requeue_the_failures(finished):
    home, first, steps = finished["home"], finished["first"], finished["steps"]
    assert first.returncode == 1, first.stdout + first.stderr
    assert "failed because nonfinite: 2" in first.stdout
    work = str(home / "work")
    # the fixture ran these very commands: the summary prints them so
    assert _printed(first.stdout, "status") == [*STATUS, work]
    assert _printed(first.stdout, "requeue the failed") == [*REQUEUE, work, "--all"]
    res = steps["status"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert "failed 2" in res.stdout and "nonfinite: 2" in res.stdout
    res = steps["check"]
    assert res.returncode == 0 and res.stdout.startswith(f"ledger of run {RUN}: consistent ("), res.stdout + res.stderr
    res = steps["runs"]
    assert res.returncode == 0 and RUN in res.stdout, res.stdout + res.stderr
    res = steps["requeue"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("requeued 2 failed samples in ") and res.stdout.endswith(" jobs, 2 nonfinite\n"), (
        res.stdout
    )
    again = finished["again"]
    assert again.returncode == 0, again.stdout + again.stderr
    n = len(RunReader(str(home / "out" / RUN)))
    assert f"samples: {n} done, 0 failed (0 enqueued now, {n} already known)" in again.stdout
    assert "requeue the failed" not in again.stdout


def test_a_finished_run_exports_from_another_folder(finished, tmp_path):
    home = finished["home"]
    doc = json.loads((home / "out" / RUN / "run.json").read_text())
    assert doc["model"] == os.path.abspath(home / "tiny") and doc["out_url"] == str(home / "out")
    first_line = finished["first"].stdout.splitlines()[0]
    assert first_line == f"run {RUN} -> {home / 'out'}"
    # speculators reads the final norm from the run's model path: relative, it would not be found here
    res = _cli(
        "export",
        "--run-url",
        str(home / "out" / RUN),
        "--format",
        "speculators",
        "exp",
        "--no-progress",
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-1].startswith("exported ")


def test_the_summary_counts_tokens_from_the_index_files(finished):
    home = finished["home"]
    reader = RunReader(str(home / "out" / RUN))
    tokens = sum(len(reader.get(s)["input_ids"]) for s in reader.sample_ids)
    res = _cli(*finished["args"], cwd=str(home))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"  tokens: {tokens}, bytes: " in res.stdout


def test_a_rerun_with_nothing_to_do_starts_no_engine(finished):
    home = finished["home"]
    log = home / "work" / "logs" / "engine.log"
    before = log.stat().st_size
    res = _cli(*finished["args"], cwd=str(home))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "  nothing to extract: no engine or worker was started" in res.stdout
    assert log.stat().st_size == before  # the engine was not started: its log did not grow


def test_a_rejected_configuration_leaves_nothing_behind(finished):
    home = finished["home"]
    args = list(finished["args"])
    args[args.index("--out") + 1] = "o4"
    res = _cli(*args, "--layers", "2,4,6", cwd=str(home))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith(
        f"harvest: error: run {RUN!r} already exists with a different configuration in Redis key "
    ), res.stderr
    assert "capture_points: [2, 4, 5, 8] there, [2, 4, 6] now" in res.stderr
    assert not (home / "o4").exists()  # no run.json in the new output
