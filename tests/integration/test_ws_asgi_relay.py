"""The ASGI relay (proxy/relay/asgi_relay.py), the shell sessions use when the splice cannot
run (the uvicorn fence's fallback protocol), applies the relay core's rules like the
splice: limits, timeouts and close codes. Real sockets, uvicorn's own protocol; each
session waits in a queue-feedback route's queue first (the early accept the ASGI relay
must continue from). Fake clock for timeouts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from proxy.clock import FakeClock
from proxy.process.serving import UVICORN_ONLY
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import hello, upstream, wait_until, ws_route

__all__ = ["upstream"]  # the fixture, re-exported for pytest

QUEUE = {"max_depth": 5, "max_wait_s": 60}


async def queued_session(proxy: Proxy, path: str = "/ws/echo") -> ClientConnection:
    """A session admitted after queueing with feedback: relayed by the ASGI relay."""
    holder = await connect(proxy.ws_url + path, compression=None)
    if path == "/ws/echo":
        await hello(holder)
    ws = await connect(proxy.ws_url + path, compression=None)
    assert json.loads(await ws.recv())["type"] == "headroom.queue"
    await holder.close()
    assert json.loads(await ws.recv()) == {"type": "headroom.admitted"}
    return ws


async def test_idle_timeout_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route(queue_feedback=True)],
                       queue=QUEUE, limits={"idle_timeout_s": 30, "max_session_s": 0}),
        clock, **UVICORN_ONLY,
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    clock.advance(20)
    await ws.send("still here")  # activity resets the idle timer
    assert await ws.recv() == "still here"
    clock.advance(20)
    await ws.send("ping")
    assert await ws.recv() == "ping"
    clock.advance(31)
    with pytest.raises(ConnectionClosed):
        await ws.recv()
    assert (ws.close_code, ws.close_reason) == (1008, "idle timeout")
    await wait_until(lambda: proxy.gate.active == 0 and app.controls.ws_active == 0)


async def test_max_session_duration_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route(queue_feedback=True)],
                       queue=QUEUE, limits={"idle_timeout_s": 0, "max_session_s": 100}),
        clock, **UVICORN_ONLY,
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    clock.advance(101)
    with pytest.raises(ConnectionClosed):
        await ws.recv()
    assert ws.close_code == 1008 and "maximum session duration" in (ws.close_reason or "")
    await wait_until(lambda: proxy.gate.active == 0)


async def test_oversized_client_message_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route(queue_feedback=True)],
                       queue=QUEUE, limits={"max_message_bytes": 4096}),
        **UVICORN_ONLY,
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    await ws.send(b"a" * 4096)  # at the limit: relayed
    assert await ws.recv() == b"a" * 4096
    await ws.send("é" * 2049)  # 4098 bytes in UTF-8: over, though 2049 characters
    with pytest.raises(ConnectionClosed):
        await ws.recv()
    assert (ws.close_code, ws.close_reason) == (1008, "message over 4096 bytes")
    await wait_until(lambda: proxy.gate.active == 0 and app.controls.ws_active == 0)


async def test_upstream_close_code_reaches_the_client(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route(queue_feedback=True)],
                       queue=QUEUE),
        **UVICORN_ONLY,
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    await ws.send("close:4001:custom reason")
    with pytest.raises(ConnectionClosed):
        await ws.recv()
    assert (ws.close_code, ws.close_reason) == (4001, "custom reason")
    await wait_until(lambda: proxy.gate.active == 0)


async def test_client_close_code_reaches_the_upstream(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route(queue_feedback=True)],
                       queue=QUEUE),
        **UVICORN_ONLY,
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    await ws.close(4002, "bye")
    await wait_until(lambda: 4002 in app.controls.client_close_codes)
    await wait_until(lambda: proxy.gate.active == 0)


async def test_upstream_killed_mid_stream_gives_1014(start_proxy: Any) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    conns: list[ServerConnection] = []
    streaming = asyncio.Event()

    async def handler(conn: ServerConnection) -> None:
        conns.append(conn)
        if len(conns) == 2:  # the queued session
            await conn.send(b"\x00" * 4800)
            streaming.set()
        await conn.wait_closed()

    async with serve(handler, "127.0.0.1", 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)],
                           [ws_route("/anything", queue_feedback=True)], queue=QUEUE),
            **UVICORN_ONLY,
        )  # fmt: skip
        ws = await queued_session(proxy, "/anything")
        assert await ws.recv() == b"\x00" * 4800
        await streaming.wait()
        conns[1].transport.abort()  # the upstream dies without a close frame
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert ws.close_code == 1014
        await wait_until(lambda: proxy.gate.active == 0)
        assert (
            proxy.metric(
                "headroom_upstream_errors_total", pool="main", replica="gpu0", kind="midstream"
            )
            == 1
        )
