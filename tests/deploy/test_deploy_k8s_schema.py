"""Every Kubernetes object the deployment assets produce, validated against the Kubernetes
OpenAPI schema (kubernetes-validate, strict: unknown fields are errors): the kustomize
overlays as `kubectl kustomize` builds them, the sidecar manifest, and the Helm chart as
`helm template` renders it for each shape of its values. The Prometheus Operator, Gateway
API and KEDA objects have no schema there; their required fields are checked here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .support import (
    DEPLOY,
    exported_series,
    headroom_series,
    load_yaml_docs,
    require_tool,
)
from .test_deploy_helm import MONITORING, render_docs

KUBERNETES = DEPLOY / "kubernetes"
KEDA = KUBERNETES / "keda" / "scaledobject.yaml"
#: The oldest Kubernetes release the manifests promise to work on, and the newest the
#: validator knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())

CUSTOM = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}


def _custom_problems(doc: dict[str, Any]) -> list[str]:
    """The fields each custom resource's controller requires (its CRD's `required`)."""
    kind, spec = doc["kind"], doc.get("spec") or {}
    problems = []
    if kind == "PodMonitor":
        if not spec.get("selector"):
            problems.append("spec.selector")
        endpoints = spec.get("podMetricsEndpoints") or []
        if not endpoints or not all(e.get("port") and e.get("path") for e in endpoints):
            problems.append("spec.podMetricsEndpoints[].port/path")
    elif kind == "PrometheusRule":
        groups = spec.get("groups") or []
        if not groups or not all(g.get("name") and g.get("rules") for g in groups):
            problems.append("spec.groups[].name/rules")
        for group in groups:
            for rule in group.get("rules", []):
                if not rule.get("expr") or not ("alert" in rule) ^ ("record" in rule):
                    problems.append(f"{group.get('name')}: a rule needs expr and alert|record")
    elif kind == "HTTPRoute":
        if not spec.get("parentRefs") or not all(p.get("name") for p in spec["parentRefs"]):
            problems.append("spec.parentRefs[].name")
        for rule in spec.get("rules", []):
            refs = rule.get("backendRefs") or []
            if not refs or not all(r.get("name") and r.get("port") for r in refs):
                problems.append("spec.rules[].backendRefs[].name/port")
            if len(spec.get("rules", [])) > 16:
                problems.append("spec.rules: at most 16")
    elif kind == "ScaledObject":
        if not (spec.get("scaleTargetRef") or {}).get("name"):
            problems.append("spec.scaleTargetRef.name")
        triggers = spec.get("triggers") or []
        if not triggers or not all(t.get("type") and t.get("metadata") for t in triggers):
            problems.append("spec.triggers[].type/metadata")
    return problems


def validate(where: str, docs: list[dict[str, Any]]) -> None:
    assert docs, f"{where}: nothing to validate"
    problems = []
    for doc in docs:
        name = f"{where}: {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM:
            problems += [f"{name}: {p}" for p in _custom_problems(doc)]
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{name} (Kubernetes {version}): {exc.message} at {exc.path}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{name}: no schema in Kubernetes {version} (unknown kind?)")
    assert not problems, "\n".join(problems)


def kustomize(overlay: Path) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl", "deploy/tools/install-k8s-tools.sh")
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("overlay", ["gateway", "gateway-shared"])
def test_kustomize_overlays_build_and_validate(overlay: str) -> None:
    docs = kustomize(KUBERNETES / overlay)
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= kinds
    validate(f"kubernetes/{overlay}", docs)


def test_the_sidecar_manifest_validates() -> None:
    validate(
        "kubernetes/sidecar", load_yaml_docs(KUBERNETES / "sidecar" / "vllm-with-headroom.yaml")
    )


CHART_SHAPES = {
    "default": [],
    "operator": [*MONITORING, "--set", "grafanaDashboard.enabled=true"],
    "redis-bundled": ["--set", "admission.backend=redis", *MONITORING],
    "redis-external-workers": [
        "--set", "admission.backend=redis", "--set", "admission.workers=3",
        "--set", "admission.redis.urlSecret.name=redis-url", "--set", "rollOnConfigChange=false",
        "--set", "env[0].name=HEADROOM_LOG_LEVEL", "--set", "env[0].value=debug",
        "--set", "envFrom[0].secretRef.name=headroom-env",
        "--set", "extraVolumes[0].name=ca", "--set", "extraVolumes[0].secret.secretName=ca",
        "--set", "extraVolumeMounts[0].name=ca",
        "--set", "extraVolumeMounts[0].mountPath=/etc/headroom-ca",
    ],
    "admin-metrics": [
        *MONITORING, "--set", "podMonitor.port=admin",
        "--set", "podMonitor.adminKeySecret.name=headroom-admin",
    ],
    "http-route": [
        "--set", "httpRoute.enabled=true", "--set", "httpRoute.parentRefs[0].name=igw",
        "--set", "httpRoute.hostnames[0]=tts.example.com",
    ],
    "registry-redis-existing-secret": [
        "--set", "admission.backend=redis", "--set", "image.registry=registry.example.com/v",
        "--set", "admission.bundledRedis.image.registry=mirror.example.com",
        "--set", "imagePullSecrets[0].name=pull",
        "--set", "admission.bundledRedis.auth.existingSecret=team-redis",
    ],
    "network-policies": [
        "--set", "admission.backend=redis", *MONITORING, "--set", "podMonitor.port=admin",
        "--set", "podMonitor.adminKeySecret.name=headroom-admin",
        "--set", "networkPolicy.gateway.enabled=true",
        "--set", "networkPolicy.gateway.clients[0].namespaceSelector.matchLabels.team=voice",
        "--set", "networkPolicy.gateway.scraper[0].podSelector.matchLabels.app=prometheus",
        "--set", "networkPolicy.gateway.scraper[0].namespaceSelector.matchLabels.ns=mon",
    ],
}  # fmt: skip


@pytest.mark.parametrize("shape", list(CHART_SHAPES))
def test_the_rendered_chart_validates(shape: str) -> None:
    validate(f"helm ({shape})", list(render_docs(*CHART_SHAPES[shape]).values()))


def test_the_shapes_render_the_secret_and_the_network_policies() -> None:
    """The validated shapes include the chart's Redis Secret and both NetworkPolicies."""
    kinds = {key for shape in CHART_SHAPES.values() for key in render_docs(*shape)}
    assert {"Secret/gw-headroom-redis-auth", "NetworkPolicy/gw-headroom-redis",
            "NetworkPolicy/gw-headroom"} <= kinds  # fmt: skip


