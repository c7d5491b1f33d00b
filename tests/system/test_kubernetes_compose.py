"""deploy/kubernetes runs what docker-compose.yml runs: for each role (redis, engine, producer,
metrics, and a node's workers and collector) the same command, the same flags with the same values
and the same environment, both files read as YAML and put in one normal form
(tests/support/kube.py). What may differ is declared here, value for value: where a role finds
another (an address, the dump dir), the LeaderWorkerSet's flags that spread one engine over
several nodes, and `harvest node`, which runs in a Kubernetes node pod what compose runs as its
worker and collector services (`node_from_compose`). A variable a manifest uses must
be set by an earlier environment entry of its container, read from the ConfigMap or Secret key
of the same name (the name .env.example gives it), so `{RUN}` means the same setting on both sides."""

from __future__ import annotations

import copy

import pytest

from tests.support.kube import (
    VAR,
    compose_argv,
    compose_env,
    compose_services,
    containers,
    env_file_names,
    find,
    kube_argv,
    kube_env,
    manifests,
    pod_templates,
    split_flags,
)

# (compose value, Kubernetes value) of what only the addressing changes
ADDRESSES = {
    "--engine-url": ("http://engine:30000", "http://127.0.0.1:30000"),  # the engine is in the worker's pod
    "HARVEST_REDIS_URL": (
        "redis://:{REDIS_PASSWORD}@{REDIS_HOST}:6379/0",
        "redis://:{REDIS_PASSWORD}@harvest-redis:6379/0",
    ),  # the headless Service
    # where the engine writes dumps for harvest node: its default dump dir for the run, as uid 0
    "HARVEST_DUMP_DIR": ("/dumps", "/dev/shm/harvest-0/{RUN}"),
}
# harvest node in a node pod: compose's worker command with `node` for `worker`, less the flags
# harvest node gives its workers itself (dump dir, spool dir, engine wait), plus its own
NODE_DROPS = ("--dump-dir", "--spool-dir", "--engine-wait")
NODE_FLAGS = {"--workers": "3", "--work": "/work", "--stop-grace": "500"}
# SGLang over the nodes of a LeaderWorkerSet group; the controller sets these variables
LWS_FLAGS = {
    "--nnodes": "{LWS_GROUP_SIZE}",
    "--node-rank": "{LWS_WORKER_INDEX}",
    "--dist-init-addr": "{LWS_LEADER_ADDRESS}:20000",
}
LWS_ENV = frozenset({"LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"})
NODE = ("node.yaml", "StatefulSet", "harvest-node", "template")
LEADER = ("multinode/leaderworkerset.yaml", "LeaderWorkerSet", "harvest-node", "leader")
LWS_WORKER = ("multinode/leaderworkerset.yaml", "LeaderWorkerSet", "harvest-node", "worker")
# role, compose service, where the role runs in the manifests (file, kind, name, pod template, container)
ROLES = [
    ("redis", "redis", [("redis.yaml", "StatefulSet", "harvest-redis", "template", "redis")]),
    ("engine", "sglang", [(*NODE, "engine")]),
    ("engine", "sglang", [(*LEADER, "engine"), (*LWS_WORKER, "engine")]),
    ("node", "node", [(*NODE, "node"), (*LEADER, "node")]),
    ("producer", "producer", [("producer.yaml", "Job", "harvest-produce", "template", "producer")]),
    ("metrics", "metrics", [("metrics.yaml", "Deployment", "harvest-metrics", "template", "metrics")]),
]


def container_at(docs: dict, file: str, kind: str, name: str, template: str, container: str) -> dict:
    pod = dict(pod_templates(find(docs[file], kind, name)))[template]["spec"]
    (c,) = [c for c in containers(pod) if c["name"] == container]
    return c


