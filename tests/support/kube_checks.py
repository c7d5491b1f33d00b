"""Checks of deploy/kubernetes that no schema makes: the two custom resources' own fields, and the
references between objects that only a cluster would otherwise try.

The custom resources (LeaderWorkerSet, ServiceMonitor) are not in Kubernetes' schemas, and their
CRDs are too large to keep here (the LeaderWorkerSet CRD is 1.3 MB, a pod template's schema
twice over), so their fields are checked by hand, as these CRDs define them: LeaderWorkerSet
leaderworkerset.x-k8s.io/v1 (kubernetes-sigs/lws 0.10) and ServiceMonitor monitoring.coreos.com/v1
(prometheus-operator 0.93). A LeaderWorkerSet's two pod templates are validated against the core
PodTemplateSpec schema by the caller, which is what the CRD embeds."""

from __future__ import annotations

import re
from typing import Any

from tests.support.kube import containers, pod_templates

LWS_SPEC = {"leaderWorkerTemplate", "networkConfig", "replicas", "rolloutStrategy", "startupPolicy"}
LWS_TEMPLATE = {
    "leaderTemplate",
    "persistentVolumeClaimRetentionPolicy",
    "restartPolicy",
    "size",
    "subGroupPolicy",
    "volumeClaimTemplates",
    "workerTemplate",
}
LWS_RESTART = {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}
LWS_STARTUP = {"LeaderCreated", "LeaderReady"}
SM_SPEC = {
    "attachMetadata",
    "bodySizeLimit",
    "convertClassicHistogramsToNHCB",
    "endpoints",
    "fallbackScrapeProtocol",
    "jobLabel",
    "keepDroppedTargets",
    "labelLimit",
    "labelNameLengthLimit",
    "labelValueLengthLimit",
    "namespaceSelector",
    "nativeHistogramBucketLimit",
    "nativeHistogramMinBucketFactor",
    "podTargetLabels",
    "sampleLimit",
    "scrapeClass",
    "scrapeClassicHistograms",
    "scrapeNativeHistograms",
    "scrapeProtocols",
    "selector",
    "selectorMechanism",
    "serviceDiscoveryRole",
    "targetLabels",
    "targetLimit",
}
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")


def _fields(where: str, obj: Any, allowed: set[str], required: set[str]) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not an object"]
    return [f"{where}.{k}: not a field of the CRD" for k in sorted(set(obj) - allowed)] + [
        f"{where}.{k}: required" for k in sorted(required - set(obj))
    ]


