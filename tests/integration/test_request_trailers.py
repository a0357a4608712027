"""Trailers of a chunked request body are dropped and bounded (issue 26, item 3).

RFC 9110, 6.5.1: trailer fields are not header fields. Over real sockets, with a raw
upstream that echoes the headers it got: a small trailer is relayed as nothing at all
(the request itself is), and a 5 MB one ends the connection once the trailers pass
``limits.max_head_bytes`` -- nothing reaches the upstream and the gateway stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import raw_upstream
from tests.integration.test_ws_relay import wait_until

HEAD = (b"POST /v1/stream HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
        b"x-head: h\r\n\r\n")  # fmt: skip


def settings(url: str) -> Any:
    return proxy_settings(
        [("gpu0", url, 2)],
        [{"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"}],
    )


async def test_a_trailer_is_not_relayed_as_a_header(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream.url))
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        # the trailers come in a read of their own and in the same read as the body
        for request in (HEAD + b"5\r\nhello\r\n0\r\nx-trail: t\r\nx-other: o\r\n\r\n",
                        HEAD + b"5\r\nhello\r\n0\r\n", b"x-trail: t\r\n\r\n"):  # fmt: skip
            writer.write(request)
            await writer.drain()
            if request.endswith(b"0\r\n"):
                continue
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            echoed = json.loads(await asyncio.wait_for(reader.readexactly(length), 30))
            names = [name for name, _ in echoed["headers"]]
            assert "x-head" in names and "x-trail" not in names and "x-other" not in names
        writer.close()
        assert len(upstream.requests) == 2
        await wait_until(lambda: proxy.gate.active == 0)


async def test_a_5_mb_trailer_closes_the_connection_unread(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream.url))
        limit = proxy.runtime.settings.limits.max_head_bytes
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(HEAD + b"5\r\nhello\r\n0\r\nx-big: ")
        closed = asyncio.ensure_future(reader.read())  # EOF: the gateway closed it
        sent = 0
        with contextlib.suppress(ConnectionError):
            while not closed.done() and sent < 5_000_000:
                writer.write(b"a" * 16384)
                sent += 16384
                await writer.drain()
                await asyncio.sleep(0)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(closed, 30) == b""  # closed, nothing answered
        writer.transport.abort()
        # the gateway stopped reading soon after the limit: well short of the 5 MB
        assert sent < 5_000_000, sent
        assert sent >= limit
        assert upstream.requests == []  # nothing was relayed, no x-big anywhere
        await wait_until(lambda: proxy.gate.active == 0)
