"""Where ``/metrics`` is served, and the process series it carries, over real sockets:
the admin listener always (behind its key when it has one), the client listener only
with ``metrics: {client_port: true}``."""

from __future__ import annotations

import hashlib
import platform
from typing import Any

import httpx

from proxy import __version__
from proxy.metering.series import build_labels
from proxy.process.admin import create_admin_app
from proxy.process.serving import running_server
from proxy.runtime import Runtime
from tests.conftest import Proxy, proxy_settings

ROUTE = {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}
REPLICA = [("gpu0", "http://127.0.0.1:9", 1)]
ADMIN_KEY = "admin-key"


def settings(**top: Any) -> Any:
    return proxy_settings(REPLICA, [ROUTE], metrics={"client_port": False}, **top)


def never_reload() -> Any:
    raise AssertionError("not reloaded here")


async def test_the_client_listener_does_not_serve_metrics_by_default(start_proxy: Any) -> None:
    proxy: Proxy = await start_proxy(settings())
    async with httpx.AsyncClient() as client:
        answer = await client.get(proxy.http_url + "/metrics")
        assert answer.status_code == 404
        assert "headroom_" not in answer.text
        assert (await client.get(proxy.http_url + "/healthz")).status_code == 200


async def test_the_client_listener_serves_metrics_when_configured(start_proxy: Any) -> None:
    proxy: Proxy = await start_proxy(
        proxy_settings(REPLICA, [ROUTE], metrics={"client_port": True})
    )
    async with httpx.AsyncClient() as client:
        answer = await client.get(proxy.http_url + "/metrics")
    assert answer.status_code == 200 and "headroom_session_slots" in answer.text


async def test_the_admin_listener_serves_metrics_with_process_and_build_series() -> None:
    rt = Runtime(settings())
    app = create_admin_app(rt, never_reload, lambda: None)
    async with running_server(app) as admin, httpx.AsyncClient() as client:
        answer = await client.get(admin.http_url + "/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    for series in (
        "headroom_session_slots",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "python_gc_objects_collected_total",
        "python_info",
    ):
        assert f"\n{series}" in text, series
    version, python, build = build_labels()
    assert (version, python) == (__version__, platform.python_version())
    assert build in ("compiled", "interpreted", "mixed")
    line = f'headroom_build_info{{build="{build}",python="{python}",version="{version}"}} 1.0'
    assert line in text


async def test_the_admin_key_guards_metrics_too() -> None:
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    rt = Runtime(settings(admin={"host": "127.0.0.1", "port": 0, "api_key_sha256": digest}))
    app = create_admin_app(rt, never_reload, lambda: None)
    async with running_server(app) as admin, httpx.AsyncClient() as client:
        assert (await client.get(admin.http_url + "/metrics")).status_code == 401
        keyed = await client.get(
            admin.http_url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
    assert keyed.status_code == 200 and "headroom_build_info" in keyed.text
