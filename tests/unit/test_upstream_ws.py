"""The splice's lean upstream handshake (proxy/relay/upstream_handshake.py), against a real
socket that answers it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import socket
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from websockets.exceptions import InvalidURI

from proxy.relay import upstream_handshake as upstream_ws
from proxy.relay.upstream_handshake import open_upstream, upstream_uri

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@asynccontextmanager
async def answering_server(requests: list[bytes], first_frames: bytes = b"") -> AsyncIterator[int]:
    """Answers each handshake with a 101 and ``first_frames`` in the same write (and
    keeps the request head); on exit, waits
    for every connection to end (the test's clients abort theirs)."""
    handlers: list[asyncio.Task[None]] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        head = await reader.readuntil(b"\r\n\r\n")
        requests.append(head)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n" + first_frames
        )
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client goes
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
        await asyncio.gather(*handlers)
    finally:
        server.close()
        await server.wait_closed()


async def handshake(url: str, port: int) -> upstream_ws.UpstreamSocket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    return await open_upstream(url, sock, headers=[], subprotocols=[], user_agent=None)


async def test_each_upstream_url_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions to the same URL share one parse of it (websockets' parse_uri was 2% of
    a session's set-up when it ran twice per session)."""
    parsed: list[str] = []
    original = upstream_ws.parse_uri

    def counting(url: str) -> upstream_ws.WebSocketURI:
        parsed.append(url)
        return original(url)

    monkeypatch.setattr(upstream_ws, "parse_uri", counting)
    upstream_uri.cache_clear()
    requests: list[bytes] = []
    async with answering_server(requests) as port:
        url = f"ws://127.0.0.1:{port}/v1/stream?voice=a"
        first = await handshake(url, port)
        second = await handshake(url, port)
        other = await handshake(f"ws://127.0.0.1:{port}/v1/stream?voice=b", port)
        for upstream in (first, second, other):
            upstream.abort()
    assert parsed == [url, f"ws://127.0.0.1:{port}/v1/stream?voice=b"]
    assert requests[0].startswith(b"GET /v1/stream?voice=a HTTP/1.1\r\n")
    assert f"\r\nHost: 127.0.0.1:{port}\r\n".encode() in requests[0]
    assert requests[2].startswith(b"GET /v1/stream?voice=b HTTP/1.1\r\n")


def test_an_invalid_upstream_url_is_refused_each_time() -> None:
    upstream_uri.cache_clear()
    for _ in range(2):
        with pytest.raises(InvalidURI):
            upstream_uri("ws://127.0.0.1:1/a#fragment")
    assert upstream_uri.cache_info().currsize == 0


async def test_hand_over_gives_the_first_frames_and_lets_the_handshake_go() -> None:
    """The splice gets what the upstream sent right after its 101; the handshake's
    protocol (buffer, future) is not kept for the session's life."""
    first = bytes((0x82, 3)) + b"abc"
    async with answering_server([], first) as port:
        upstream = await handshake(f"ws://127.0.0.1:{port}/v1/stream", port)
        handshake_protocol = weakref.ref(upstream.handshake)  # type: ignore[arg-type]
        # the head and the first frames came in one write, so in one read: reading
        # pauses once the head is complete
        upstream.transport.set_protocol(asyncio.Protocol())  # what the splice does
        assert upstream.hand_over() == (first, False)
        assert upstream.handshake is None and handshake_protocol() is None
        upstream.abort()
