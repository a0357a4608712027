"""A WebSocket upgrade that comes after a plain HTTP request on a kept-alive connection
is served by Headroom's client listener like a connection's first head (uvicorn's HTTP
protocol hands the connection over once its response is written; proxy/process/gateway.py
gives it the listener class as its WebSocket protocol): the session is spliced and the
relay core's rules hold -- limits, timeouts and close codes. Real sockets; each session
is upgraded on a connection that first carried GET /healthz, and waits in a
queue-feedback route's queue first (the early accept the relay continues from). Fake
clock for timeouts. A WebSocket scope from a server without the listener's take-over is
refused before admission."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.clock import FakeClock
from tests.conftest import Proxy, proxy_settings
from tests.integration.abortable_ws_upstream import UpstreamConnection, abortable_ws_upstream
from tests.integration.test_ws_relay import hello, upstream, wait_until, ws_route

__all__ = ["upstream"]  # the fixture, re-exported for pytest

QUEUE = {"max_depth": 5, "max_wait_s": 60}


async def kept_alive(proxy: Proxy) -> socket.socket:
    """A connection to the gateway that has carried one plain request (GET /healthz)
    and its whole response, and is kept alive."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", proxy.server.port))
    await loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += await loop.sock_recv(sock, 65536)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head.lower()
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )  # fmt: skip
    while len(body) < length:
        body += await loop.sock_recv(sock, 65536)
    assert json.loads(body) == {"status": "alive"}
    return sock


async def queued_session(proxy: Proxy, path: str = "/ws/echo") -> ClientConnection:
    """A session upgraded on a kept-alive connection and admitted after queueing with
    feedback."""
    holder = await connect(proxy.ws_url + path, compression=None)
    if path == "/ws/echo":
        await hello(holder)
    ws = await connect(proxy.ws_url + path, sock=await kept_alive(proxy), compression=None)
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
        clock,
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
        clock,
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
    )  # fmt: skip
    ws = await queued_session(proxy)
    await hello(ws)
    await ws.close(4002, "bye")
    await wait_until(lambda: 4002 in app.controls.client_close_codes)
    await wait_until(lambda: proxy.gate.active == 0)


async def test_upstream_killed_mid_stream_gives_1014(start_proxy: Any) -> None:
    streaming = asyncio.Event()

    async def on_open(conn: UpstreamConnection) -> None:
        if len(upstream.connections) == 2:  # the queued session
            await conn.send(b"\x00" * 4800)
            streaming.set()

    async with abortable_ws_upstream(on_open) as upstream:
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", upstream.url, 1)],
                           [ws_route("/anything", queue_feedback=True)], queue=QUEUE),
        )  # fmt: skip
        ws = await queued_session(proxy, "/anything")
        assert await ws.recv() == b"\x00" * 4800
        await streaming.wait()
        upstream.connections[1].abort()  # the upstream dies without a close frame
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


async def test_a_plain_session_after_keepalive_is_spliced(start_proxy: Any, upstream: Any) -> None:
    """No queue: the upgrade after GET /healthz is answered with the upstream's 101 and
    relayed byte for byte, like a connection's first head."""
    server, app = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 1)], [ws_route()]))
    ws = await connect(proxy.ws_url + "/ws/echo", sock=await kept_alive(proxy), compression=None)
    await hello(ws)
    await ws.send(b"\x01\x02")
    assert await ws.recv() == b"\x01\x02"
    await ws.close()
    await wait_until(lambda: proxy.gate.active == 0 and app.controls.ws_active == 0)


async def test_without_the_listener_a_websocket_session_is_refused_before_admission(
    start_proxy: Any, upstream: Any
) -> None:
    """The app under uvicorn's own protocols (no take-over of the socket): the handshake
    is refused and no slot is taken."""
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route()]),
        http="h11", ws="websockets-sansio",
    )  # fmt: skip
    with pytest.raises(InvalidStatus) as refused:
        await connect(proxy.ws_url + "/ws/echo", compression=None)
    assert refused.value.response.status_code == 403  # uvicorn's answer to a close
    assert proxy.gate.active == 0 and app.controls.ws_active == 0
