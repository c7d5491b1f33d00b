"""The S3 stack's bounds in pyproject.toml fit together, so pip resolves them without backtracking:
the newest allowed of each is compatible with the newest allowed of the others. What the installed
set (on which the suite passes) declares is the evidence: aiobotocore's own botocore range ends
where harvest's botocore and boto3 bounds end, s3fs's fsspec where harvest's fsspec bound does."""

import importlib.metadata as md
import os
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.support.cli import REPO


def _pyproject() -> dict[str, SpecifierSet]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    return {r.name.lower(): r.specifier for r in reqs}


def _upper(spec: SpecifierSet) -> str:
    (bound,) = [s.version for s in spec if s.operator == "<"]
    return bound


def _requires(package: str, dependency: str) -> SpecifierSet:
    for r in map(Requirement, md.requires(package) or []):
        if r.name.lower() == dependency and not r.marker:
            return r.specifier
    raise AssertionError(f"{package} does not require {dependency}")


def test_every_package_of_the_s3_stack_is_bounded_above_and_the_installed_set_is_within():
    ours = _pyproject()
    for name in ("fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "moto"):
        assert _upper(ours[name]), name
        assert md.version(name) in ours[name], (name, md.version(name), str(ours[name]))


def test_the_bounds_end_where_the_newest_allowed_releases_meet():
    ours = _pyproject()
    # aiobotocore pins botocore: harvest's botocore (and boto3, whose patch needs a botocore at least
    # as new) end exactly where the installed aiobotocore's botocore range ends
    assert _upper(_requires("aiobotocore", "botocore")) == _upper(ours["botocore"]) == _upper(ours["boto3"])
    # s3fs pins fsspec to its own release: both end at the same release
    assert _upper(ours["fsspec"]) == _upper(ours["s3fs"])
    assert md.version("fsspec") in _requires("s3fs", "fsspec")
    assert md.version("aiobotocore") in _requires("s3fs", "aiobotocore")