def _undefined(container: dict, injected: frozenset[str]) -> list[str]:
    """Variables used before an env entry sets them: Kubernetes leaves such a $(NAME) as it is."""
    out, defined = [], set(injected)
    for e in container.get("env", []):
        used = VAR.findall(kube_env({"env": [e]})[e["name"]]) if "value" in e else []
        out += [f"env {e['name']} uses {{{v}}}, set by no earlier env entry" for v in used if v not in defined]
        defined.add(e["name"])
    out += [
        f"the command uses {{{v}}}, set by no env entry"
        for a in kube_argv(container)
        for v in VAR.findall(a)
        if v not in defined
    ]
    return out


def differences(
    service: dict, container: dict, extra_flags: dict | None = None, injected: frozenset[str] = frozenset()
) -> list[str]:
    """What differs between a compose service and a Kubernetes container of the same role, as
    lines; [] when they run the same command with the same flags and environment."""
    out = []
    c_head, c_flags = split_flags(compose_argv(service))
    k_head, k_flags = split_flags(kube_argv(container))
    if c_head != k_head:
        out.append(f"command: compose {c_head} != kubernetes {k_head}")
    expected = {**c_flags, **(extra_flags or {})}
    for flag in sorted(set(expected) | set(k_flags)):
        want, got = expected.get(flag), k_flags.get(flag)
        if want != got and ADDRESSES.get(flag) != (want, got):
            out.append(f"flag {flag}: compose {want!r} != kubernetes {got!r}")
    c_env, k_env = compose_env(service), kube_env(container)
    used = " ".join([*kube_argv(container), *k_env.values()])
    for name in sorted(set(c_env) | set(k_env)):
        if name in c_env:
            want, got = c_env[name], k_env.get(name)
            if want != got and ADDRESSES.get(name) != (want, got):
                out.append(f"env {name}: compose {want!r} != kubernetes {got!r}")
        elif name not in env_file_names():
            out.append(f"env {name}: only in kubernetes, and not a setting of .env.example")
        elif k_env[name] not in (f"{{{name}}}", "{metadata.name}" if name == "NODE_NAME" else None):
            out.append(f"env {name}: reads {k_env[name]}, not the key {name}")
        elif f"{{{name}}}" not in used:
            out.append(f"env {name}: set and never used")
    return out + _undefined(container, injected)


@pytest.fixture(scope="module")
def docs() -> dict:
    return manifests()


def node_from_compose(services: dict) -> dict:
    """The compose side of a node pod's `harvest node`: the worker service's command as `harvest
    node` takes it, and the environment of the worker and collector services (the same)."""
    worker, collector = services["worker"], services["collector"]
    assert compose_env(worker) == compose_env(collector)
    argv = list(worker["command"])
    assert argv[0] == "worker"
    argv[0] = "node"
    for flag in NODE_DROPS:
        i = argv.index(flag)
        del argv[i : i + 2]
    for flag, value in NODE_FLAGS.items():
        argv += [flag, value]
    return {**worker, "command": argv}


@pytest.fixture(scope="module")
def services() -> dict:
    services = compose_services()
    return {**services, "node": node_from_compose(services)}


@pytest.mark.parametrize("role, service, places", ROLES, ids=[f"{r[0]}-{r[2][0][0]}" for r in ROLES])
def test_each_role_runs_composes_command_flags_and_environment(docs, services, role, service, places):
    for place in places:
        lws = place[1] == "LeaderWorkerSet"
        extra = LWS_FLAGS if lws and role == "engine" else None
        diff = differences(services[service], container_at(docs, *place), extra, LWS_ENV if lws else frozenset())
        assert diff == [], (role, place)