def test_the_validator_rejects_what_the_cluster_would() -> None:
    """A misspelt field and a wrong type fail; so does a custom resource missing its target."""
    deployment = kustomize(KUBERNETES / "gateway")
    (good,) = [d for d in deployment if d["kind"] == "Deployment"]
    typo = yaml.safe_load(yaml.safe_dump(good))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate("typo", [typo])
    wrong = yaml.safe_load(yaml.safe_dump(good))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError, match="replicas"):
        validate("type", [wrong])
    (scaled,) = load_yaml_docs(KEDA)
    del scaled["spec"]["scaleTargetRef"]
    with pytest.raises(AssertionError, match="scaleTargetRef"):
        validate("keda", [scaled])


# --- the KEDA example -------------------------------------------------------------------


def test_the_keda_example_scales_the_sidecar_on_headroom_series() -> None:
    (scaled,) = load_yaml_docs(KEDA)
    validate("kubernetes/keda", [scaled])
    sidecar = load_yaml_docs(KUBERNETES / "sidecar" / "vllm-with-headroom.yaml")
    deployments = {d["metadata"]["name"] for d in sidecar if d["kind"] == "Deployment"}
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "voxtral")
    assert target["name"] in deployments
    config = yaml.safe_load(
        next(d for d in sidecar if d["kind"] == "ConfigMap")["data"]["config.yaml"]
    )
    pools = {p["name"] for p in config["pools"]}
    exported = exported_series()
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    used = headroom_series(query)
    assert used == {
        "headroom_sessions_active", "headroom_queue_depth", "headroom_session_decisions_total",
        "headroom_session_duration_seconds_sum", "headroom_session_duration_seconds_count",
        "headroom_session_slots",
    }  # fmt: skip
    assert used <= exported.keys(), used - exported.keys()
    assert set(re.findall(r'pool="([^"]+)"', query)) == pools
    from proxy.errors import REASONS

    capacity = {"pool_full", "queue_full", "queue_timeout", "guard"}
    assert capacity <= REASONS
    assert "rejected_(pool_full|queue_full|queue_timeout|guard)" in query
    assert 0 < float(trigger["metadata"]["threshold"]) < 1
    assert scaled["spec"]["minReplicaCount"] >= 1


def test_the_keda_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    (scaled,) = load_yaml_docs(KEDA)
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    rules = {"groups": [{"name": "keda", "rules": [{"record": "keda:demand", "expr": query}]}]}
    path = tmp_path / "keda.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
