"""tests.support.need: a missing part skips a test with its reason on a person's machine and fails
it under CI=true, where .ci/run was to install it."""

from __future__ import annotations

import pytest

from tests.support.need import need, need_module


def test_a_missing_part_skips_with_its_reason_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^prometheus missing: not installed$"):
        need("prometheus", "not installed")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(
        pytest.fail.Exception, match=r"^prometheus missing: not installed \(CI=true: a part CI is meant to run fails"
    ):
        need("prometheus", "not installed")
    with pytest.raises(
        pytest.fail.Exception, match=r"^SpecForge missing: No module named 'no_such_mod' \(install\) \(CI=true"
    ):
        need_module("no_such_mod", "SpecForge", "install")
    assert need_module("json", "json", "stdlib").dumps([1]) == "[1]"
