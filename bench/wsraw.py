"""Raw WebSocket and HTTP/1.1 on asyncio streams, for clients that misbehave on purpose.

A real client library will not send an unmasked frame, a lying length, invalid UTF-8 or
half a handshake; these helpers will. They build bytes (:func:`handshake_request`,
:func:`frame`, :func:`close_frame`) and read what a server answers
(:func:`read_head`, :func:`read_frames`, :func:`read_http_body`), every read bounded in
size and time. Used by the chaos soak (``bench/chaos_clients.py``) and the live fuzz
tests (``tests/fuzz``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "OP_BINARY",
    "OP_CLOSE",
    "OP_CONT",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "Closed",
    "Head",
    "close_frame",
    "frame",
    "handshake_request",
    "http_request",
    "open_raw",
    "read_frames",
    "read_head",
    "read_http_body",
    "reset",
]

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_LINGER_RST = struct.pack("ii", 1, 0)
_MAX_HEAD = 64 * 1024


def handshake_request(
    path: str,
    host: str = "127.0.0.1",
    *,
    key: str | None = None,
    headers: Iterable[tuple[str, str]] = (),
    subprotocols: Iterable[str] = (),
) -> bytes:
    """A WebSocket upgrade request (RFC 6455 4.1), no extensions offered."""
    key = key or base64.b64encode(os.urandom(16)).decode()
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    protocols = ", ".join(subprotocols)
    if protocols:
        lines.append(f"Sec-WebSocket-Protocol: {protocols}")
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def http_request(
    method: str,
    target: str,
    body: bytes = b"",
    *,
    host: str = "127.0.0.1",
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    rsv: int = 0,
    mask: bool = True,
    length: int | None = None,
) -> bytes:
    """One frame. ``length`` overrides the declared payload length (a lie)."""
    n = len(payload) if length is None else length
    head = bytearray([(0x80 if fin else 0) | ((rsv & 7) << 4) | (opcode & 0x0F)])
    bit = 0x80 if mask else 0
    if n < 126:
        head.append(bit | n)
    elif n < 1 << 16:
        head.append(bit | 126)
        head += struct.pack("!H", n)
    else:
        head.append(bit | 127)
        head += struct.pack("!Q", n)
    if not mask:
        return bytes(head) + payload
    key = os.urandom(4)
    head += key
    masked = bytes(b ^ key[i & 3] for i, b in enumerate(payload))
    return bytes(head) + masked


def close_frame(code: int | None = 1000, reason: bytes = b"", *, mask: bool = True) -> bytes:
    payload = b"" if code is None else struct.pack("!H", code) + reason
    return frame(OP_CLOSE, payload, mask=mask)


@dataclass(slots=True)
class Head:
    """A response's status line and headers (names lower-cased)."""

    status: int
    headers: dict[str, str]
    rest: bytes = b""  # bytes read past the head


@dataclass(slots=True)
class Closed:
    """How a WebSocket read ended: a close frame (``code``), EOF, RST or timeout."""

    code: int | None = None
    reason: bytes = b""
    eof: bool = False
    reset: bool = False
    timeout: bool = False
    frames: list[tuple[int, bytes]] = field(default_factory=list)
    rest: bytes = b""  # bytes read past the last frame returned

    @property
    def how(self) -> str:
        if self.code is not None:
            return f"close_{self.code}"
        if self.reset:
            return "reset"
        if self.timeout:
            return "timeout"
        return "eof"


async def open_raw(
    host: str, port: int, *, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection; ``rcvbuf`` shrinks the receive buffer (a slow/never reader)."""
    if rcvbuf is None:
        return await asyncio.open_connection(host, port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


def reset(writer: asyncio.StreamWriter) -> None:
    """Leave with RST (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """The response head, or None if the server closed first. Bounded to 64 KiB."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        try:
            chunk = await reader.read(4096)
        except (ConnectionError, OSError):
            return None
        if not chunk:
            return None
        data += chunk
        if len(data) > _MAX_HEAD:
            raise ValueError("response head over 64 KiB")
    head, _, rest = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Head(status, headers, rest)


class _Buffer:
    def __init__(self, reader: asyncio.StreamReader, initial: bytes) -> None:
        self.reader = reader
        self.buf = bytearray(initial)

    async def take(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = await self.reader.read(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


async def read_frames(
    reader: asyncio.StreamReader,
    initial: bytes = b"",
    *,
    timeout: float = 10.0,
    max_frames: int = 10_000,
    until_text: str | None = None,
) -> Closed:
    """Read server frames until a close frame, EOF, RST, ``timeout`` (seconds, total) or
    ``max_frames``; with ``until_text``, also stop after a text frame containing it."""
    out = Closed()
    buf = _Buffer(reader, initial)
    try:
        async with asyncio.timeout(timeout):
            while len(out.frames) < max_frames:
                b0, b1 = await buf.take(2)
                opcode, n = b0 & 0x0F, b1 & 0x7F
                if n == 126:
                    (n,) = struct.unpack("!H", await buf.take(2))
                elif n == 127:
                    (n,) = struct.unpack("!Q", await buf.take(8))
                if b1 & 0x80:
                    await buf.take(4)  # a server must not mask; read past it anyway
                if n > 64 * 1024 * 1024:
                    raise ValueError(f"server frame of {n} bytes")
                payload = await buf.take(n)
                if opcode == OP_CLOSE:
                    out.code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                    out.reason = payload[2:]
                    break
                out.frames.append((opcode, payload))
                if until_text is not None and opcode == OP_TEXT and until_text.encode() in payload:
                    break
    except EOFError:
        out.eof = True
    except (ConnectionError, OSError):
        out.reset = True
    except TimeoutError:
        out.timeout = True
    out.rest = bytes(buf.buf)
    return out


async def read_http_body(
    reader: asyncio.StreamReader, head: Head, *, limit: int = 64 * 1024 * 1024
) -> tuple[bytes, bool]:
    """The response body (chunked, Content-Length, or to EOF) and whether it was
    complete (a truncated chunked body or short Content-Length is not)."""
    buf = _Buffer(reader, head.rest)
    body = bytearray()
    try:
        if head.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = bytearray()
                while not line.endswith(b"\r\n"):
                    line += await buf.take(1)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await buf.take(2)
                    return bytes(body), True
                body += await buf.take(size)
                await buf.take(2)
                if len(body) > limit:
                    return bytes(body), False
        if "content-length" in head.headers:
            n = int(head.headers["content-length"])
            return await buf.take(n), True
        body += buf.buf
        while len(body) <= limit:
            chunk = await reader.read(65536)
            if not chunk:
                return bytes(body), True
            body += chunk
    except (EOFError, ConnectionError, OSError, ValueError):
        return bytes(body), False
    return bytes(body), False
