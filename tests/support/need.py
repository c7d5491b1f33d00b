"""A part a test cannot run without: skipped with the reason on a person's machine, failed in CI.

.ci/run installs every part the suite is meant to run (the trainer packages, Prometheus, the XFS
tools, docker-compose, SLURM, the engine venvs) and runs the suite with CI=true. There a missing part is
a broken CI, not a reason to go green without the test: `need` fails the test, naming the part
and why. Elsewhere it skips, saying the same, so a developer without, say, the vLLM venv still
runs the rest of the suite.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """CI=true, as .ci/run and the common CI services set it."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def need(thing: str, why: str, *, module: bool = False) -> NoReturn:
    """The test cannot run: `thing` is missing, because `why`. Skips it (its whole module with
    `module`, at import) or, under CI=true, fails it."""
    message = f"{thing} missing: {why}"
    if in_ci():
        pytest.fail(
            f"{message} (CI=true: a part CI is meant to run fails the test, it does not skip it)", pytrace=False
        )
    pytest.skip(message, allow_module_level=module)


def need_module(name: str, thing: str, why: str) -> ModuleType:
    """The module `name`, imported; else `need(thing, ...)` with the import error and `why`."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        need(thing, f"{e} ({why})")