def test_a_drift_on_either_side_is_found(docs, services):
    def drift(role_service: str, place: tuple, edit_compose=None, edit_kube=None, extra=None) -> list[str]:
        svc, c = copy.deepcopy(services[role_service]), copy.deepcopy(container_at(docs, *place))
        (edit_compose or (lambda s: None))(svc)
        (edit_kube or (lambda c: None))(c)
        return differences(svc, c, extra)

    worker = (*NODE, "node")

    def compose_workers(s):
        s["command"][s["command"].index("--workers") + 1] = "2"

    assert drift("node", worker, edit_compose=compose_workers) == ["flag --workers: compose '2' != kubernetes '3'"]

    def compose_engine_url(s):
        s["command"][s["command"].index("--engine-url") + 1] = "http://engine:30001"

    assert drift("node", worker, edit_compose=compose_engine_url) == [
        "flag --engine-url: compose 'http://engine:30001' != kubernetes 'http://127.0.0.1:30000'"
    ]

    def kube_no_stop_grace(c):
        i = c["args"].index("--stop-grace")
        del c["args"][i : i + 2]

    assert drift("node", (*LEADER, "node"), edit_kube=kube_no_stop_grace) == [
        "flag --stop-grace: compose '500' != kubernetes None"
    ]

    def kube_fsync_always(c):
        c["args"][c["args"].index("everysec")] = "always"

    assert drift(
        "redis", ("redis.yaml", "StatefulSet", "harvest-redis", "template", "redis"), edit_kube=kube_fsync_always
    ) == ["flag --appendfsync: compose 'everysec' != kubernetes 'always'"]

    def kube_radix_cache_on(c):
        c["command"].remove("--disable-radix-cache")

    assert drift("sglang", (*NODE, "engine"), edit_kube=kube_radix_cache_on) == [
        "flag --disable-radix-cache: compose True != kubernetes None"
    ]
    assert drift("sglang", (*LEADER, "engine"))[:1] == [
        "flag --dist-init-addr: compose None != kubernetes '{LWS_LEADER_ADDRESS}:20000'"
    ]

    def compose_new_env(s):
        s["environment"]["HARVEST_SOMETHING"] = "1"

    assert drift(
        "metrics",
        ("metrics.yaml", "Deployment", "harvest-metrics", "template", "metrics"),
        edit_compose=compose_new_env,
    ) == ["env HARVEST_SOMETHING: compose '1' != kubernetes None"]

    producer = ("producer.yaml", "Job", "harvest-produce", "template", "producer")

    def kube_region(c):
        next(e for e in c["env"] if e["name"] == "AWS_REGION")["value"] = "eu-west-1"

    assert drift("producer", producer, edit_kube=kube_region) == [
        "env AWS_REGION: compose 'us-east-1' != kubernetes 'eu-west-1'"
    ]

    def kube_wrong_key(c):
        next(e for e in c["env"] if e["name"] == "DTYPE")["valueFrom"]["configMapKeyRef"]["key"] = "LAYERS"

    assert drift("producer", producer, edit_kube=kube_wrong_key) == ["env DTYPE: reads {LAYERS}, not the key DTYPE"]

    def kube_run_unset(c):
        c["env"] = [e for e in c["env"] if e["name"] != "RUN"]

    assert drift("node", worker, edit_kube=kube_run_unset) == ["the command uses {RUN}, set by no env entry"]

    def kube_password_after_url(c):
        c["env"].sort(key=lambda e: e["name"] != "HARVEST_REDIS_URL")

    assert drift("node", worker, edit_kube=kube_password_after_url) == [
        "env HARVEST_REDIS_URL uses {REDIS_PASSWORD}, set by no earlier env entry"
    ]


def test_every_setting_read_is_in_the_configmap_or_secret_and_every_one_there_is_read(docs):
    config = find(docs["run-config.yaml"], "ConfigMap", "harvest-run")["data"]
    secret = find(docs["secret.yaml"], "Secret", "harvest-secrets")["stringData"]
    assert set(config) | set(secret) <= env_file_names()
    read = {"configMapKeyRef": set(), "secretKeyRef": set()}
    for file_docs in docs.values():
        for doc in file_docs:
            for _, template in pod_templates(doc):
                for c in containers(template["spec"]):
                    for e in c.get("env", []):
                        for kind, ref in e.get("valueFrom", {}).items():
                            if kind in read:
                                read[kind].add(ref["key"])
                                assert (
                                    ref["name"]
                                    == {"configMapKeyRef": "harvest-run", "secretKeyRef": "harvest-secrets"}[kind]
                                )
    assert read["configMapKeyRef"] == set(config)
    assert read["secretKeyRef"] == set(secret)
