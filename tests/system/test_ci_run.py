""".ci/run's own rules, run for real on a copy of the script whose every installer and tool is a stub
on PATH (no apt-get, pip or pytest runs): under CI=true a part that cannot be installed fails the
script before the tests, naming the part; without CI=true it warns and the tests run; pytest's exit
status is the script's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import REPO

STUB = '#!/bin/sh\necho "$(basename "$0") $*" >> "$CALLS"\nexit 0\n'
# python3 -m pytest exits with $PYTEST_RC; everything else python3 is asked (pip, the torch check) works
PYTHON = (
    '#!/bin/sh\necho "python3 $*" >> "$CALLS"\nif [ "$1 $2" = "-m pytest" ]; then exit "${PYTEST_RC:-0}"; fi\nexit 0\n'
)


def _ci_run(tmp_path: Path, failing: str | None, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """.ci/run in a copy of the repository's layout, script `failing` (under scripts/) exiting 1."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, ".ci", "run"), repo / ".ci" / "run")
    for name in ("vllm_venv.sh", "sglang_venv.sh", "trainer_pkgs.sh", "compose_ci.sh"):
        (repo / "scripts" / name).write_text(STUB.replace("exit 0", "exit 1") if name == failing else STUB)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("redis-server", "docker-compose", "prometheus", "promtool", "mkfs.xfs", "apt-get"):
        (bin_ / tool).write_text(STUB)
    (bin_ / "python3").write_text(PYTHON)
    for p in [*bin_.iterdir(), *(repo / "scripts").iterdir()]:
        p.chmod(0o755)
    calls = tmp_path / "calls"
    calls.touch()
    res = subprocess.run(
        ["bash", str(repo / ".ci" / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": f"{bin_}:/usr/bin:/bin",
            "CALLS": str(calls),
            "HOME": str(tmp_path),
            "TMPDIR": str(tmp_path),
            **env,
        },
    )
    return res, calls.read_text().splitlines()


def test_under_ci_a_part_that_cannot_be_installed_fails_the_run_naming_it(tmp_path):
    res, calls = _ci_run(tmp_path, "vllm_venv.sh", {"CI": "true"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "ci: FAIL: CI=true and the vLLM venv (scripts/vllm_venv.sh) could not be installed or started\n" in res.stderr
    )
    assert not [c for c in calls if c.startswith("python3 -m pytest")]  # the tests were not started
    assert "compose_ci.sh " not in calls


@pytest.mark.parametrize("failing", ["trainer_pkgs.sh", "sglang_venv.sh"])
def test_without_ci_a_missing_part_warns_and_the_tests_run(tmp_path, failing):
    res, calls = _ci_run(tmp_path, failing, {})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "could not be installed or started;" in res.stderr and "ci: FAIL" not in res.stderr
    assert "python3 -m pytest -q -rs" in calls and "compose_ci.sh " in calls


@pytest.mark.parametrize("ci", [{"CI": "true"}, {}])
def test_pytests_exit_status_is_the_runs(tmp_path, ci):
    res, calls = _ci_run(tmp_path, None, {**ci, "PYTEST_RC": "1"})
    assert res.returncode == 1 and "python3 -m pytest -q -rs" in calls, res.stdout + res.stderr
    assert "compose_ci.sh " not in calls  # a failed suite ends the run
    res, calls = _ci_run(tmp_path / "green", None, {**ci, "PYTEST_RC": "0"})
    assert res.returncode == 0 and "compose_ci.sh " in calls, res.stdout + res.stderr
