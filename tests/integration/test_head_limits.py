"""Request heads are bounded in size, header count and time before anything else runs
(proxy.relay.listener): an oversized head or too many header lines get 431, a head
that does not arrive in time gets 408 (or a silent close if nothing arrived), and none of
it reaches the upstream. HTTP requests and WebSocket upgrades alike; real sockets on
127.0.0.1, an upstream that counts what it is asked."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.wsraw import handshake_request, read_head
from proxy.process.gateway import Gateway
from proxy.process.serving import RunningServer, running_server
from proxy.relay.listener import client_listener
from proxy.relay.ws_server import WebSocketSessions
from proxy.settings import LimitsSettings, load_settings
from tests.conftest import Proxy, proxy_settings

MiB = 1024 * 1024


class CountingUpstream:
    """An ASGI app that counts HTTP requests and WebSocket handshakes, answers HTTP with
    a small 200 and accepts WebSockets until the client closes."""

    def __init__(self) -> None:
        self.http = 0
        self.websocket = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.http += 1
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"ok"})
        elif scope["type"] == "websocket":
            self.websocket += 1
            await receive()
            await send({"type": "websocket.accept"})
            while (await receive())["type"] != "websocket.disconnect":
                pass


@pytest.fixture
async def counting() -> AsyncIterator[tuple[RunningServer, CountingUpstream]]:
    app = CountingUpstream()
    async with running_server(app) as server:
        yield server, app


async def start(start_proxy: Any, server: RunningServer, **limits: Any) -> Proxy:
    routes = [
        {"path": "/http", "pool": "main", "protocol": "passthrough-http"},
        {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"},
    ]
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 4)], routes, limits=limits,
                       guard={"mode": "off"})
    )  # fmt: skip
    return proxy


def get(path: str = "/http", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"


async def send_and_read_head(port: int, request: bytes) -> tuple[int | None, bytes]:
    """Send ``request`` (however big: written in the background, the server may stop
    reading it) and return the response's status and everything read until EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def write() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(request)
            await writer.drain()

    writing = asyncio.ensure_future(write())
    try:
        data = await asyncio.wait_for(reader.read(), 30)  # until EOF
    except ConnectionError:
        data = b""
    finally:
        writing.cancel()
        with contextlib.suppress(BaseException):
            await writing
        writer.close()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, data


async def test_a_16_mb_header_gets_431_and_nothing_reaches_the_upstream(
    start_proxy: Any, counting: Any
) -> None:
    server, upstream = counting
    proxy = await start(start_proxy, server)
    huge = b"X-Pad: " + b"a" * (16 * MiB) + b"\r\n"
    status, data = await send_and_read_head(proxy.server.port, get(extra=huge))
    assert status == 431, data[:200]
    assert b"connection: close" in data.lower()
    # the same for a WebSocket upgrade
    upgrade = handshake_request("/ws", headers=[("X-Pad", "a" * (16 * MiB))])
    status, data = await send_and_read_head(proxy.server.port, upgrade)
    assert status == 431, data[:200]
    assert upstream.http == 0 and upstream.websocket == 0
    assert proxy.gate.active == 0
    # and normal requests still work
    status, data = await send_and_read_head(proxy.server.port, get(extra=b"Connection: close\r\n"))
    assert status == 200 and upstream.http == 1, data


async def test_a_head_just_under_the_size_limit_is_served(start_proxy: Any, counting: Any) -> None:
    server, upstream = counting
    proxy = await start(start_proxy, server, max_head_bytes=4096)
    base = get(extra=b"Connection: close\r\nX-Pad: \r\n")
    pad = b"a" * (4096 - len(base))
    status, _ = await send_and_read_head(
        proxy.server.port, get(extra=b"Connection: close\r\nX-Pad: " + pad + b"\r\n")
    )
    assert status == 200 and upstream.http == 1
    status, _ = await send_and_read_head(
        proxy.server.port, get(extra=b"Connection: close\r\nX-Pad: a" + pad + b"\r\n")
    )
    assert status == 431 and upstream.http == 1


@pytest.mark.parametrize("kind", ["http", "websocket"])
async def test_more_than_max_headers_gets_431(start_proxy: Any, counting: Any, kind: str) -> None:
    server, upstream = counting
    proxy = await start(start_proxy, server)  # max_headers: 100 (the default)

    def request(lines: int) -> bytes:
        if kind == "http":  # Host and Connection, plus the padding
            pad = b"".join(b"X-%d: v\r\n" % i for i in range(lines - 2))
            return get(extra=b"Connection: close\r\n" + pad)
        return handshake_request("/ws", headers=[(f"X-{i}", "v") for i in range(lines - 5)])

    status, data = await send_and_read_head(proxy.server.port, request(101))
    assert status == 431, data[:200]
    assert upstream.http == 0 and upstream.websocket == 0
    if kind == "http":  # exactly 100 lines are fine
        status, _ = await send_and_read_head(proxy.server.port, request(100))
        assert status == 200 and upstream.http == 1
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(request(100))
        head = await asyncio.wait_for(read_head(reader), 30)
        writer.close()
        assert head is not None and head.status == 101 and upstream.websocket == 1