def _int(where: str, value: Any, minimum: int) -> list[str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    return [] if ok else [f"{where}: {value!r} is not an integer >= {minimum}"]


def leaderworkerset_problems(doc: dict[str, Any]) -> list[str]:
    """What leaderworkerset.x-k8s.io/v1 refuses in `doc`, outside its pod templates; [] if nothing."""
    spec = doc.get("spec")
    out = _fields("spec", spec, LWS_SPEC, {"leaderWorkerTemplate"})
    if out and not isinstance(spec, dict):
        return out
    if "replicas" in spec:
        out += _int("spec.replicas", spec["replicas"], 0)
    if spec.get("startupPolicy", "LeaderCreated") not in LWS_STARTUP:
        out.append(f"spec.startupPolicy: {spec['startupPolicy']!r} not one of {sorted(LWS_STARTUP)}")
    lwt = spec.get("leaderWorkerTemplate")
    if lwt is None:
        return out
    out += _fields("spec.leaderWorkerTemplate", lwt, LWS_TEMPLATE, {"workerTemplate"})
    if isinstance(lwt, dict):
        if "size" in lwt:
            out += _int("spec.leaderWorkerTemplate.size", lwt["size"], 1)
        if lwt.get("restartPolicy", "RecreateGroupOnPodRestart") not in LWS_RESTART:
            out.append(
                f"spec.leaderWorkerTemplate.restartPolicy: {lwt['restartPolicy']!r} not one of {sorted(LWS_RESTART)}"
            )
    return out


def servicemonitor_problems(doc: dict[str, Any]) -> list[str]:
    """What monitoring.coreos.com/v1 refuses in a ServiceMonitor `doc`; [] if nothing."""
    spec = doc.get("spec")
    out = _fields("spec", spec, SM_SPEC, {"endpoints", "selector"})
    if not isinstance(spec, dict):
        return out
    selector = spec.get("selector", {})
    out += _fields("spec.selector", selector, {"matchLabels", "matchExpressions"}, set())
    endpoints = spec.get("endpoints", [])
    if not isinstance(endpoints, list):
        return out + ["spec.endpoints: not a list"]
    for i, ep in enumerate(endpoints):
        where = f"spec.endpoints[{i}]"
        if not isinstance(ep.get("port", ""), str):
            out.append(f"{where}.port: not a string (a Service port's name)")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not DURATION.match(str(ep[key])):
                out.append(f"{where}.{key}: {ep[key]!r} is not a Prometheus duration")
        if "scheme" in ep and ep["scheme"] not in ("http", "https", "HTTP", "HTTPS"):
            out.append(f"{where}.scheme: {ep['scheme']!r}")
    return out


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def reference_problems(docs: list[dict[str, Any]]) -> list[str]:
    """References between the objects of one deployment that do not resolve: a volume mount
    without its volume, a probe or Service naming a port no container has, a workload whose
    selector does not select its own pods, a StatefulSet without its headless Service, a
    ServiceMonitor selecting no Service or naming a port it lacks. [] if none."""
    out = []
    pods: list[tuple[dict[str, str], set[str]]] = []  # (labels, container port names) of every pod template
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for d in docs:
        out += _workload_problems(d, services, pods)
    out += _service_problems(services, pods)
    out += _monitor_problems(docs, services)
    return out


def _workload_problems(
    d: dict[str, Any], services: dict[str, dict[str, Any]], pods: list[tuple[dict[str, str], set[str]]]
) -> list[str]:
    """The unresolved references of one object's pod templates (and a StatefulSet's Service); each
    template's labels and port names are appended to `pods`."""
    out = []
    name = f"{d['kind']}/{d['metadata']['name']}"
    selector = d.get("spec", {}).get("selector", {}).get("matchLabels") if d["kind"] != "Service" else None
    for label, template in pod_templates(d):
        labels, spec = template.get("metadata", {}).get("labels", {}), template["spec"]
        if selector is not None and not _selects(selector, labels):
            out.append(f"{name}: its selector does not select its pods")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for where in (d["spec"], d["spec"].get("leaderWorkerTemplate", {})):
            volumes |= {c["metadata"]["name"] for c in where.get("volumeClaimTemplates", [])}
        ports = set()
        for c in containers(spec):
            named = {p["name"] for p in c.get("ports", []) if "name" in p}
            ports |= named
            out += _container_problems(f"{name} {label} {c['name']}", c, volumes, named)
        pods.append((labels, ports))
    if d["kind"] == "StatefulSet":
        svc = services.get(d["spec"].get("serviceName", ""))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            out.append(f"{name}: serviceName {d['spec'].get('serviceName')!r} is no headless Service here")
    return out


def _container_problems(where: str, c: dict[str, Any], volumes: set[str], named: set[str]) -> list[str]:
    """A container's mounts of no volume of its pod, and its probes naming a port it does not name."""
    out = [
        f"{where}: mounts {m['name']}, no such volume" for m in c.get("volumeMounts", []) if m["name"] not in volumes
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        for kind in ("httpGet", "tcpSocket"):
            port = c.get(probe, {}).get(kind, {}).get("port")
            if isinstance(port, str) and port not in named:
                out.append(f"{where}: {probe} names port {port}, not its own")
    return out


def _service_problems(services: dict[str, dict[str, Any]], pods: list[tuple[dict[str, str], set[str]]]) -> list[str]:
    """Services selecting no pod, or naming a target port none of their pods has."""
    out = []
    for sname, svc in services.items():
        selected = [ports for labels, ports in pods if _selects(svc["spec"].get("selector", {}), labels)]
        if not selected:
            out.append(f"Service/{sname}: selects no pod")
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str) and not any(p["targetPort"] in ports for ports in selected):
                out.append(f"Service/{sname}: targetPort {p['targetPort']} is no port of its pods")
    return out


def _monitor_problems(docs: list[dict[str, Any]], services: dict[str, dict[str, Any]]) -> list[str]:
    """ServiceMonitors selecting no Service, or naming a port none of their Services has."""
    out = []
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        chosen = [
            s
            for s in services.values()
            if _selects(sm["spec"]["selector"].get("matchLabels", {}), s["metadata"].get("labels", {}))
        ]
        if not chosen:
            out.append(f"ServiceMonitor/{sm['metadata']['name']}: selects no Service")
        for ep in sm["spec"]["endpoints"]:
            if not any(ep.get("port") in {p.get("name") for p in s["spec"]["ports"]} for s in chosen):
                out.append(f"ServiceMonitor/{sm['metadata']['name']}: port {ep.get('port')} is no port of its Service")
    return out
