"""What an install of harvest puts into site-packages: one top-level package, `harvest`, with the
wings inside it (pyproject.toml's package-dir), and every package of the tree listed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

from tests.support.cli import REPO
from tests.support.house import WINGS


def _setuptools() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _tree_packages() -> set[str]:
    """Every folder holding an __init__.py, named as it is imported."""
    out = set()
    for top in ("harvest", *WINGS):
        for d, dirs, names in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if "__init__.py" in names:
                mod = os.path.relpath(d, REPO).replace(os.sep, ".")
                out.add(mod if top == "harvest" else f"harvest.{mod}")
    return out


def test_every_package_of_the_tree_is_listed():
    assert set(_setuptools()["packages"]) == _tree_packages()


def test_a_wheel_adds_only_harvest_to_site_packages(tmp_path):
    # built from a copy of what the wheel is made of: no build/ left in the checkout, none reused
    src = tmp_path / "src"
    for part in ("harvest", *WINGS):
        shutil.copytree(os.path.join(REPO, part), src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, f), src / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("harvest-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"harvest", "harvest-0.1.0.dist-info"}
    for wing in WINGS:
        assert f"harvest/{wing}/__init__.py" in names
    assert "harvest/workers/clients/__init__.py" in names
    assert "harvest/state/lua/settle.lua" in names
    entry = zipfile.ZipFile(wheel).read("harvest-0.1.0.dist-info/entry_points.txt").decode()
    assert "harvest = harvest.engines.sglang_plugin:register" in entry
