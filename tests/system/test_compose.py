"""The docker-compose deployment: `docker-compose config -q` accepts it (when a compose binary is
installed), and the structural promises of issue 6 hold in the file itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from harvest.config import eagle3_layers
from tests.support.ops import REPO

COMPOSE = os.path.join(REPO, "docker-compose.yml")
ENV_EXAMPLE = os.path.join(REPO, ".env.example")


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


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


@pytest.mark.skipif(_compose_cmd() is None, reason="no docker-compose or `docker compose` on PATH")
def test_compose_config_is_valid_and_needs_the_env_file(tmp_path):
    cmd = _compose_cmd()
    for profile in ([], ["--profile", "cpu"], ["--profile", "gpu"], ["--profile", "producer"]):
        res = subprocess.run([*cmd, "-f", COMPOSE, "--env-file", ENV_EXAMPLE, *profile, "config", "-q"],
                             capture_output=True, text=True, cwd=REPO)
        assert res.returncode == 0, res.stderr
    # Without the secrets, compose refuses to start rather than run with a default password.
    empty = tmp_path / "empty.env"
    empty.write_text("")
    res = subprocess.run([*cmd, "-f", COMPOSE, "--env-file", str(empty), "config", "-q"], capture_output=True,
                         text=True, cwd=str(tmp_path), env={k: v for k, v in os.environ.items()
                                                            if k not in _env_example()})
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
    from engines.sglang_launch import launch_spec

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
