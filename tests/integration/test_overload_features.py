"""Fallback routing and queue feedback over real sockets."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.settings import Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]


def two_pools(url: str, **route: Any) -> Settings:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "pools": [
                {"name": "main", "replicas": [{"name": "gpu0", "url": url, "max_sessions": 1}],
                 "fallback": {"voice": "lite-1", "pool": "lite"}},
                {"name": "lite", "replicas": [{"name": "cpu0", "url": url, "max_sessions": 1}]},
            ],
            "routes": [
                {"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws", **route},
                {"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"},
            ],
        },
        env={},
    )  # fmt: skip


async def test_fallback_only_when_the_client_opts_in(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(two_pools(server.http_url))
    holder = await connect(proxy.ws_url + "/ws/echo", compression=None)
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/ws/echo", compression=None)
    body = json.loads(info.value.response.body)["error"]
    assert body["fallback"] == {"voice": "lite-1", "pool": "lite", "url": None}
    async with connect(proxy.ws_url + "/ws/echo?headroom_fallback=1&x=2", compression=None) as ws:
        assert ws.response.headers["X-Headroom-Fallback"] == "lite"
        greeting = await hello(ws)
        assert greeting["query"] == "x=2"  # Headroom's own parameter is not forwarded
        stats = proxy.gate.statistics()
        assert stats["lite"].active == 1 and stats["main"].active == 1
    async with httpx.AsyncClient() as client:
        refused = await client.post(proxy.http_url + "/echo-http")
        assert refused.status_code == 503
        fell_back = await client.post(
            proxy.http_url + "/echo-http", headers={"X-Headroom-Allow-Fallback": "1"}
        )
        assert fell_back.status_code == 200
        assert fell_back.headers["x-headroom-fallback"] == "lite"
        assert "x-headroom-allow-fallback" not in fell_back.json()["headers"]
    await holder.close()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_fallback_full_too_gives_the_primary_refusal(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(two_pools(server.http_url))
    main = await connect(proxy.ws_url + "/ws/echo", compression=None)
    lite = await connect(proxy.ws_url + "/ws/echo?headroom_fallback=1", compression=None)
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/ws/echo?headroom_fallback=1", compression=None)
    assert info.value.response.headers["X-Headroom-Reason"] == "pool_full"
    await main.close()
    await lite.close()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_queue_feedback_positions_then_admitted(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    settings = settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "pools": [{"name": "main", "queue": {"max_depth": 5, "max_wait_s": 60},
                       "replicas": [{"name": "gpu0", "url": server.http_url,
                                     "max_sessions": 1}]}],
            "routes": [{"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws",
                        "queue_feedback": True}],
        },
        env={},
    )  # fmt: skip
    proxy: Proxy = await start_proxy(settings)
    holder = await connect(proxy.ws_url + "/ws/echo", compression=None)
    await hello(holder)  # admitted at once: no feedback events, straight to the upstream
    first = await connect(proxy.ws_url + "/ws/echo", compression=None)
    assert json.loads(await first.recv()) == {
        "type": "headroom.queue", "position": 1, "eta_s": pytest.approx(20.0, abs=1)
    }  # fmt: skip
    await first.send("sent while waiting")  # held, relayed after admission
    second = await connect(proxy.ws_url + "/ws/echo", compression=None)
    assert json.loads(await second.recv())["position"] == 2
    await holder.close()
    assert json.loads(await first.recv()) == {"type": "headroom.admitted"}
    await hello(first)
    assert await first.recv() == "sent while waiting"
    assert json.loads(await second.recv())["position"] == 1  # moved up
    await first.close()
    assert json.loads(await second.recv()) == {"type": "headroom.admitted"}
    await hello(second)
    await second.close()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_queue_feedback_timeout_is_an_error_event_and_1013(
    start_proxy: Any, upstream: Any
) -> None:
    from proxy.clock import FakeClock

    server, _ = upstream
    settings = settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "pools": [{"name": "main", "queue": {"max_depth": 5, "max_wait_s": 10},
                       "replicas": [{"name": "gpu0", "url": server.http_url,
                                     "max_sessions": 1}]}],
            "routes": [{"path": "/v1/realtime", "pool": "main", "protocol": "vllm-realtime",
                        "queue_feedback": True}],
        },
        env={},
    )  # fmt: skip
    clock = FakeClock()
    proxy: Proxy = await start_proxy(settings, clock)
    holder = await connect(proxy.ws_url + "/v1/realtime", compression=None)
    waiter = await connect(proxy.ws_url + "/v1/realtime", compression=None)
    assert json.loads(await waiter.recv())["type"] == "headroom.queue"
    clock.advance(11)
    event = json.loads(await waiter.recv())
    assert event["type"] == "error" and event["code"] == "queue_timeout"
    assert event["queue_position"] == 1
    await waiter.wait_closed()
    assert waiter.close_code == 1013
    await holder.close()
    await wait_until(lambda: proxy.gate.active == 0)
