"""A client frame that breaks RFC 6455 is refused with 1002 and never reaches the
upstream: on a connection's first head, and on an upgrade that comes after a plain
request on a kept-alive connection (the session waits with queue feedback first); both
are spliced. Real sockets on 127.0.0.1: a raw
client (bench/wsraw.py) and a raw upstream that records every frame it is sent."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.wsraw import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_TEXT,
    close_frame,
    frame,
    handshake_request,
    read_frames,
    read_head,
)
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import wait_until

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass
class Conn:
    frames: list[tuple[int, bytes]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


class RecordingUpstream:
    """A WebSocket server that accepts every handshake, records each frame it reads
    (opcode, unmasked payload), answers a close frame with the same code and closes."""

    def __init__(self) -> None:
        self.conns: list[Conn] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn()
        self.conns.append(conn)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            key = next(
                line.split(b":", 1)[1].strip()
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"sec-websocket-key:")
            )
            accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
            )
            while True:
                b0, b1 = await reader.readexactly(2)
                n = b1 & 0x7F
                if n == 126:
                    (n,) = struct.unpack("!H", await reader.readexactly(2))
                elif n == 127:
                    (n,) = struct.unpack("!Q", await reader.readexactly(8))
                key4 = await reader.readexactly(4) if b1 & 0x80 else b"\0\0\0\0"
                payload = bytes(b ^ key4[i & 3] for i, b in enumerate(await reader.readexactly(n)))
                conn.frames.append((b0 & 0x0F, payload))
                if b0 & 0x0F == OP_CLOSE:
                    writer.write(bytes((0x88, min(len(payload), 2))) + payload[:2])
                    await writer.drain()
                    break
        except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
            pass
        finally:
            conn.closed.set()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture
async def recording_upstream() -> AsyncIterator[RecordingUpstream]:
    upstream = RecordingUpstream()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    upstream.port = server.sockets[0].getsockname()[1]
    async with server:
        yield upstream


def _rsv(raw: bytes, bits: int) -> bytes:
    return bytes((raw[0] | bits,)) + raw[1:]


SECRET = b'{"type": "secret"}'

#: name -> (the offending frame, frames sent before it that are valid and forwarded)
VIOLATIONS: dict[str, tuple[bytes, bytes]] = {
    "unmasked": (frame(OP_TEXT, SECRET, mask=False), b""),
    "rsv1": (frame(OP_TEXT, SECRET, rsv=4), b""),
    "rsv3": (frame(OP_BINARY, SECRET, rsv=1), b""),
    "opcode-0x3": (frame(0x3, SECRET), b""),
    "opcode-0xb": (frame(0xB, SECRET), b""),
    "continuation-first": (frame(OP_CONT, SECRET), b""),
    "new-message-mid-fragment": (frame(OP_TEXT, SECRET), frame(OP_TEXT, b"{", fin=False)),
}


async def _admitted_via_queue(proxy: Proxy, path: str) -> tuple[Any, Any, bytes]:
    """A client that upgraded after a plain request on its kept-alive connection,
    waited with queue feedback and was then admitted."""
    holder_r, holder_w = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    holder_w.write(handshake_request(path))
    head = await read_head(holder_r)
    assert head is not None and head.status == 101
    await wait_until(lambda: proxy.gate.active == 1)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    plain = await read_head(reader)
    assert plain is not None and plain.status == 200
    length = int(plain.headers["content-length"])
    rest = plain.rest + await reader.readexactly(length - len(plain.rest))
    assert rest == b'{"status":"alive"}', rest
    writer.write(handshake_request(path))
    head = await read_head(reader)
    assert head is not None and head.status == 101  # accepted to wait
    await wait_until(lambda: proxy.gate.queued == 1)
    holder_w.write(close_frame(1000))
    await read_frames(holder_r, timeout=10)
    holder_w.close()
    got = await read_frames(reader, head.rest, timeout=10, until_text="headroom.admitted")
    assert got.frames and b"headroom.admitted" in got.frames[-1][1], got
    return reader, writer, got.rest


@pytest.mark.parametrize("name", list(VIOLATIONS))
@pytest.mark.parametrize("relay", ["first-head", "after-keepalive"])
async def test_a_client_frame_violation_gets_1002_and_never_reaches_the_upstream(
    start_proxy: Any, recording_upstream: RecordingUpstream, relay: str, name: str
) -> None:
    bad, before = VIOLATIONS[name]
    path = "/ws/raw"
    route = {"path": path, "pool": "main", "protocol": "passthrough-ws"}
    if relay == "after-keepalive":
        route["queue_feedback"] = True
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", f"http://127.0.0.1:{recording_upstream.port}", 1)], [route],
                       queue={"max_depth": 1, "max_wait_s": 30},
                       limits={"ping_interval_s": 0}, guard={"mode": "off"}),
    )  # fmt: skip
    if relay == "after-keepalive":
        reader, writer, rest = await _admitted_via_queue(proxy, path)
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(handshake_request(path))
        head = await read_head(reader)
        assert head is not None and head.status == 101
        rest = head.rest
    try:
        ok = frame(OP_TEXT, b'{"type": "ok"}')
        writer.write(ok + before + bad + frame(OP_TEXT, b"{}"))
        await writer.drain()
        closed = await read_frames(reader, rest, timeout=10)
        assert closed.code == 1002, closed
        conn = recording_upstream.conns[-1]
        await asyncio.wait_for(conn.closed.wait(), 10)
    finally:
        writer.close()
    sent = conn.frames
    assert sent[0] == (OP_TEXT, b'{"type": "ok"}'), sent
    assert all(SECRET not in payload for _, payload in sent), sent
    # the splice forwards frames as they come (the valid first fragment too)
    forwarded_before = 1 if before else 0
    assert sent[-1][0] == OP_CLOSE and len(sent) == 2 + forwarded_before, sent
    assert sent[-1][1][:2] in (b"\x03\xe8", b"\x03\xea"), sent  # 1000 or 1002
    await wait_until(lambda: proxy.gate.active == 0)
