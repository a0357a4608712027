"""Readiness per deployment shape: the gateway manifests (Kubernetes, its shared overlay,
the chart, compose) say ``readiness: self``, so a gateway whose engines are all down stays
in its Service and answers refusals; the sidecar and SageMaker say ``upstream``, so the pod
is ready only while its engine is. Run through each shipped configuration as it is, with
only its addresses pointed at 127.0.0.1 (the engines: ports bound and closed). The
Kubernetes manifests' pods get the admin key's hash from a Secret (``ADMIN_ENV``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.process.admin import create_admin_app
from proxy.process.serving import bind_socket, running_server
from proxy.settings import settings_from_mapping

from .support import (
    ADMIN_ENV,
    ADMIN_KEY,
    ADMIN_SECRET,
    DEPLOY,
    configmap_config,
    helm_values_config,
    load_yaml,
)

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
    assert settings_from_mapping(config, env=ADMIN_ENV).readiness == readiness


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


def _scrapes() -> dict[str, dict[str, Any]]:
    """Where each shape's Prometheus scrape reads Headroom: its endpoint (port, path and,
    for the admin listener, the key it sends)."""
    from .support import load_yaml_docs

    def podmonitor(path: Any) -> dict[str, Any]:
        (doc,) = [d for d in load_yaml_docs(path) if d["kind"] == "PodMonitor"]
        (endpoint,) = doc["spec"]["podMetricsEndpoints"]
        return dict(endpoint)

    chart_podmonitor = (DEPLOY / "helm" / "headroom" / "templates" / "podmonitor.yaml").read_text()
    assert "- port: http\n      path: /metrics" in chart_podmonitor
    prometheus = load_yaml(DEPLOY / "compose" / "prometheus.yml")
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "headroom"]
    ports = {t.rsplit(":", 1)[1] for sc in job["static_configs"] for t in sc["targets"]}
    assert ports == {"8080"}
    return {
        "kubernetes/gateway": podmonitor(KUBERNETES / "gateway" / "podmonitor.yaml"),
        "kubernetes/sidecar": podmonitor(KUBERNETES / "sidecar" / "vllm-with-headroom.yaml"),
        "helm/headroom": {"port": "http", "path": "/metrics"},  # podMonitor.port client
        "compose": {"port": "http", "path": job.get("metrics_path", "/metrics")},
    }


@pytest.mark.parametrize("where", ["helm/headroom", "compose"])
async def test_the_scraped_client_port_serves_metrics(where: str, start_proxy: Any) -> None:
    """/metrics is on the admin listener unless metrics.client_port: the shapes whose
    scrape reads the client port must say so, or their dashboards and alerts go empty."""
    scrape = _scrapes()[where]
    assert scrape["port"] == "http"  # the client listener (the admin one stays on loopback)
    config = _shipped()[where]
    assert config["metrics"] == {"client_port": True}, where
    proxy = await start_proxy(settings_from_mapping(_local(config), env={}))
    async with httpx.AsyncClient() as client:
        answer = await client.get(proxy.http_url + scrape["path"])
    assert answer.status_code == 200
    assert "headroom_sessions_active" in answer.text


async def _never_reload() -> Any:
    raise AssertionError("not reloaded here")


@pytest.mark.parametrize("where", ["kubernetes/gateway", "kubernetes/sidecar"])
async def test_the_scraped_admin_listener_serves_metrics_to_the_key_only(
    where: str, start_proxy: Any
) -> None:
    """The Kubernetes manifests scrape the admin listener with the Secret's token: it
    answers /metrics to that key and 401 without it, and the client port (the Service's)
    serves none."""
    scrape = _scrapes()[where]
    assert (scrape["port"], scrape["path"]) == ("admin", "/metrics")
    assert scrape["authorization"]["credentials"] == {"name": ADMIN_SECRET, "key": "token"}
    config = _shipped()[where]
    local = _local(config)
    # The admin listener as configured, on 127.0.0.1 here, with the Secret's hash.
    local["admin"] = {**config["admin"], "host": "127.0.0.1", "port": 0}
    settings = settings_from_mapping(local, env=ADMIN_ENV)
    assert settings.admin.api_key_sha256 == ADMIN_ENV["HEADROOM_ADMIN__API_KEY_SHA256"]
    proxy = await start_proxy(settings)
    admin_app = create_admin_app(proxy.runtime, _never_reload, lambda: None)
    async with running_server(admin_app) as admin, httpx.AsyncClient() as client:
        keyed = await client.get(
            admin.http_url + scrape["path"], headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        bare = await client.get(admin.http_url + scrape["path"])
        on_client_port = await client.get(proxy.http_url + scrape["path"])
    assert keyed.status_code == 200 and "headroom_sessions_active" in keyed.text
    assert bare.status_code == 401
    assert on_client_port.status_code == 404 and "headroom_" not in on_client_port.text
