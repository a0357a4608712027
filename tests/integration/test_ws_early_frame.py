"""A WebSocket frame sent in the same packet as the upgrade head is relayed (issue 26,
item 8): RFC 6455 asks a client to wait for the 101, but bytes that come early anyway are
held and relayed, not dropped. Over a raw socket, with the head and a masked text frame
in one write, and the same split over two writes; through the splice's protocol and
through uvicorn's own (the ASGI relay, where the splice cannot run).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from typing import Any

import pytest

from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import upstream, wait_until, ws_route

__all__ = ["upstream"]

HEAD = (b"GET /ws/echo HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip


def masked_text(text: str) -> bytes:
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return struct.pack("!BB", 0x81, 0x80 | len(payload)) + mask + masked


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first, second = await asyncio.wait_for(reader.readexactly(2), 30)
    length = second & 0x7F
    if length == 126:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
    elif length == 127:
        (length,) = struct.unpack("!Q", await reader.readexactly(8))
    return first & 0x0F, await asyncio.wait_for(reader.readexactly(length), 30)


@pytest.mark.parametrize("writes", ["one", "two"])
async def test_a_frame_in_the_upgrade_packet_is_relayed(
    start_proxy: Any, upstream: Any, writes: str
) -> None:
    server, _ = upstream
    settings = proxy_settings([("gpu0", server.http_url, 1)], [ws_route()])
    proxy: Proxy = await start_proxy(settings)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    frame = masked_text("early bird")
    if writes == "one":
        writer.write(HEAD + frame)  # one write: one packet on loopback
    else:
        writer.write(HEAD)
        await writer.drain()
        writer.write(frame)  # before the 101 has been read
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert head.startswith(b"HTTP/1.1 101"), head
    opcode, hello = await read_frame(reader)
    assert opcode == 1 and json.loads(hello)["type"] == "hello"
    opcode, echoed = await read_frame(reader)
    assert (opcode, echoed) == (1, b"early bird")
    writer.transport.abort()
    await wait_until(lambda: proxy.gate.active == 0)
