"""The suite's xdist groups hold on the installed pytest-xdist: a tiny pytest session on two workers
(`--dist loadgroup`, as pyproject.toml's addopts run the suite) over generated test files, with this
suite's own tests/conftest.py. Its `pytest_collection_modifyitems` marks the ONE_WORKER files
`xdist_group` and must run before xdist's own hook, which turns the marks into the node ids the
scheduler groups by; a file's own `pytestmark = pytest.mark.xdist_group(...)` is the other route.
Every test of a group must run on one worker, while the session uses both. (Checked by hand that
it fails when the conftest's hook runs after xdist's: the ONE_WORKER file's tests then spread.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict

from tests.support.cli import REPO

TESTS = 8  # per file: a split group would show

RECORD = """
import os


def _ran(name):
    with open(os.path.join(os.environ["GROUPS_OUT"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))
"""


def _file(stem: str, head: str = "") -> str:
    tests = "".join(f"\n\ndef test_{k}():\n    _ran('{stem}::{k}')\n" for k in range(TESTS))
    return f"import pytest\n{RECORD}{head}{tests}"


def test_grouped_files_run_on_one_worker_each(tmp_path):
    root = tmp_path / "tests"
    (root / "system").mkdir(parents=True)
    (root / "unit").mkdir()
    shutil.copy(os.path.join(REPO, "tests", "conftest.py"), root / "conftest.py")
    (root / "system" / "test_trainers.py").write_text(_file("one_worker"))  # a ONE_WORKER file of the conftest
    (root / "system" / "test_marked.py").write_text(_file("marked", '\npytestmark = pytest.mark.xdist_group("mine")\n'))
    (root / "unit" / "test_free.py").write_text(_file("free"))
    (root / "unit" / "test_free2.py").write_text(_file("free2"))
    out = tmp_path / "ran"
    out.mkdir()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "--no-loadscope-reorder",
            "-q",
            str(root),
        ],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
            "PYTHONPATH": REPO,
            "GROUPS_OUT": str(out),
        },
    )
    assert res.returncode == 0, res.stdout + res.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    for name in os.listdir(out):
        workers[name.split("::")[0]].add((out / name).read_text())
    assert len(os.listdir(out)) == 4 * TESTS, sorted(os.listdir(out))
    assert len(workers["one_worker"]) == 1, workers
    assert len(workers["marked"]) == 1, workers
    assert set().union(*workers.values()) == {"gw0", "gw1"}, workers  # the session did use both workers
