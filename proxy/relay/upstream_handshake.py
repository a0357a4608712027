"""A lean WebSocket client handshake for the upstream leg of a spliced session.

Over one TCP connection opened by the caller (a plain ``ws://`` one by the event loop,
:func:`proxy.relay.failover.open_tcp_transport`, with :class:`HandshakeProtocol` on it;
a ``wss://`` one from :func:`proxy.relay.failover.open_tcp`, TLS started here), one
pre-rendered ``GET`` with the upgrade headers, and a check of the ``101`` answer:
``Upgrade``/``Connection``, ``Sec-WebSocket-Accept``, a subprotocol among those
offered, no extension (none is offered: compression stays off on both legs). The
result is the open transport, still paused, and any bytes the upstream sent right
after its response -- the first frames of the session, which the splice then reads
first. No task, queue or keepalive object per connection: framing is the splice's
business (:mod:`proxy.relay.splice`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import os
import socket
import ssl
from dataclasses import dataclass

import httpx
from websockets.exceptions import InvalidHandshake
from websockets.uri import WebSocketURI, parse_uri

__all__ = [
    "HandshakeProtocol",
    "UpstreamSocket",
    "UpstreamStatus",
    "open_upstream",
    "upgrade",
    "upstream_uri",
]

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#: Bound on the upstream's response head.
MAX_RESPONSE_HEAD = 64 * 1024

_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    """The same trust as the HTTP relay's httpx client: certifi's CAs, or the bundle
    named by ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``."""
    global _tls
    if _tls is None:
        _tls = httpx.create_ssl_context()
    return _tls


@functools.lru_cache(maxsize=512)
def upstream_uri(url: str) -> WebSocketURI:
    """websockets' ``parse_uri``, once per distinct upstream URL: a replica's base and
    the session's path and query, the same for most sessions of a route. Raises
    ``InvalidURI`` (never cached). Read only: the result is shared."""
    return parse_uri(url)


class UpstreamStatus(InvalidHandshake):
    """The upstream answered the handshake with an HTTP status other than 101."""

    def __init__(self, status: int) -> None:
        super().__init__(f"server rejected WebSocket connection: HTTP {status}")
        self.status = status


@dataclass(slots=True)
class UpstreamSocket:
    """An open upstream WebSocket: paused transport and the chosen subprotocol."""

    transport: asyncio.Transport
    subprotocol: str | None
    #: Reads the response; None once handed over (:meth:`hand_over`).
    handshake: HandshakeProtocol | None
    loop: asyncio.AbstractEventLoop

    def hand_over(self) -> tuple[bytes, bool]:
        """For the splice taking the transport: the bytes the upstream sent after its
        response (its first frames) and whether the connection is lost already. The
        handshake's protocol (its buffer, the response head's future) is let go rather
        than kept as long as the session."""
        handshake = self.handshake
        assert handshake is not None, "handed over twice"
        self.handshake = None
        return bytes(handshake.buffer), handshake.lost

    def abort(self) -> None:
        self.transport.abort()


class HandshakeProtocol(asyncio.Protocol):
    """Reads the response head; pauses reading once it is complete. What :func:`upgrade`
    expects on a transport the caller connected itself."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.head: asyncio.Future[bytes] = loop.create_future()
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio and uvloop both set TCP_NODELAY on TCP transports already
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.head.done():
            return
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_RESPONSE_HEAD:
                self.head.set_exception(InvalidHandshake("response head too long"))
            return
        head = bytes(self.buffer[:end])
        del self.buffer[: end + 4]
        assert self.transport is not None
        self.transport.pause_reading()
        self.head.set_result(head)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.head.done():
            self.head.set_exception(
                ConnectionError("connection closed during the handshake") if exc is None else exc
            )


