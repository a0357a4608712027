"""Slow and hostile clients cannot hold a slot or memory beyond their limits."""

from __future__ import annotations

import asyncio
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from proxy.clock import FakeClock
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import upstream, wait_until

__all__ = ["upstream"]


async def test_ws_client_that_never_reads_is_dropped_and_frees_its_slot(
    start_proxy: Any,
) -> None:
    closed = asyncio.Event()
    sent = 0

    async def flood(conn: ServerConnection) -> None:
        nonlocal sent
        try:
            while True:
                await conn.send(bytes(256 * 1024))
                sent += 1
        except Exception:
            closed.set()

    async with serve(flood, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        clock = FakeClock()
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)],
                           [{"path": "/flood", "pool": "main", "protocol": "passthrough-ws"}],
                           limits={"client_write_timeout_s": 20, "idle_timeout_s": 0}),
            clock,
        )  # fmt: skip
        client = await connect(proxy.ws_url + "/flood", compression=None, max_size=None,
                               max_queue=1, close_timeout=1)  # fmt: skip
        # The client never calls recv(): its socket fills, the proxy's send blocks.
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while proxy.gate.active and loop.time() < end:
            clock.advance(6)
            await asyncio.sleep(0.05)
        assert proxy.gate.active == 0
        await asyncio.wait_for(closed.wait(), 20)  # the upstream was closed too
        assert sent < 400  # backpressure reached the upstream: memory stayed bounded
        await client.close()  # its reading is paused: websockets aborts after close_timeout


async def test_slowloris_body_gets_408_without_a_slot(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)],
                       [{"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"}],
                       limits={"handshake_timeout_s": 10}, guard={"mode": "off"}),
        clock,
    )  # fmt: skip
    # A raw socket: headers promise 100 bytes of body, 10 arrive, then nothing.
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(
        b"POST /echo-http HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        b"Content-Type: application/json\r\n\r\n" + b'{"input": '
    )
    await writer.drain()
    await wait_until(lambda: clock.pending_timers > 0)  # the body deadline is armed
    assert proxy.gate.active == 0 and proxy.gate.queued == 0  # the body holds no slot
    clock.advance(11)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    await writer.wait_closed()
    assert head.startswith(b"HTTP/1.1 408")

    await wait_until(lambda: proxy.gate.active == 0)
