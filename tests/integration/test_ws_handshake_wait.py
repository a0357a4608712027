"""A WebSocket client whose handshake is held in the queue gets its refusal in time for
its own handshake timeout: the pool's ``queue.max_handshake_wait_s`` over real sockets,
with Python's websockets client on its library defaults (as vLLM-Omni's example
streaming client uses it). The gateway runs on a FakeClock: the waits are the clock's,
never the test's."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from proxy.clock import FakeClock
from proxy.settings import QueueSettings, Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]


def one_slot(url: str, queue: dict[str, Any]) -> Settings:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "pools": [{"name": "main", "queue": queue,
                       "replicas": [{"name": "gpu0", "url": url, "max_sessions": 1}]}],
            "routes": [
                {"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"},
                {"path": "/ws/feedback", "pool": "main", "protocol": "passthrough-ws",
                 "queue_feedback": True},
                {"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"},
            ],
        },
        env={},
    )  # fmt: skip


def open_timeout_default() -> float:
    """websockets' own default for the whole opening handshake."""
    default = inspect.signature(websockets.connect).parameters["open_timeout"].default
    assert isinstance(default, (int, float))
    return float(default)


async def open_plain(url: str) -> websockets.ClientConnection:
    """The opening handshake as vLLM-Omni's streaming client makes it: every option at
    the library's default (``open_timeout`` included)."""
    return await websockets.connect(url)


def test_the_default_handshake_wait_leaves_the_client_half_its_open_timeout() -> None:
    # The connect, the gateway's own admission and the 503 itself fit in the rest.
    assert QueueSettings().handshake_wait_s <= open_timeout_default() / 2


async def test_a_client_on_websockets_defaults_gets_503_and_retry_after_in_its_handshake(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(one_slot(server.http_url, {"max_depth": 4}), clock)
    queue = proxy.runtime.settings.pool("main").queue
    assert (queue.max_wait_s, queue.handshake_wait_s) == (10, 5)  # the defaults
    holder = await websockets.connect(proxy.ws_url + "/ws/echo")
    await hello(holder)
    # Queued in the order plain, feedback, HTTP: each keeps its own deadline.
    plain = asyncio.create_task(open_plain(proxy.ws_url + "/ws/echo"))
    await wait_until(lambda: proxy.gate.queued == 1)
    feedback = await websockets.connect(proxy.ws_url + "/ws/feedback")
    assert json.loads(await feedback.recv())["type"] == "headroom.queue"
    async with httpx.AsyncClient() as client:
        request = asyncio.create_task(client.post(proxy.http_url + "/echo-http"))
        await wait_until(lambda: proxy.gate.queued == 3)
        clock.advance(queue.handshake_wait_s - 0.1)
        assert proxy.gate.queued == 3 and not plain.done()
        clock.advance(0.1)
        with pytest.raises(InvalidStatus) as info:
            await plain
        response = info.value.response
        assert response.status_code == 503
        assert response.headers["X-Headroom-Reason"] == "queue_timeout"
        retry_after = int(response.headers["Retry-After"])
        assert 1 <= retry_after <= 60
        error = json.loads(response.body)["error"]
        assert error["code"] == "queue_timeout" and error["queue_position"] == 1
        assert error["retry_after_s"] == retry_after
        # The session this client never had is counted as a refusal, not as abandoned.
        refused = {"pool": "main", "decision": "rejected_queue_timeout"}
        assert proxy.metric("headroom_session_decisions_total", **refused) == 1
        assert proxy.metric("headroom_session_decisions_total", pool="main",
                            decision="abandoned") == 0  # fmt: skip
        # The accepted queue-feedback session and the HTTP request wait on to max_wait_s.
        assert proxy.gate.queued == 2
        moved = json.loads(await feedback.recv())
        assert (moved["type"], moved["position"]) == ("headroom.queue", 1)
        clock.advance(queue.max_wait_s - queue.handshake_wait_s)
        event = json.loads(await feedback.recv())
        assert event["type"] == "error" and event["error"]["code"] == "queue_timeout"
        await feedback.wait_closed()
        assert feedback.close_code == 1013
        assert (await request).status_code == 503
    await holder.close()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_a_handshake_wait_of_0_refuses_a_plain_client_at_once_while_http_queues(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    clock = FakeClock()
    queue = {"max_depth": 4, "max_wait_s": 10, "max_handshake_wait_s": 0}
    proxy: Proxy = await start_proxy(one_slot(server.http_url, queue), clock)
    holder = await websockets.connect(proxy.ws_url + "/ws/echo")
    await hello(holder)
    with pytest.raises(InvalidStatus) as info:
        await websockets.connect(proxy.ws_url + "/ws/echo")
    assert info.value.response.status_code == 503
    assert info.value.response.headers["X-Headroom-Reason"] == "pool_full"
    assert "Retry-After" in info.value.response.headers
    async with httpx.AsyncClient() as client:
        request = asyncio.create_task(client.post(proxy.http_url + "/echo-http"))
        await wait_until(lambda: proxy.gate.queued == 1)
        await holder.close()
        assert (await request).status_code == 200
    await wait_until(lambda: proxy.gate.active == 0)


def test_the_demo_states_both_waits_and_takes_its_handshake_wait() -> None:
    from proxy.errors import ConfigError
    from proxy.process.demo import _queue_lines, demo_settings
    from proxy.sim.presets import get_preset

    preset = get_preset("l40s-qwen3tts-1.7b")
    common: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "queue_depth": 8}
    urls = ["http://127.0.0.1:1"]
    default = demo_settings(preset, urls, 4, queue_wait=10, **common)
    assert default.pool("tts-main").queue.handshake_wait_s == 5
    lines = "\n".join(_queue_lines(default))
    assert "up to 8 waiting per pool" in lines
    assert "10 s for HTTP (--queue-wait); 5 s for a WebSocket, its handshake held" in lines
    assert "inside the client's own handshake timeout (10 s in Python's websockets)" in lines
    late = demo_settings(preset, urls, 4, queue_wait=10, handshake_wait=10, **common)
    assert "NOT inside the client's own handshake timeout" in "\n".join(_queue_lines(late))
    given = demo_settings(preset, urls, 4, queue_wait=10, handshake_wait=2, **common)
    assert given.pool("tts-main").queue.handshake_wait_s == 2
    short = demo_settings(preset, urls, 4, queue_wait=3, **common)
    assert short.pool("tts-main").queue.handshake_wait_s == 3
    with pytest.raises(ConfigError, match="max_handshake_wait_s"):
        demo_settings(preset, urls, 4, queue_wait=3, handshake_wait=4, **common)