async def trickle(writer: asyncio.StreamWriter, data: bytes, closed: asyncio.Event) -> None:
    """One byte every 20 ms (forever, if ``data`` were long enough) until the server
    closes the connection."""
    for byte in data:
        if closed.is_set():
            return
        try:
            writer.write(bytes((byte,)))
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind", ["http", "websocket"])
async def test_a_trickled_head_is_answered_408_and_closed(
    start_proxy: Any, counting: Any, kind: str
) -> None:
    server, upstream = counting
    proxy = await start(start_proxy, server, handshake_timeout_s=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    request = get() if kind == "http" else handshake_request("/ws")
    closed = asyncio.Event()
    # 20 ms a byte: the whole head would take seconds, far beyond the 0.2 s allowed
    trickling = asyncio.ensure_future(trickle(writer, request * 20, closed))
    try:
        data = await asyncio.wait_for(reader.read(), 30)  # the server closes it
    finally:
        closed.set()
        await trickling
        writer.close()
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert upstream.http == 0 and upstream.websocket == 0


async def test_a_connection_that_sends_nothing_is_closed_silently(
    start_proxy: Any, counting: Any
) -> None:
    server, _ = counting
    proxy = await start(start_proxy, server, handshake_timeout_s=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    assert await asyncio.wait_for(reader.read(), 30) == b""
    writer.close()


async def test_keep_alive_requests_are_limited_too(start_proxy: Any, counting: Any) -> None:
    server, upstream = counting
    proxy = await start(start_proxy, server, max_head_bytes=4096, handshake_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    try:
        # /healthz: the proxy's own, so the short timeouts touch nothing upstream
        writer.write(get("/healthz"))
        head = await asyncio.wait_for(read_head(reader), 30)
        assert head is not None and head.status == 200
        # the second request's head is over the limit: the connection closes without an
        # answer (a response of uvicorn's could be under way on it)
        writer.write(get("/http", b"X-Pad: " + b"a" * 5000 + b"\r\n"))
        rest = head.rest + await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    assert b"HTTP/1.1" not in rest, rest
    assert upstream.http == 0

    # after a response, the next head must arrive within the deadline too
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    closed = asyncio.Event()
    try:
        writer.write(get("/healthz"))
        head = await asyncio.wait_for(read_head(reader), 30)
        assert head is not None and head.status == 200
        trickling = asyncio.ensure_future(trickle(writer, get("/http") * 20, closed))
        rest = head.rest + await asyncio.wait_for(reader.read(), 30)
        closed.set()
        await trickling
    finally:
        writer.close()
    assert b"HTTP/1.1" not in rest, rest
    assert upstream.http == 0


async def test_the_limits_are_read_live_for_each_head() -> None:
    """A configuration reload applies to the next head (the gateway passes the running
    configuration's limits)."""
    current = [LimitsSettings(max_head_bytes=4096)]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    request = get("/", b"Connection: close\r\nX-Pad: " + b"a" * 8000 + b"\r\n")
    listener = client_listener(app, lambda: current[0], WebSocketSessions())
    async with running_server(app, http=listener, lifespan="off") as s:
        status, _ = await send_and_read_head(s.port, request)
        assert status == 431
        current[0] = LimitsSettings(max_head_bytes=16384)
        status, _ = await send_and_read_head(s.port, request)
        assert status == 204


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
        ready.cancel()
        gateway.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)


async def test_the_gateway_bounds_both_listeners_and_a_reload_applies(
    counting: Any, tmp_path: Path
) -> None:
    """The client listener and the admin listener both refuse an oversized head before
    authentication (the admin key and a client key are configured: neither is asked);
    a reload that lowers the limit applies to the next head."""
    server, upstream = counting

    def config(max_head_bytes: int) -> dict[str, Any]:
        return {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0, "api_key_sha256": "0" * 64},
            "auth": {"keys": [{"name": "a", "sha256": "1" * 64}]},
            "limits": {"max_head_bytes": max_head_bytes},
            "pools": [{"name": "main", "replicas": [{"name": "gpu0", "url": server.http_url,
                                                     "max_sessions": 2}]}],
            "routes": [{"path": "/http", "pool": "main", "protocol": "passthrough-http"}],
        }  # fmt: skip

    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config(8192)))
    pad = b"X-Pad: " + b"a" * 6000 + b"\r\n"
    async with running_gateway(path) as gateway:
        assert gateway.admin_port is not None
        huge = b"X-Pad: " + b"a" * (16 * MiB) + b"\r\n"
        for port, target in [(gateway.port, "/http"), (gateway.admin_port, "/admin/status")]:
            status, data = await send_and_read_head(port, get(target, huge))
            assert status == 431, (target, data[:200])
            # under the limit, the request reaches authentication (401), not a 431
            status, _ = await send_and_read_head(port, get(target, b"Connection: close\r\n" + pad))
            assert status == 401, target
        path.write_text(yaml.safe_dump(config(4096)))
        gateway.reload()
        for port, target in [(gateway.port, "/http"), (gateway.admin_port, "/admin/status")]:
            status, _ = await send_and_read_head(port, get(target, b"Connection: close\r\n" + pad))
            assert status == 431, target
    assert upstream.http == 0
