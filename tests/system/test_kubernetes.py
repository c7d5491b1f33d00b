"""deploy/kubernetes, checked offline (no cluster runs it here): every core object validates against
the Kubernetes 1.37 schemas that kubernetes-validate ships (strict: an unknown field is an error),
the two custom resources against their CRDs' fields (tests/support/kube_checks.py, by hand, and a
LeaderWorkerSet's pod templates against the core schema), the references between objects resolve,
and `kubectl kustomize` renders the base and its components into exactly those objects."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from types import ModuleType

import pytest
import yaml

from tests.support.kube import KUBE_DIR, find, kube_env, manifest_files, manifests, pod_templates
from tests.support.kube_checks import leaderworkerset_problems, reference_problems, servicemonitor_problems
from tests.support.need import need, need_module

K8S_VERSION = "1.37"  # the newest Kubernetes release whose schemas kubernetes-validate ships
CRD_KINDS = {"LeaderWorkerSet": leaderworkerset_problems, "ServiceMonitor": servicemonitor_problems}
BASE = ["secret.yaml", "run-config.yaml", "redis.yaml", "producer.yaml", "node.yaml", "metrics.yaml"]
COMPONENTS = {"servicemonitor": ["servicemonitor/servicemonitor.yaml"], "multinode": ["multinode/leaderworkerset.yaml"]}


@pytest.fixture(scope="module")
def kv() -> ModuleType:
    return need_module(
        "kubernetes_validate",
        "kubernetes-validate",
        "the Kubernetes schemas the manifests are validated against (pip install -e '.[dev]')",
    )


def problems(kv: ModuleType, doc: dict) -> list[str]:
    """Why the API server of Kubernetes 1.37 (with the two CRDs installed) would refuse `doc`."""
    if doc["kind"] in CRD_KINDS:
        out = CRD_KINDS[doc["kind"]](doc)
        for label, template in pod_templates(doc):
            out += [
                f"{label}Template: {p}"
                for p in problems(
                    kv, {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
                )
            ]
        return out
    try:
        assert kv.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION
    except kv.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


def deployment(parts: tuple[str, ...] = ()) -> list[dict]:
    """The objects of the base with these components, as kustomize composes them from the files."""
    docs = manifests()
    files = BASE + [f for p in parts for f in COMPONENTS[p]]
    out = [d for f in files for d in docs[f]]
    if "multinode" in parts:  # its patches delete node.yaml's StatefulSet and Service
        out = [d for d in out if d["metadata"]["name"] != "harvest-node" or d["kind"] == "LeaderWorkerSet"]
    return out


def test_the_kustomization_lists_every_manifest():
    def listed(folder: str) -> list[str]:
        with open(os.path.join(KUBE_DIR, folder, "kustomization.yaml")) as f:
            return [os.path.join(folder, r) if folder else r for r in yaml.safe_load(f)["resources"]]

    files = [os.path.relpath(f, KUBE_DIR) for f in manifest_files()]
    assert sorted(listed("") + listed("servicemonitor") + listed("multinode")) == sorted(files)
    assert listed("") == BASE


@pytest.mark.parametrize("path", [os.path.relpath(f, KUBE_DIR) for f in manifest_files()])
def test_every_object_passes_the_kubernetes_1_37_schemas(kv, path):
    docs = manifests()[path]
    assert docs
    assert {d["kind"]: problems(kv, d) for d in docs} == {d["kind"]: [] for d in docs}


def test_the_validation_refuses_what_a_cluster_would(kv):
    docs = manifests()
    node = find(docs["node.yaml"], "StatefulSet", "harvest-node")
    bad = copy.deepcopy(node)
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["volumeMount"] = c.pop("volumeMounts")  # a misspelt field
    assert problems(kv, bad) == [
        "spec.template.spec.containers.0: Additional properties are not allowed ('volumeMount' was unexpected)"
    ]
    bad = copy.deepcopy(node)
    bad["spec"]["replicas"] = "two"
    assert problems(kv, bad) == ["spec.replicas: 'two' is not of type 'integer', 'null'"]
    job = copy.deepcopy(find(docs["producer.yaml"], "Job", "harvest-produce"))
    del job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["operator"]
    assert problems(kv, job) == ["spec.podFailurePolicy.rules.0.onExitCodes: 'operator' is a required property"]

    lws = find(docs["multinode/leaderworkerset.yaml"], "LeaderWorkerSet", "harvest-node")
    bad = copy.deepcopy(lws)
    lwt = bad["spec"]["leaderWorkerTemplate"]
    lwt["restartPolicy"], lwt["size"], lwt["workerTemplates"] = "Always", 0, lwt.pop("workerTemplate")
    lwt["leaderTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 1
    assert problems(kv, bad) == [
        "spec.leaderWorkerTemplate.workerTemplates: not a field of the CRD",
        "spec.leaderWorkerTemplate.workerTemplate: required",
        "spec.leaderWorkerTemplate.size: 0 is not an integer >= 1",
        "spec.leaderWorkerTemplate.restartPolicy: 'Always' not one of "
        "['Default', 'None', 'RecreateGroupAfterStart', 'RecreateGroupOnPodRestart']",
        "leaderTemplate: template.spec.containers.0.imagePullPolicy: 1 is not of type 'string', 'null'",
    ]
    sm = copy.deepcopy(find(docs["servicemonitor/servicemonitor.yaml"], "ServiceMonitor", "harvest"))
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    del sm["spec"]["selector"]
    assert problems(kv, sm) == [
        "spec.selector: required",
        "spec.endpoints[0].interval: '15 seconds' is not a Prometheus duration",
    ]


@pytest.mark.parametrize("parts", [(), ("servicemonitor",), ("multinode",), ("servicemonitor", "multinode")])
def test_every_reference_between_the_objects_resolves(parts):
    assert reference_problems(deployment(parts)) == []


def test_a_broken_reference_is_found():
    docs = deployment(("servicemonitor",))
    bad = copy.deepcopy(docs)
    node = find(bad, "StatefulSet", "harvest-node")
    node["spec"]["template"]["spec"]["volumes"] = [
        v for v in node["spec"]["template"]["spec"]["volumes"] if v["name"] != "dumps"
    ]
    find(bad, "Service", "harvest-metrics")["spec"]["ports"][0]["name"] = "http"
    find(bad, "StatefulSet", "harvest-redis")["spec"]["serviceName"] = "redis"
    assert reference_problems(bad) == [
        "StatefulSet/harvest-redis: serviceName 'redis' is no headless Service here",
        "StatefulSet/harvest-node template engine: mounts dumps, no such volume",
        "StatefulSet/harvest-node template node: mounts dumps, no such volume",
        "ServiceMonitor/harvest: port metrics is no port of its Service",
    ]


def test_the_node_pod_shares_a_memory_dump_dir_and_stops_the_engine_last():
    docs = manifests()
    node = find(docs["node.yaml"], "StatefulSet", "harvest-node")
    leader = dict(pod_templates(find(docs["multinode/leaderworkerset.yaml"], "LeaderWorkerSet", "harvest-node")))[
        "leader"
    ]
    for template in (node["spec"]["template"], leader):
        spec = template["spec"]
        (engine,) = spec["initContainers"]
        assert (engine["name"], engine["restartPolicy"]) == ("engine", "Always")  # a native sidecar: stops last
        assert engine["resources"]["limits"]["nvidia.com/gpu"] >= 1
        (harvest,) = spec["containers"]
        assert harvest["args"][:2] == ["node", "--run"]
        assert {"name": "dumps", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in spec["volumes"]
        mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (engine, harvest)}
        # harvest node (uid 0) reads run R's dumps from /dev/shm/harvest-0/R, where SGLang writes them
        assert {n: m["dumps"] for n, m in mounts.items()} == {
            "engine": "/dev/shm/harvest-0",
            "node": "/dev/shm/harvest-0",
        }
        assert kube_env(engine)["HARVEST_DUMP_DIR"] == "/dev/shm/harvest-0/{RUN}"
        assert mounts["node"]["work"] == harvest["args"][harvest["args"].index("--work") + 1]
        grace = float(harvest["args"][harvest["args"].index("--stop-grace") + 1])
        assert grace < spec["terminationGracePeriodSeconds"]
    assert [t["metadata"]["name"] for t in node["spec"]["volumeClaimTemplates"]] == ["work"]
    spec = node["spec"]["template"]["spec"]
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # one pod per node
    assert term["labelSelector"]["matchLabels"] == node["spec"]["selector"]["matchLabels"]


def test_kustomize_renders_the_base_and_its_components_into_those_objects(kv, tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        need("kubectl", "renders deploy/kubernetes with its built-in kustomize (the machine's google-cloud-cli)")
    for parts in [(), ("servicemonitor",), ("multinode",), ("servicemonitor", "multinode")]:
        # the base with its `components:` uncommented, as docs/guides/kubernetes.md says
        copy_dir = tmp_path / "-".join(parts or ("base",))
        shutil.copytree(KUBE_DIR, copy_dir)
        with open(copy_dir / "kustomization.yaml") as f:
            kustomization = yaml.safe_load(f)
        assert "components" not in kustomization  # the optional parts are off by default
        if parts:
            kustomization["components"] = list(parts)
        (copy_dir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        res = subprocess.run([kubectl, "kustomize", str(copy_dir)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        rendered = list(yaml.safe_load_all(res.stdout))
        assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "harvest" for d in rendered)
        for d in rendered:
            del d["metadata"]["labels"]["app.kubernetes.io/part-of"]
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(rendered, key=key) == sorted(deployment(parts), key=key)
        assert {key(d): problems(kv, d) for d in rendered} == {key(d): [] for d in rendered}


def test_every_pod_running_harvest_lets_sigterm_reach_it():
    # harvest's image has no init: as a container's PID 1, a process without a SIGTERM handler
    # (the collector, metrics) would ignore SIGTERM; with the pod's pause process as PID 1 it does not.
    pods = [
        (f"{d['kind']}/{d['metadata']['name']} {label}", t["spec"])
        for docs in manifests().values()
        for d in docs
        for label, t in pod_templates(d)
        if any(c["image"].startswith("harvest:") for c in t["spec"]["containers"])
    ]
    assert len(pods) == 4  # the node StatefulSet, the LeaderWorkerSet's leader, the producer, metrics
    assert {name: spec.get("shareProcessNamespace") for name, spec in pods} == {name: True for name, _ in pods}
