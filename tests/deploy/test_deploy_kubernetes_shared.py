"""deploy/kubernetes/gateway-shared: two gateway pods sharing caps through Redis."""

from __future__ import annotations

import subprocess
from typing import Any

import yaml

from .support import (
    ADMIN_ENV,
    DEPLOY,
    configmap_config,
    load_yaml,
    load_yaml_docs,
    require_tool,
)

SHARED = DEPLOY / "kubernetes" / "gateway-shared"


def test_overlay_lists_its_files_and_the_base() -> None:
    kustomization = load_yaml(SHARED / "kustomization.yaml")
    assert kustomization["resources"] == ["../gateway", "redis.yaml"]
    patches = {p["path"] for p in kustomization["patches"]}
    on_disk = {p.name for p in SHARED.glob("*.yaml")} - {"kustomization.yaml", "redis.yaml"}
    assert patches == on_disk


def test_two_gateways_roll_and_one_may_be_evicted() -> None:
    deployment = load_yaml(SHARED / "deployment-patch.yaml")
    assert deployment["spec"]["replicas"] == 2
    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert load_yaml(SHARED / "pdb-patch.yaml")["spec"]["maxUnavailable"] == 1


def test_config_uses_the_redis_service_and_loads_cleanly() -> None:
    from proxy.settings import settings_from_mapping

    config = configmap_config(SHARED / "configmap-patch.yaml")
    base = configmap_config(DEPLOY / "kubernetes" / "gateway" / "configmap.yaml")
    assert {k: v for k, v in config.items() if k != "admission"} == base
    settings = settings_from_mapping(config, env=ADMIN_ENV)  # the base Deployment's env
    assert settings.admission.backend == "redis"
    assert settings.admission.on_backend_loss == "close"
    assert settings.warnings() == []
    docs = {d["kind"]: d for d in load_yaml_docs(SHARED / "redis.yaml")}
    service = docs["Service"]
    assert settings.admission.redis.url == f"redis://{service['metadata']['name']}:6379/0"
    assert service["spec"]["selector"].items() <= (
        docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )
    args = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_kustomize_renders_two_rolling_gateways_and_a_redis() -> None:
    kubectl = require_tool("kubectl", "deploy/tools/install-k8s-tools.sh")
    out = subprocess.run(
        [kubectl, "kustomize", str(SHARED)], capture_output=True, text=True, check=True,
        timeout=60,
    ).stdout  # fmt: skip
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(out) if d]
    gateway = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "headroom-gateway"
    )
    assert gateway["spec"]["replicas"] == 2
    assert gateway["spec"]["strategy"]["type"] == "RollingUpdate"
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["admission"]["backend"] == "redis"
    # The base's scrape of the admin listener holds in the overlay: listener, port, key.
    assert config["admin"]["host"] == "0.0.0.0" and "metrics" not in config
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert "admin" in {p["name"] for p in container["ports"]}
    assert "HEADROOM_ADMIN__API_KEY_SHA256" in {e["name"] for e in container["env"]}
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "admin"
    assert any(d["metadata"]["name"] == "headroom-redis" for d in docs if d["kind"] == "Service")