def _request(
    host_header: str, resource: str, key: str, subprotocols: list[str],
    headers: list[tuple[str, str]], user_agent: str | None,
) -> bytes:  # fmt: skip
    lines = [
        f"GET {resource} HTTP/1.1",
        f"Host: {host_header}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    ]
    if subprotocols:
        lines.append("Sec-WebSocket-Protocol: " + ", ".join(subprotocols))
    lines += [f"{name}: {value}" for name, value in headers]
    if user_agent is not None:
        lines.append(f"User-Agent: {user_agent}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _check(head: bytes, key: str, offered: list[str]) -> str | None:
    """Validate a response head; returns the chosen subprotocol."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise InvalidHandshake(f"invalid status line: {lines[0][:80]!r}")
    status = int(parts[1])
    if status != 101:
        raise UpstreamStatus(status)
    fields: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise InvalidHandshake(f"invalid header line: {line[:80]!r}")
        fields.setdefault(name.strip().lower(), []).append(value.strip())

    def tokens(name: bytes) -> list[bytes]:
        return [t.strip().lower() for v in fields.get(name, []) for t in v.split(b",")]

    if b"websocket" not in tokens(b"upgrade"):
        raise InvalidHandshake("missing Upgrade: websocket")
    if b"upgrade" not in tokens(b"connection"):
        raise InvalidHandshake("missing Connection: Upgrade")
    expected = base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest())
    if fields.get(b"sec-websocket-accept") != [expected]:
        raise InvalidHandshake("invalid Sec-WebSocket-Accept")
    if fields.get(b"sec-websocket-extensions"):
        raise InvalidHandshake("the upstream chose an extension that was not offered")
    chosen = fields.get(b"sec-websocket-protocol")
    if not chosen:
        return None
    subprotocol = chosen[0].decode("latin-1")
    if len(chosen) > 1 or subprotocol not in offered:
        raise InvalidHandshake(f"the upstream chose a subprotocol not offered: {subprotocol!r}")
    return subprotocol


async def open_upstream(
    url: str,
    sock: socket.socket,
    *,
    headers: list[tuple[str, str]],
    subprotocols: list[str],
    user_agent: str | None,
) -> UpstreamSocket:
    """Complete the handshake over ``sock``, a TCP connection to the URL's host (TLS
    is started here for ``wss``). The caller bounds the time (its deadline cancels
    this); the event loop owns ``sock`` from the first step, and closes it on any
    failure. Raises OSError (TLS errors included),
    :class:`UpstreamStatus` or another ``InvalidHandshake``."""
    uri = upstream_uri(url)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: HandshakeProtocol(loop),
        sock=sock,
        ssl=_tls_context() if uri.secure else None,
        server_hostname=uri.host if uri.secure else None,
    )
    return await upgrade(
        url, transport, protocol, headers=headers, subprotocols=subprotocols, user_agent=user_agent
    )


async def upgrade(
    url: str,
    transport: asyncio.Transport,
    protocol: HandshakeProtocol,
    *,
    headers: list[tuple[str, str]],
    subprotocols: list[str],
    user_agent: str | None,
) -> UpstreamSocket:
    """The handshake over ``transport``, connected to the URL's host with a
    :class:`HandshakeProtocol` from the start (plain TCP: :func:`open_upstream` starts
    TLS). The caller bounds the time; ``transport`` is aborted on any failure. Raises
    OSError, :class:`UpstreamStatus` or another ``InvalidHandshake``."""
    uri = upstream_uri(url)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        default_port = 443 if uri.secure else 80
        host = f"[{uri.host}]" if ":" in uri.host else uri.host
        host_header = host if uri.port == default_port else f"{host}:{uri.port}"
        request = _request(host_header, uri.resource_name, key, subprotocols, headers, user_agent)
        transport.write(request)
        head = await protocol.head
        subprotocol = _check(head, key, subprotocols)
    except BaseException:
        transport.abort()
        raise
    return UpstreamSocket(transport, subprotocol, protocol, protocol.head.get_loop())
