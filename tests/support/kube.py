"""Reading deploy/kubernetes and docker-compose.yml as data, for the tests that hold them together:
the manifests' documents, the pod templates inside workloads (a LeaderWorkerSet's two included),
and each role's command line and environment in one normal form on both sides. Variables are
written `{NAME}` there: compose's `${NAME}`, `${NAME:-default}`, `${NAME:?message}` and
Kubernetes' `$(NAME)` alike, and an environment entry read from a ConfigMap or Secret key K is
`{K}`, so that the two files compare as text."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from typing import Any

import yaml

from tests.support.ops import REPO

KUBE_DIR = os.path.join(REPO, "deploy", "kubernetes")
COMPOSE = os.path.join(REPO, "docker-compose.yml")
ENV_EXAMPLE = os.path.join(REPO, ".env.example")

_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(?::?[-?])[^}]*)?\}")
_KUBE_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def manifest_files() -> list[str]:
    """Every YAML file under deploy/kubernetes but the kustomization files, sorted."""
    out = []
    for root, _, files in os.walk(KUBE_DIR):
        out += [os.path.join(root, f) for f in files if f.endswith(".yaml") and f != "kustomization.yaml"]
    return sorted(out)


def load_all(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def manifests() -> dict[str, list[dict[str, Any]]]:
    """{path relative to deploy/kubernetes: its documents}."""
    return {os.path.relpath(p, KUBE_DIR): load_all(p) for p in manifest_files()}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, pod template) of a workload: 'template', or a LeaderWorkerSet's 'leader' and 'worker'."""
    if doc["kind"] in ("StatefulSet", "Deployment", "Job", "DaemonSet"):
        yield "template", doc["spec"]["template"]
    elif doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for label in ("leader", "worker"):
            if f"{label}Template" in lwt:
                yield label, lwt[f"{label}Template"]


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's init containers (native sidecars among them), then its containers."""
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def kube_argv(container: dict[str, Any]) -> list[str]:
    """command + args, variables in normal form (the image's entrypoint, when kept, is not included:
    compose's `command` leaves it out too)."""
    return [_KUBE_VAR.sub(r"{\1}", str(a)) for a in [*container.get("command", []), *container.get("args", [])]]


def kube_env(container: dict[str, Any]) -> dict[str, str]:
    """{name: value in normal form}; a value read from a ConfigMap or Secret key K is '{K}', the
    pod's name (downward API) '{metadata.name}'."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = _KUBE_VAR.sub(r"{\1}", str(e["value"]))
            continue
        src = e["valueFrom"]
        ref = src.get("configMapKeyRef") or src.get("secretKeyRef")
        out[e["name"]] = "{%s}" % (ref["key"] if ref else src["fieldRef"]["fieldPath"])
    return out


def compose_services() -> dict[str, dict[str, Any]]:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)["services"]  # PyYAML's safe loader applies the `<<` merge keys


def _compose_text(value: Any) -> str:
    return _COMPOSE_VAR.sub(r"{\1}", str(value)).replace("$$", "$")


def compose_argv(service: dict[str, Any]) -> list[str]:
    """entrypoint (when the service sets one) + command, variables in normal form."""
    out = []
    for part in (service.get("entrypoint"), service.get("command")):
        if isinstance(part, str):
            out += shlex.split(_compose_text(part))
        elif part:
            out += [_compose_text(a) for a in part]
    return out


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _compose_text(v) for k, v in env.items()}


def env_file_names() -> set[str]:
    """The variables .env.example sets: the names compose reads the secrets and the run under."""
    names = set()
    for line in open(ENV_EXAMPLE):
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            names.add(line.split("=", 1)[0].strip())
    return names


def split_flags(argv: list[str]) -> tuple[list[str], dict[str, str | bool]]:
    """(the words before the first --flag, {--flag: its value, or True for a bare switch})."""
    head: list[str] = []
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(argv) and not argv[i].startswith("--"):
        head.append(argv[i])
        i += 1
    while i < len(argv):
        flag = argv[i]
        assert flag.startswith("--"), f"a positional word {flag!r} after the flags in {argv}"
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[flag] = argv[i + 1]
            i += 2
        else:
            flags[flag] = True
            i += 1
    return head, flags
