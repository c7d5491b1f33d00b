"""The compose CI takes moto's version from one place, the host's installed moto: compose.ci.yml
names none, and the image builds' pip constraints (the host's versions) pin it, so a host with
another moto builds images with that one instead of failing on a pin it cannot satisfy."""

import importlib.metadata
import importlib.util
import os
import re

import pytest
import yaml

from tests.support.cli import REPO


def _helper():
    spec = importlib.util.spec_from_file_location("compose_ci", os.path.join(REPO, "scripts", "compose_ci.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_compose_file_or_script_pins_moto():
    with open(os.path.join(REPO, "compose.ci.yml")) as f:
        text = f.read()
    assert yaml.safe_load(text)["x-ci-harvest"]["build"]["args"]["EXTRA_PACKAGES"] == "moto[server]"
    for name in ("compose.ci.yml", "docker-compose.yml", "Dockerfile", "scripts/compose_ci.sh"):
        with open(os.path.join(REPO, name)) as f:
            assert not re.search(r"moto[^\s]*[=<>~]=", f.read()), name


def test_the_image_constraints_pin_the_hosts_moto_whatever_it_is():
    ci = _helper()
    here = ci.host_constraints()
    assert f"moto=={importlib.metadata.version('moto')}\n" in here.splitlines(keepends=True)
    other = ci.host_constraints("boto3==1.40.1\nMoto==5.1.4\n-e git+https://x#egg=harvest\nflask==3.1.0\n")
    assert other == "boto3==1.40.1\nMoto==5.1.4\nflask==3.1.0\n"
    with pytest.raises(SystemExit) as e:
        ci.host_constraints("boto3==1.40.1\n")
    assert str(e.value) == (
        "compose_ci.py: moto not installed here: the CI images take its version from this host; "
        "pip install -e '.[dev]' first"
    )
