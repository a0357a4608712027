"""Client authentication and tenant quotas, over real sockets."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.settings import Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def settings(url: str, refusal: str = "http") -> Settings:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "pools": [
                {"name": "main", "replicas": [{"name": "gpu0", "url": url, "max_sessions": 4}],
                 "queue": {"max_depth": 2, "max_wait_s": 10}},
                {"name": "lite", "replicas": [{"name": "cpu0", "url": url, "max_sessions": 4}]},
            ],
            "routes": [
                {"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws",
                 "refusal": refusal},
                {"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"},
                {"path": "/lite", "pool": "lite", "protocol": "passthrough-ws"},
            ],
            "auth": {"keys": [
                {"name": "team-a", "sha256": sha("key-a"), "pools": ["main"], "max_sessions": 1},
                {"name": "team-b", "sha256": sha("key-b"), "pools": ["lite"]},
            ]},
        },
        env={},
    )  # fmt: skip


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_wrong_and_forbidden_keys_take_no_slot(
    start_proxy: Any, upstream: Any
) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(settings(server.http_url))
    for headers, status in (({}, 401), (bearer("nope"), 401), (bearer("key-b"), 403)):
        with pytest.raises(InvalidStatus) as info:
            await connect(proxy.ws_url + "/ws/echo", additional_headers=headers,
                          compression=None)  # fmt: skip
        assert info.value.response.status_code == status
        body = json.loads(info.value.response.body)["error"]
        assert body["type"] == "invalid_request_error"
        assert body["code"] == ("forbidden" if status == 403 else "unauthorized")
        challenge = info.value.response.headers.get("WWW-Authenticate")
        assert challenge == ('Bearer realm="headroom"' if status == 401 else None)
        assert proxy.gate.active == 0 and proxy.gate.queued == 0
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/echo-http", content=b"x" * 100_000)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="headroom"'
        wrong = await client.post(proxy.http_url + "/echo-http", headers=bearer("nope"))
        assert wrong.status_code == 401
        assert wrong.headers["WWW-Authenticate"] == 'Bearer realm="headroom"'
        allowed = await client.post(proxy.http_url + "/echo-http", headers=bearer("key-a"))
        assert "WWW-Authenticate" not in allowed.headers
    assert app.controls.ws_connections == 0  # the upstream never saw any of them


async def test_bearer_and_query_keys_are_consumed_not_forwarded(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(settings(server.http_url))
    async with connect(proxy.ws_url + "/ws/echo?api_key=key-a&v=1", compression=None) as ws:
        greeting = await hello(ws)
        assert greeting["query"] == "v=1"
        assert "authorization" not in greeting["headers"]
    await wait_until(lambda: proxy.gate.active == 0)
    async with connect(proxy.ws_url + "/lite", additional_headers=bearer("key-b"),
                       compression=None) as ws:  # fmt: skip
        assert "authorization" not in (await hello(ws))["headers"]
    await wait_until(lambda: proxy.gate.active == 0)


async def test_tenant_limit_is_429_and_other_tenants_are_unaffected(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(settings(server.http_url))
    first = await connect(proxy.ws_url + "/ws/echo", additional_headers=bearer("key-a"),
                          compression=None)  # fmt: skip
    await hello(first)
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/ws/echo", additional_headers=bearer("key-a"),
                      compression=None)  # fmt: skip
    response = info.value.response
    assert response.status_code == 429
    assert response.headers["X-Headroom-Reason"] == "tenant_limit"
    assert int(response.headers["Retry-After"]) >= 1
    async with connect(proxy.ws_url + "/lite", additional_headers=bearer("key-b"),
                       compression=None) as other:  # fmt: skip
        await hello(other)
    await first.close()
    await wait_until(lambda: proxy.runtime.tenants.active("team-a") == 0)
    again = await connect(proxy.ws_url + "/ws/echo", additional_headers=bearer("key-a"),
                          compression=None)  # fmt: skip
    await again.close()
    await wait_until(lambda: proxy.gate.active == 0)
    assert (
        proxy.metric(
            "headroom_session_decisions_total", pool="main", decision="rejected_tenant_limit"
        )
        == 1
    )


async def test_close_mode_unauthorized_is_1008(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(settings(server.http_url, refusal="close"))
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        event = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert event["error"]["code"] == "unauthorized"
    assert ws.close_code == 1008


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage() + json.dumps(getattr(record, "fields", {})))


async def test_keys_never_appear_in_logs(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(settings(server.http_url))
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "headroom.session")]
    for logger in loggers:
        logger.addHandler(handler)
    old = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    try:
        async with connect(proxy.ws_url + "/ws/echo?api_key=key-a", compression=None) as ws:
            await hello(ws)
        with pytest.raises(InvalidStatus):
            await connect(proxy.ws_url + "/ws/echo?api_key=wrong-key-xyz", compression=None)
        await wait_until(lambda: proxy.gate.active == 0)
        await wait_until(lambda: len(handler.lines) >= 2)
    finally:
        for logger, level in zip(loggers, old, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    text = "\n".join(handler.lines)
    assert "key-a" not in text and "wrong-key-xyz" not in text
    assert '"status": 401' in text  # the refused session was logged, without its key
