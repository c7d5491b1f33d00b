"""The docker-compose deployment: `docker-compose config -q` accepts it and its CI form (when a
compose binary is installed), the deployment's structural promises hold in the file itself, and the
CI override (compose.ci.yml) puts everything CI starts on the host network and changes nothing
but addresses. scripts/compose_ci.sh runs the deployment for real (from .ci/run)."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import yaml

from harvest.config import eagle3_layers
from tests.support.need import need
from tests.support.ops import REPO

COMPOSE = os.path.join(REPO, "docker-compose.yml")
ENV_EXAMPLE = os.path.join(REPO, ".env.example")
COMPOSE_CI = os.path.join(REPO, "compose.ci.yml")
CI_PROFILES = (None, "cpu", "producer")  # what scripts/compose_ci.sh starts


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.fixture
def compose() -> list[str]:
    """The compose command; a test that needs it is skipped (failed under CI=true) without one."""
    cmd = _compose_cmd()
    if cmd is None:
        need(
            "docker-compose or `docker compose` on PATH",
            "the test validates docker-compose.yml with it (.ci/run installs Debian's docker-compose)",
        )
    return cmd


@pytest.fixture(scope="module")
def spec() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def _env_example() -> dict[str, str]:
    out = {}
    for line in open(ENV_EXAMPLE):
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


@pytest.mark.usefixtures("compose")
def test_compose_config_is_valid_and_needs_the_env_file(tmp_path):
    cmd = _compose_cmd()
    for files in (["-f", COMPOSE], ["-f", COMPOSE, "-f", COMPOSE_CI]):
        for profile in ([], ["--profile", "cpu"], ["--profile", "gpu"], ["--profile", "producer"]):
            res = subprocess.run(
                [*cmd, *files, "--env-file", ENV_EXAMPLE, *profile, "config", "-q"],
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            assert res.returncode == 0, res.stderr
    # Without the secrets, compose refuses to start rather than run with a default password.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    res = subprocess.run(
        [*cmd, "-f", COMPOSE, "--env-file", str(empty), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k not in _env_example()},
    )
    assert res.returncode != 0 and "set REDIS_PASSWORD in .env" in res.stderr + res.stdout


def test_structural_promises(spec):
    s = spec["services"]
    assert {"redis", "s3", "s3-bucket", "sglang", "engine", "worker", "collector", "dashboard", "producer"} <= set(s)

    # redis: AOF, noeviction, healthcheck, a volume for its data
    redis_cmd = s["redis"]["command"]
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    assert "healthcheck" in s["redis"] and any(v.endswith(":/data") for v in s["redis"]["volumes"])

    # scalable workers: no fixed name, no host port; SIGTERM gets time to finish the job
    assert "container_name" not in s["worker"] and "ports" not in s["worker"]
    assert "stop_grace_period" in s["worker"]
    assert not any("container_name" in svc for svc in s.values())

    # every image pinned (no :latest, no bare name)
    images = [svc["image"] for svc in s.values() if "image" in svc and "build" not in svc]
    images += [svc["build"]["args"]["SGLANG_IMAGE"] for svc in s.values() if "args" in svc.get("build", {})]
    assert images
    for img in images:
        name, _, tag = img.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), f"{img} is not pinned"
    assert not any(i.startswith("minio/minio") for i in images)  # gone from Docker Hub
    dockerfile = open(os.path.join(REPO, "Dockerfile")).read()
    assert f"ARG SGLANG_IMAGE={s['sglang']['build']['args']['SGLANG_IMAGE']}" in dockerfile
    assert "rq-dashboard==" in dockerfile and "rq==" in dockerfile

    # the object store and its bucket
    assert "healthcheck" in s["s3"]
    assert "mc mb" in " ".join(s["s3-bucket"]["command"])
    assert s["s3-bucket"]["depends_on"]["s3"]["condition"] == "service_healthy"

    # sglang: plugin on, the flags the dump needs, GPU, ipc host, long start period, shared dumps
    g = s["sglang"]
    assert g["profiles"] == ["gpu"] and g["ipc"] == "host" and g["build"]["target"] == "sglang"
    assert g["environment"]["SGLANG_PLUGINS"] == "harvest" and g["environment"]["HARVEST_DUMP_DIR"] == "/dumps"
    dev = g["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    assert _minutes(g["healthcheck"]["start_period"]) >= 10
    assert "engine" in g["networks"]["default"]["aliases"]

    # cpu profile swaps in the reference engine under the same name
    assert s["engine"]["profiles"] == ["cpu"] and s["engine"]["command"][0] == "engine"
    assert "healthcheck" in s["engine"]
    assert "http://engine:30000" in s["worker"]["command"]
    assert s["producer"]["profiles"] == ["producer"] and s["producer"]["restart"] == "no"
    for name in ("worker", "collector", "dashboard", "redis", "s3"):
        assert "profiles" not in s[name], name

    # shared volumes: dumps between engines and workers (in memory), spool between workers and collector
    def vols(name):
        return {v.split(":")[0] for v in s[name].get("volumes", [])}

    assert "dumps" in vols("sglang") & vols("engine") & vols("worker")
    assert "spool" in vols("worker") & vols("collector")
    assert spec["volumes"]["dumps"]["driver_opts"]["type"] == "tmpfs"

    # rq-dashboard reads the JSON-serialized jobs
    assert "--json" in s["dashboard"]["command"]


def test_sglang_flags_match_harvest_sglang_args(spec):
    """The compose command is what `harvest sglang-args` prints for the same run (one source of truth)."""
    from harvest.engines.sglang_launch import launch_spec

    env, args = launch_spec("/models/m", eagle3_layers(8), 8, dump_dir="/dumps", port=30000, sglang_version="0.5.23")
    compose_args = spec["services"]["sglang"]["command"].split()
    flags = {a for a in args if a.startswith("--")}
    assert flags - {"--host"} <= set(compose_args), flags - set(compose_args)
    assert set(env) <= set(spec["services"]["sglang"]["environment"])
    assert spec["services"]["sglang"]["build"]["args"]["SGLANG_IMAGE"].endswith("v0.5.23")


def test_secrets_come_from_the_env_file(spec):
    raw = open(COMPOSE).read()
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", raw))
    example = _env_example()
    assert used <= set(example), f"variables missing from .env.example: {used - set(example)}"
    for secret in ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY"):
        assert example[secret] and example[secret] not in raw  # no value inline in the compose file
    assert ".env" in open(os.path.join(REPO, ".gitignore")).read().split()


def _minutes(v: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m|h)", v)
    assert m, v
    return int(m.group(1)) * {"s": 1 / 60, "m": 1, "h": 60}[m.group(2)]


# --- the CI form: compose.ci.yml over docker-compose.yml --------------------------------------------


def _config(*files: str) -> dict:
    cmd = _compose_cmd()
    args = [a for f in files for a in ("-f", f)]
    res = subprocess.run([*cmd, *args, "--env-file", ENV_EXAMPLE, "config"], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def _render(config: dict) -> dict:
    spec = importlib.util.spec_from_file_location("compose_ci", os.path.join(REPO, "scripts", "compose_ci.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.render(config)


def _ci_started(svc: dict) -> bool:
    return any(p in CI_PROFILES for p in svc.get("profiles", [None]))


@pytest.mark.usefixtures("compose")
def test_ci_form_is_all_host_network_on_loopback():
    """The workplace rule: no bridge, no private-range network. Every service CI starts is on the
    host network, builds on it, listens on 127.0.0.1 at a port of its own; no network is created."""
    merged = _render(_config(COMPOSE, COMPOSE_CI))
    assert merged["networks"]["default"] == {"external": True, "name": "host"}
    started = {n: s for n, s in merged["services"].items() if _ci_started(s)}
    assert {"redis", "s3", "s3-bucket", "engine", "worker", "collector", "metrics", "dashboard", "producer"} <= set(
        started
    )
    ports = {}
    for name, svc in started.items():
        assert svc.get("network_mode") == "host", name
        assert "ports" not in svc and "networks" not in svc, name
        if "build" in svc:
            assert (
                svc["build"]["network"] == "host" and svc["build"]["args"]["BASE_IMAGE"] == "local/debian:bookworm"
            ), name
        text = (
            " ".join(map(str, svc.get("command") or [])) if not isinstance(svc.get("command"), str) else svc["command"]
        )
        for flag in ("--port", "-p"):
            toks = text.split()
            if flag in toks:
                ports[name] = toks[toks.index(flag) + 1]
        assert "0.0.0.0" not in text, name  # nothing listens beyond loopback
    assert ports == {"redis": "16379", "s3": "16900", "engine": "16000", "metrics": "16108", "dashboard": "16181"}
    assert "6379" not in ports.values()  # the machine's own Redis
    env = started["worker"]["environment"]
    assert (
        env["HARVEST_REDIS_URL"].endswith("@127.0.0.1:16379/0")
        and env["HARVEST_S3_ENDPOINT"] == "http://127.0.0.1:16900"
    )
    assert "http://127.0.0.1:16000" in started["worker"]["command"]
    # the production file keeps its networks and ports
    base = _config(COMPOSE)
    assert "network_mode" not in base["services"]["worker"] and base["services"]["redis"]["ports"]
    assert "engine" in base["services"]["sglang"]["networks"]["default"]["aliases"]


# Tokens an address change may touch: host:port pairs, URLs, bare ports, loopback/any addresses,
# and the flags that name them.
_ADDRESS = re.compile(r"^(\d+|127\.0\.0\.1|0\.0\.0\.0|localhost|--bind|--port|--addr|--host|-p|.*://.*|.*:\d+.*)$")
_ADDRESS_ENV = {"HARVEST_REDIS_URL", "HARVEST_S3_ENDPOINT", "RQ_DASHBOARD_REDIS_URL"}
_CI_PACE_ENV = {"HARVEST_ENGINE_FAULTS": "hang", "HARVEST_ENGINE_HANG_S": "6"}  # the engine's pace, declared


def _sorted_volumes(svc: dict) -> dict:
    return {**svc, "volumes": sorted(svc.get("volumes", []))}  # compose merges them in no fixed order


def _tokens(v) -> list[str]:
    if v is None:
        return []
    return v.split() if isinstance(v, str) else [t for x in v for t in str(x).split()]


def _only_addresses(base, ci, where: str) -> None:
    a, b = _tokens(base), _tokens(ci)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            changed = a[i1:i2] + b[j1:j2]
            assert all(_ADDRESS.match(t) for t in changed), f"{where}: {a[i1:i2]} -> {b[j1:j2]} is not an address"


@pytest.mark.usefixtures("compose")
def test_ci_override_changes_nothing_but_addresses():
    base, ci = _config(COMPOSE)["services"], _render(_config(COMPOSE, COMPOSE_CI))["services"]
    assert set(base) == set(ci)
    for name, b in base.items():
        c = ci[name]
        if name in ("s3", "s3-bucket"):  # moto's server from the harvest image stands in for MinIO
            assert c["image"] == "harvest:local" and "build" not in c
            continue
        if not _ci_started(c):
            assert _sorted_volumes(c) == _sorted_volumes(b), name
            continue
        _only_addresses(b.get("command"), c.get("command"), f"{name} command")
        _only_addresses(
            b.get("healthcheck", {}).get("test"), c.get("healthcheck", {}).get("test"), f"{name} healthcheck"
        )
        be, ce = b.get("environment", {}), c.get("environment", {})
        for k in set(be) | set(ce):
            if be.get(k) != ce.get(k):
                assert k in _ADDRESS_ENV or _CI_PACE_ENV.get(k) == ce.get(k), f"{name}: env {k} changed"
                if k in _ADDRESS_ENV:
                    _only_addresses(re.sub(r"[@/]", " ", be[k]), re.sub(r"[@/]", " ", ce[k]), f"{name} env {k}")
        if "build" in b:
            assert {k: v for k, v in c["build"].items() if k not in ("network", "args")} == b["build"], name
        skip = {"command", "healthcheck", "environment", "build", "ports", "network_mode", "networks"}

        rest = {k: v for k, v in _sorted_volumes(c).items() if k not in skip}
        assert rest == {k: v for k, v in _sorted_volumes(b).items() if k not in skip}, name
        hc_b, hc_c = b.get("healthcheck", {}), c.get("healthcheck", {})
        assert set(hc_c) == set(hc_b), name
