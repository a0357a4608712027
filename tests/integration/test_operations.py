"""Graceful drain, live reload (admin endpoint and SIGHUP path), /ping, engine metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.errors import ConfigError, ListenError
from proxy.process.gateway import Gateway
from proxy.settings import load_settings, settings_from_mapping
from proxy.speedups import build_status
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]


def config(url: str, cap: int, **extra: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "drain_timeout_s": 30,
        "pools": [{"name": "main", "replicas": [{"name": "gpu0", "url": url,
                                                 "max_sessions": cap}]}],
        "routes": [{"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"}],
        **extra,
    }  # fmt: skip


@contextlib.asynccontextmanager
async def running_gateway(path: Path) -> AsyncIterator[Gateway]:
    gateway = Gateway(load_settings(path, env={}), config_path=str(path), env={})
    task = asyncio.ensure_future(gateway.serve(install_signals=False))
    ready = asyncio.ensure_future(gateway.server.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    assert gateway.server.started
    try:
        yield gateway
    finally:
        gateway.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)
        assert gateway.runtime.gate.active == 0


def ws(gateway: Gateway) -> str:
    return f"ws://127.0.0.1:{gateway.port}/ws/echo"


async def open_session(gateway: Gateway) -> ClientConnection:
    client = await connect(ws(gateway), compression=None)
    await hello(client)
    return client


async def test_drain_lets_running_sessions_finish_and_refuses_new_ones(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 4)))
    async with running_gateway(path) as gateway:
        sessions = [await open_session(gateway) for _ in range(2)]
        drain = gateway.drain()
        base = f"http://127.0.0.1:{gateway.port}"
        async with httpx.AsyncClient() as client:
            ready = await client.get(base + "/readyz")
            assert ready.status_code == 503 and ready.json()["reason"] == "draining"
        with pytest.raises(InvalidStatus) as info:
            await connect(ws(gateway), compression=None)
        assert info.value.response.headers["X-Headroom-Reason"] == "draining"
        for client_ws in sessions:  # still relaying: none was cut
            await client_ws.send("still flowing")
            assert await client_ws.recv() == "still flowing"
        await sessions[0].close()
        assert not drain.done()
        await sessions[1].close()
        await asyncio.wait_for(drain, 10)  # the last session ended: the drain completes
        assert gateway.server.should_exit


async def test_drain_deadline_closes_remaining_sessions_with_1012(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 4)))
    async with running_gateway(path) as gateway:
        session = await open_session(gateway)
        await asyncio.wait_for(gateway.drain(timeout_s=0.2), 10)
        with pytest.raises(ConnectionClosed):
            await session.recv()
        assert session.close_code == 1012


async def test_reload_lowers_and_raises_caps_under_live_sessions(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 2)))
    async with running_gateway(path) as gateway:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        a, b = await open_session(gateway), await open_session(gateway)
        path.write_text(yaml.safe_dump(config(server.http_url, 1)))
        async with httpx.AsyncClient() as client:
            response = await client.post(admin + "/admin/reload")
            assert response.status_code == 200 and response.json()["reloaded"] is True
            status = (await client.get(admin + "/admin/status")).json()
        replica = status["pools"]["main"]["replicas"][0]
        assert replica["cap"] == 1 and replica["active"] == 2  # lowered, nobody evicted
        await a.send("ok")
        assert await a.recv() == "ok"
        with pytest.raises(InvalidStatus):
            await connect(ws(gateway), compression=None)
        await a.close()
        await wait_until(lambda: gateway.runtime.gate.active == 1)
        with pytest.raises(InvalidStatus):  # 1 active = the new cap
            await connect(ws(gateway), compression=None)
        path.write_text(yaml.safe_dump(config(server.http_url, 3)))
        await gateway._on_sighup()  # the SIGHUP path
        c, d = await open_session(gateway), await open_session(gateway)
        assert gateway.runtime.gate.active == 3
        for client_ws in (b, c, d):
            await client_ws.close()
        await wait_until(lambda: gateway.runtime.gate.active == 0)


async def test_bad_reload_keeps_the_running_configuration(upstream: Any, tmp_path: Path) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 2)))
    async with running_gateway(path) as gateway:
        before = gateway.runtime.settings
        broken = config(server.http_url, 0)  # max_sessions 0 is invalid
        path.write_text(yaml.safe_dump(broken))
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{gateway.admin_port}/admin/reload")
        assert response.status_code == 400
        problems = response.json()["problems"]
        assert problems[0]["field"] == "pools[0].replicas[0].max_sessions"
        path.write_text("pools: [unclosed")
        await gateway._on_sighup()  # logged and refused
        assert gateway.runtime.settings is before
        session = await open_session(gateway)
        await session.close()


async def test_admin_key_required_off_loopback_and_ping(upstream: Any, tmp_path: Path) -> None:
    import hashlib

    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    key = "s3cret-admin-key"
    cfg = config(server.http_url, 1)
    cfg["admin"] = {"host": "127.0.0.1", "port": 0,
                    "api_key_sha256": hashlib.sha256(key.encode()).hexdigest()}  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}/admin/status"
        missing = await client.get(admin)
        assert missing.status_code == 401
        assert missing.headers["WWW-Authenticate"] == 'Bearer realm="headroom-admin"'
        bad = await client.get(admin, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        good = await client.get(admin, headers={"Authorization": f"Bearer {key}"})
        assert good.status_code == 200 and good.json()["ready"] is True
        ping = await client.get(f"http://127.0.0.1:{gateway.port}/ping")
        assert ping.status_code == 200


async def test_admin_listener_serves_only_admin_endpoints(upstream: Any, tmp_path: Path) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 1)))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        main = f"http://127.0.0.1:{gateway.port}"
        for endpoint in ("/healthz", "/readyz", "/ping"):
            assert (await client.get(admin + endpoint)).status_code == 404
            assert (await client.get(main + endpoint)).status_code == 200
        # /metrics names tenants and the topology: the admin listener's, by default
        assert (await client.get(admin + "/metrics")).status_code == 200
        assert (await client.get(main + "/metrics")).status_code == 404
        assert (await client.get(admin + "/admin/status")).status_code == 200
        assert (await client.get(main + "/admin/status")).status_code == 404


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def test_start_and_stop_lines_appear_once(upstream: Any, tmp_path: Path) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 1)))
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "headroom.gateway")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        async with running_gateway(path) as gateway:
            admin_port = gateway.admin_port
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    pid = os.getpid()
    for line in (f"Started server process [{pid}]", "Shutting down",
                 f"Finished server process [{pid}]"):  # fmt: skip
        assert handler.lines.count(line) == 1, handler.lines
    admin = [line for line in handler.lines if line.startswith("admin listener on ")]
    assert admin == [
        f"admin listener on http://127.0.0.1:{admin_port} "
        "(/admin/status, /admin/reload, /admin/drain)"
    ]
    left = [type(f).__name__ for f in logging.getLogger("uvicorn.error").filters]
    assert "_AdminLifecycleFilter" not in left  # removed when serving ends
    # which build of the per-chunk modules runs (proxy/speedups.py), once
    build = [line for line in handler.lines if line.startswith("per-chunk modules ")]
    assert build == [build_status().describe()]


async def test_engine_metrics_are_scraped_and_re_exported(start_proxy: Any) -> None:
    from prometheus_client import generate_latest

    from proxy.sim.cluster import running_cluster
    from tests.conftest import proxy_settings

    async with running_cluster("l4-cosyvoice2-0.5b", gpus=1) as cluster:
        proxy = await start_proxy(
            proxy_settings([("gpu0", cluster.urls[0], 2)],
                           [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
                           health={"engine_metrics_interval_s": 0.05})
        )  # fmt: skip
        await wait_until(lambda: ("main", "gpu0") in proxy.runtime.upstreams.engine)
        text = generate_latest(proxy.runtime.metrics.registry).decode()
    assert 'headroom_engine_requests_waiting{pool="main",replica="gpu0"} 0.0' in text
    assert 'headroom_engine_requests_running{pool="main",replica="gpu0"}' in text
    assert 'headroom_engine_kv_cache_usage_ratio{pool="main",replica="gpu0"}' in text


# -- a busy port: one clear line, no traceback ------------------------------------------


def held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("busy", ["listen", "admin"])
def test_busy_port_fails_with_one_line_naming_the_address(busy: str, tmp_path: Path) -> None:
    with held_port() as holder, held_port() as spare:
        port = holder.getsockname()[1]
        free = spare.getsockname()[1]
        spare.close()  # a port that was free a moment ago, for the other listener
        cfg = config("http://127.0.0.1:9", 1)
        cfg["listen"]["port"] = port if busy == "listen" else free
        cfg["admin"]["port"] = port if busy == "admin" else free
        path = tmp_path / "headroom.yaml"
        path.write_text(yaml.safe_dump(cfg))
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "serve", "--config", str(path)],
            capture_output=True, text=True, timeout=60, env={**os.environ, "HEADROOM_CONFIG": ""},
        )  # fmt: skip
    what = "listener" if busy == "listen" else "admin listener"
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"headroom: cannot bind the {what} to 127.0.0.1:{port}: Address already in use"
    )


def test_busy_admin_port_releases_the_listen_port(tmp_path: Path) -> None:
    with held_port() as holder, held_port() as spare:
        listen_port = spare.getsockname()[1]
        spare.close()
        cfg = config("http://127.0.0.1:9", 1)
        cfg["listen"]["port"] = listen_port
        cfg["admin"]["port"] = holder.getsockname()[1]
        admin = f"admin listener to 127.0.0.1:{cfg['admin']['port']}"
        with pytest.raises(ListenError, match=admin) as info:
            Gateway(settings_from_mapping(cfg, env={}))
        # The traceback (kept alive by ``info``) still references the half-built gateway:
        # its listen socket must have been closed, not left bound.
        assert info.value.port == cfg["admin"]["port"]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", listen_port))


# -- reload safety (issue 14 item 7) ----------------------------------------------------


def reloads(gateway: Gateway, result: str) -> float:
    value = gateway.runtime.metrics.registry.get_sample_value(
        "headroom_config_reloads_total", {"result": result}
    )
    assert value is not None
    return value


async def test_pool_added_by_reload_during_drain_refuses_with_draining(
    upstream: Any, tmp_path: Path
) -> None:
    server, _ = upstream
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(server.http_url, 4)))
    async with running_gateway(path) as gateway:
        session = await open_session(gateway)  # keeps the drain from completing
        drain = gateway.drain()
        added = config(server.http_url, 4)
        added["pools"].append(
            {
                "name": "extra",
                "replicas": [{"name": "gpu9", "url": server.http_url, "max_sessions": 4}],
            }
        )
        added["routes"].append({"path": "/ws/extra", "pool": "extra",
                                "protocol": "passthrough-ws"})  # fmt: skip
        path.write_text(yaml.safe_dump(added))
        assert "pool extra: added" in gateway.reload()
        for route in ("/ws/extra", "/ws/echo"):
            with pytest.raises(InvalidStatus) as info:
                await connect(f"ws://127.0.0.1:{gateway.port}{route}", compression=None)
            assert info.value.response.status_code == 503
            assert info.value.response.headers["X-Headroom-Reason"] == "draining"
        assert gateway.runtime.gate.core("extra").draining
        assert gateway.runtime.gate.active == 1
        await session.close()
        await asyncio.wait_for(drain, 10)


async def test_reload_cannot_remove_the_admin_key_while_bound_off_loopback(
    upstream: Any, tmp_path: Path
) -> None:
    import hashlib

    server, _ = upstream
    key = "s3cret-admin-key"
    cfg = config(server.http_url, 1)
    # The reported exposure: bound to every interface (reached here through loopback).
    cfg["admin"] = {"host": "0.0.0.0", "port": 0,
                    "api_key_sha256": hashlib.sha256(key.encode()).hexdigest()}  # fmt: skip
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(cfg))
    async with running_gateway(path) as gateway, httpx.AsyncClient() as client:
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        auth = {"Authorization": f"Bearer {key}"}
        before = gateway.runtime.settings
        # Valid on its own (loopback needs no key), but the socket stays on 0.0.0.0.
        cfg["admin"] = {"host": "127.0.0.1", "port": 0}
        path.write_text(yaml.safe_dump(cfg))
        response = await client.post(admin + "/admin/reload", headers=auth)
        assert response.status_code == 400
        (problem,) = response.json()["problems"]
        assert problem["field"] == "admin.api_key_sha256"
        assert "bound to 0.0.0.0 until a restart" in problem["reason"]
        assert gateway.runtime.settings is before
        assert reloads(gateway, "refused") == 1 and reloads(gateway, "applied") == 0
        for method, url in (("POST", "/admin/drain"), ("GET", "/admin/status")):
            refused = await client.request(method, admin + url)
            assert refused.status_code == 401  # the key still guards the listener
        assert not gateway.runtime.gate.draining
        cfg["admin"] = {"host": "127.0.0.1", "port": 0, "enabled": False}  # same hole
        path.write_text(yaml.safe_dump(cfg))
        await gateway._on_sighup()
        assert gateway.runtime.settings is before and reloads(gateway, "refused") == 2
        rotated = hashlib.sha256(b"rotated-key").hexdigest()  # rotating the key is fine
        cfg["admin"] = {"host": "0.0.0.0", "port": 0, "api_key_sha256": rotated}
        path.write_text(yaml.safe_dump(cfg))
        assert (await client.post(admin + "/admin/reload", headers=auth)).status_code == 200
        assert reloads(gateway, "applied") == 1
        new = {"Authorization": "Bearer rotated-key"}
        assert (await client.get(admin + "/admin/status", headers=auth)).status_code == 401
        assert (await client.get(admin + "/admin/status", headers=new)).status_code == 200


async def test_truncated_file_cannot_turn_authentication_off(
    upstream: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import hashlib

    server, _ = upstream
    cfg = config(server.http_url, 2)
    cfg["auth"] = {"keys": [{"name": "a", "sha256": hashlib.sha256(b"key-a").hexdigest()}]}
    full = yaml.safe_dump(cfg, sort_keys=False)
    path = tmp_path / "headroom.yaml"
    path.write_text(full)
    async with running_gateway(path) as gateway:
        before = gateway.runtime.settings
        path.write_text(full[: full.index("auth:")])  # a partial write that still parses
        with (
            caplog.at_level(logging.ERROR, logger="headroom.gateway"),
            pytest.raises(ConfigError) as info,
        ):
            gateway.reload()
        ((where, why),) = info.value.problems
        assert where == "auth" and "auth: {enabled: false}" in why
        assert "reload refused as unsafe" in caplog.text and "partial write" in caplog.text
        assert gateway.runtime.settings is before and reloads(gateway, "refused") == 1
        with pytest.raises(InvalidStatus) as denied:  # authentication still on
            await connect(ws(gateway), compression=None)
        assert denied.value.response.status_code == 401
        path.write_text("pools: [unclosed")
        await gateway._on_sighup()
        assert reloads(gateway, "invalid") == 1 and gateway.runtime.settings is before
        # Turning it off on purpose is applied, and logged loudly.
        path.write_text(full.replace("auth:\n", "auth:\n  enabled: false\n"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="headroom.gateway"):
            assert "auth updated" in gateway.reload()
        assert "client authentication is now OFF" in caplog.text
        assert gateway.runtime.settings.auth is None and reloads(gateway, "applied") == 1
        session = await open_session(gateway)  # no key needed now
        await session.close()
