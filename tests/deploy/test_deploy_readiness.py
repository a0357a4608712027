"""Readiness per deployment shape: the gateway manifests (Kubernetes, its shared overlay,
the chart, compose) say ``readiness: self``, so a gateway whose engines are all down stays
in its Service and answers refusals; the sidecar and SageMaker say ``upstream``, so the pod
is ready only while its engine is. Run through each shipped configuration as it is, with
only its addresses pointed at 127.0.0.1 (the engines: ports bound and closed)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.serving import bind_socket
from proxy.settings import settings_from_mapping

from .support import DEPLOY, configmap_config, helm_values_config, load_yaml

KUBERNETES = DEPLOY / "kubernetes"


def _shipped() -> dict[str, dict[str, Any]]:
    return {
        "kubernetes/gateway": configmap_config(KUBERNETES / "gateway" / "configmap.yaml"),
        "kubernetes/gateway-shared": configmap_config(
            KUBERNETES / "gateway-shared" / "configmap-patch.yaml"
        ),
        "helm/headroom": helm_values_config(),
        "compose": load_yaml(DEPLOY / "compose" / "headroom.yaml"),
        "kubernetes/sidecar": configmap_config(KUBERNETES / "sidecar" / "vllm-with-headroom.yaml"),
        "sagemaker": load_yaml(DEPLOY / "sagemaker" / "headroom.yaml"),
    }


SHAPES = {
    "kubernetes/gateway": "self",
    "kubernetes/gateway-shared": "self",
    "helm/headroom": "self",
    "compose": "self",
    "kubernetes/sidecar": "upstream",
    "sagemaker": "upstream",
}


@pytest.mark.parametrize(("where", "readiness"), list(SHAPES.items()))
def test_each_shape_says_its_readiness(where: str, readiness: str) -> None:
    config = _shipped()[where]
    assert config["readiness"] == readiness, where
    assert settings_from_mapping(config, env={}).readiness == readiness


def _dead_url() -> str:
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def _local(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration with its listener on 127.0.0.1:0, no admin listener, the memory
    backend (the shared one's refusals are the same) and every engine unreachable."""
    local = copy.deepcopy(config)
    local["listen"] = {"host": "127.0.0.1", "port": 0}
    local["admin"] = {"enabled": False}
    local.pop("admission", None)
    for pool in local["pools"]:
        for replica in pool["replicas"]:
            replica["url"] = _dead_url()
    return local


async def _readyz(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url + "/readyz")


@pytest.mark.parametrize("where", ["kubernetes/gateway", "helm/headroom"])
async def test_a_gateway_with_every_engine_down_answers_refusals(
    where: str, start_proxy: Any
) -> None:
    config = _shipped()[where]
    proxy = await start_proxy(settings_from_mapping(_local(config), env={}))
    await proxy.runtime.replicas_checked.wait()
    answer = await _readyz(proxy.http_url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["upstream"] == {"ready": False, "reason": "no healthy replica"}
    (ws_route,) = [r for r in config["routes"] if r["protocol"] == "vllm-omni-speech-ws"]
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + ws_route["path"], compression=None)
    refused = info.value.response
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert json.loads(refused.body)["error"]["code"] == "no_healthy_replica"
    (http_route,) = [r for r in config["routes"] if r["protocol"] == "openai-speech-http"]
    async with httpx.AsyncClient() as client:
        posted = await client.post(
            proxy.http_url + http_route["path"], json={"input": "hello", "stream": True}
        )
    assert posted.status_code == 503 and int(posted.headers["Retry-After"]) >= 1
    assert posted.json()["error"]["code"] == "no_healthy_replica"
    assert proxy.gate.active == 0 and proxy.gate.queued == 0


async def test_a_sidecar_whose_engine_is_down_is_not_ready(start_proxy: Any) -> None:
    config = _shipped()["kubernetes/sidecar"]
    proxy = await start_proxy(settings_from_mapping(_local(config), env={}))
    await proxy.runtime.replicas_checked.wait()
    answer = await _readyz(proxy.http_url)
    assert answer.status_code == 503
    assert answer.json()["reason"] == "no healthy replica"


# --- /metrics where the shipped scrape configurations read it -----------------------------


def _scraped_ports() -> dict[str, tuple[str, str]]:
    """Where each shape's Prometheus scrape reads Headroom: (port, path)."""
    from .support import load_yaml_docs

    def podmonitor(path: Any) -> tuple[str, str]:
        (doc,) = [d for d in load_yaml_docs(path) if d["kind"] == "PodMonitor"]
        (endpoint,) = doc["spec"]["podMetricsEndpoints"]
        return endpoint["port"], endpoint["path"]

    chart_podmonitor = (DEPLOY / "helm" / "headroom" / "templates" / "podmonitor.yaml").read_text()
    assert "- port: http\n      path: /metrics" in chart_podmonitor
    prometheus = load_yaml(DEPLOY / "compose" / "prometheus.yml")
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "headroom"]
    ports = {t.rsplit(":", 1)[1] for sc in job["static_configs"] for t in sc["targets"]}
    assert ports == {"8080"}
    return {
        "kubernetes/gateway": podmonitor(KUBERNETES / "gateway" / "podmonitor.yaml"),
        "kubernetes/sidecar": podmonitor(KUBERNETES / "sidecar" / "vllm-with-headroom.yaml"),
        "helm/headroom": ("http", "/metrics"),
        "compose": ("http", job.get("metrics_path", "/metrics")),
    }


@pytest.mark.parametrize("where", ["kubernetes/gateway", "kubernetes/sidecar", "helm/headroom",
                                   "compose"])  # fmt: skip
async def test_the_scraped_port_serves_metrics(where: str, start_proxy: Any) -> None:
    """/metrics is on the admin listener unless metrics.client_port: the shapes whose
    scrape reads the client port must say so, or their dashboards and alerts go empty."""
    port, path = _scraped_ports()[where]
    assert port == "http"  # the client listener (the admin one stays on loopback)
    config = _shipped()[where]
    assert config["metrics"] == {"client_port": True}, where
    proxy = await start_proxy(settings_from_mapping(_local(config), env={}))
    async with httpx.AsyncClient() as client:
        answer = await client.get(proxy.http_url + path)
    assert answer.status_code == 200
    assert "headroom_sessions_active" in answer.text
