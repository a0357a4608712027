"""Kubernetes manifests: parse, wire together, and honour the one-process-per-cap rule."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from proxy.errors import ConfigError

from .support import (
    ADMIN_ENV,
    ADMIN_SECRET,
    CONFIG_PATH,
    DEPLOY,
    PROXY_PORT,
    configmap_config,
    load_yaml,
    load_yaml_docs,
)

GATEWAY = DEPLOY / "kubernetes" / "gateway"
SIDECAR = DEPLOY / "kubernetes" / "sidecar" / "vllm-with-headroom.yaml"


def _docs(path: Path) -> list[dict[str, Any]]:
    docs = load_yaml_docs(path)
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
    return docs


def _gateway() -> dict[str, dict[str, Any]]:
    by_kind: dict[str, dict[str, Any]] = {}
    for path in sorted(GATEWAY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _docs(path):
            assert doc["kind"] not in by_kind, f"two {doc['kind']}s in the gateway"
            by_kind[doc["kind"]] = doc
    return by_kind


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_gateway_has_every_resource_and_kustomize_lists_them() -> None:
    kinds = _gateway()
    assert set(kinds) == {
        "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor",
        "PrometheusRule",
    }  # fmt: skip
    listed = load_yaml(GATEWAY / "kustomization.yaml")["resources"]
    on_disk = {p.name for p in GATEWAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk


def test_gateway_is_a_single_process_replaced_not_rolled() -> None:
    deployment = _gateway()["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    pdb = _gateway()["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 0


def test_selectors_match_the_pod() -> None:
    kinds = _gateway()
    deployment = kinds["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _matches(kinds["Service"]["spec"]["selector"], labels)
    assert _matches(kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], labels)
    assert _matches(kinds["PodMonitor"]["spec"]["selector"]["matchLabels"], labels)


def _check_headroom_container(pod_spec: dict[str, Any], config: dict[str, Any]) -> None:
    headroom = _container(pod_spec, "headroom")
    assert headroom["args"] == ["serve", "--config", CONFIG_PATH]
    env = {e["name"]: e.get("value") for e in headroom.get("env", [])}
    assert env.get("HEADROOM_CONFIG") == CONFIG_PATH
    assert _port(headroom, "http") == PROXY_PORT == config["listen"]["port"]
    live, ready = headroom["livenessProbe"]["httpGet"], headroom["readinessProbe"]["httpGet"]
    assert live["path"] == "/healthz"
    assert _port(headroom, live["port"]) == PROXY_PORT
    assert ready["path"] == "/readyz"
    assert _port(headroom, ready["port"]) == PROXY_PORT
    assert "lifecycle" not in headroom, "SIGTERM drains; a preStop hook only delays it"
    assert pod_spec["terminationGracePeriodSeconds"] > config["drain_timeout_s"]
    mount = next(m for m in headroom["volumeMounts"] if CONFIG_PATH.startswith(m["mountPath"]))
    assert mount["mountPath"] + "/config.yaml" == CONFIG_PATH
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"]
    security = {**pod_spec.get("securityContext", {}), **headroom.get("securityContext", {})}
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0


def test_gateway_pod() -> None:
    kinds = _gateway()
    pod_spec = kinds["Deployment"]["spec"]["template"]["spec"]
    config = configmap_config(GATEWAY / "configmap.yaml")
    _check_headroom_container(pod_spec, config)
    volume = next(v for v in pod_spec["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    service_port = kinds["Service"]["spec"]["ports"][0]
    assert service_port["port"] == PROXY_PORT
    assert service_port["targetPort"] == "http"
    assert [p["targetPort"] for p in kinds["Service"]["spec"]["ports"]] == ["http"]


def test_sidecar_pod_pairs_vllm_and_headroom() -> None:
    kinds = {d["kind"]: d for d in _docs(SIDECAR)}
    assert {"ConfigMap", "Deployment", "Service", "PodMonitor"} <= kinds.keys()
    pod_spec = kinds["Deployment"]["spec"]["template"]["spec"]
    config = configmap_config(SIDECAR)
    _check_headroom_container(pod_spec, config)

    vllm = _container(pod_spec, "vllm")
    flags = dict(a.removeprefix("--").split("=", 1) for a in vllm["args"] if "=" in a)
    (pool,) = config["pools"]
    (replica,) = pool["replicas"]
    assert int(flags["max-num-seqs"]) == replica["max_sessions"]
    assert 0 < float(flags["gpu-memory-utilization"]) <= 0.95
    assert flags["host"] == "127.0.0.1"
    assert replica["url"] == f"http://127.0.0.1:{flags['port']}"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1

    # The engine must outlive Headroom's drain: its preStop waits for Headroom to exit,
    # and the grace period covers both.
    pre_stop = " ".join(vllm["lifecycle"]["preStop"]["exec"]["command"])
    assert str(config["listen"]["port"]) in pre_stop
    wait_s = int(re.search(r"monotonic\(\) \+ (\d+)", pre_stop).group(1))  # type: ignore[union-attr]
    assert wait_s > config["drain_timeout_s"]
    assert pod_spec["terminationGracePeriodSeconds"] > wait_s


def _by_kind(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _docs(path)}


@pytest.mark.parametrize(
    "manifests", [GATEWAY / "configmap.yaml", SIDECAR], ids=["gateway", "sidecar"]
)
def test_metrics_are_scraped_on_the_admin_listener_with_a_key(manifests: Path) -> None:
    """/metrics stays off the Service: the client port serves none, the admin listener is
    bound on the pod's address with the key's hash from the Secret, the container names
    its port (the Service does not list it), and the PodMonitor scrapes it with the key."""
    from proxy.settings import settings_from_mapping

    kinds = _gateway() if manifests.parent == GATEWAY else _by_kind(manifests)
    config = configmap_config(manifests)
    assert not config.get("metrics", {}).get("client_port", False)
    assert config["admin"]["host"] == "0.0.0.0"
    pod_spec = kinds["Deployment"]["spec"]["template"]["spec"]
    headroom = _container(pod_spec, "headroom")
    assert _port(headroom, "admin") == config["admin"]["port"]
    env = {e["name"]: e for e in headroom["env"]}
    assert env["HEADROOM_ADMIN__API_KEY_SHA256"]["valueFrom"]["secretKeyRef"] == {
        "name": ADMIN_SECRET, "key": "sha256",
    }  # fmt: skip
    ports = kinds["Service"]["spec"]["ports"]
    assert [p["targetPort"] for p in ports] == ["http"]
    (endpoint,) = kinds["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("admin", "/metrics")
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": ADMIN_SECRET, "key": "token"},
    }  # fmt: skip
    # Without the Secret's hash Headroom refuses the admin listener off loopback.
    with pytest.raises(ConfigError, match="api_key_sha256"):
        settings_from_mapping(config, env={})
    settings = settings_from_mapping(config, env=ADMIN_ENV)
    assert settings.admin.host == "0.0.0.0" and not settings.metrics.client_port
