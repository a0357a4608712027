"""The WebSocket handshake's pieces: what Headroom's client WebSocket server
(:mod:`proxy.relay.ws_server`) checks, answers and builds from a request head.

The handshake checks are RFC 6455 4.2.1's: ``Connection: Upgrade``, ``Upgrade:
websocket``, exactly one ``Sec-WebSocket-Key`` of 16 bytes in base64, version 13. A
request that fails one is answered by websockets' own handshake code (400, or 426 with
the supported version). Frames are :mod:`proxy.relay.wsframes`' concern.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.utils
import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import unquote

from websockets.datastructures import Headers
from websockets.http11 import Request
from websockets.server import ServerProtocol

__all__ = [
    "ASGIApp",
    "TakeOver",
    "build_scope",
    "handshake_key",
    "http_response",
    "refusal_for",
]

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

_REASONS = {
    101: b"Switching Protocols", 400: b"Bad Request", 403: b"Forbidden", 405: b"Method Not Allowed",
    408: b"Request Timeout", 426: b"Upgrade Required",
    431: b"Request Header Fields Too Large", 500: b"Internal Server Error",
    503: b"Service Unavailable",
}  # fmt: skip

ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class TakeOver(Protocol):
    """``take_over(subprotocol, headers, protocol, on_shutdown, held=())`` -> (transport,
    early bytes), or None if the client is already gone. ``protocol`` receives the
    transport's callbacks from then on; ``on_shutdown`` is called if the server shuts
    down while it runs. On a connection already accepted through ASGI, ``subprotocol``
    and ``headers`` are not used (the handshake was answered) and ``held`` are the ASGI
    ``websocket.receive`` messages the app read but did not relay: they lead the early
    bytes, as client frames."""

    def __call__(
        self,
        subprotocol: str | None,
        headers: list[tuple[bytes, bytes]],
        protocol: asyncio.Protocol,
        on_shutdown: Callable[[], None],
        held: Iterable[Mapping[str, Any]] = (),
    ) -> tuple[asyncio.Transport, bytes] | None: ...


_date_cache: tuple[int, bytes] = (-1, b"")


def _date_header(now: float) -> bytes:
    global _date_cache
    second = int(now)
    if _date_cache[0] != second:
        _date_cache = (second, email.utils.formatdate(second, usegmt=True).encode())
    return _date_cache[1]


def http_response(
    status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes, now: float
) -> bytes:
    """A whole HTTP/1.1 response that ends the connection (``connection: close``), with
    a ``date`` and, unless ``headers`` has one, a ``content-length``."""
    reason = _REASONS.get(status, b"")
    out = [b"HTTP/1.1 %d %s\r\ndate: %s\r\n" % (status, reason, _date_header(now))]
    length = False
    for name, value in headers:
        lower = name.lower()
        if lower == b"connection":
            continue
        length = length or lower == b"content-length"
        out += [name, b": ", value, b"\r\n"]
    if not length:
        out.append(b"content-length: %d\r\n" % len(body))
    out += [b"connection: close\r\n\r\n", body]
    return b"".join(out)


#: An HTTP token (RFC 9110 5.6.2).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def handshake_key(headers: list[tuple[bytes, bytes]]) -> tuple[str, list[str]] | None:
    """The ``Sec-WebSocket-Accept`` value and the offered subprotocols of a handshake
    request's headers (names lower case) that meets RFC 6455 4.2.1; None if it does not."""
    key: bytes | None = None
    version: bytes | None = None
    upgrade = connection = False
    protocols: list[str] = []
    for name, value in headers:
        if name == b"sec-websocket-key":
            if key is not None:
                return None
            key = value
        elif name == b"sec-websocket-version":
            if version is not None:
                return None
            version = value
        elif name == b"upgrade":
            if upgrade or value.strip().lower() != b"websocket":
                return None
            upgrade = True
        elif name == b"connection":
            connection = connection or any(
                t.strip().lower() == b"upgrade" for t in value.split(b",")
            )
        elif name == b"sec-websocket-protocol":
            offered = [t for t in (t.strip() for t in value.decode("latin-1").split(",")) if t]
            if not offered or not all(_TOKEN.fullmatch(t) for t in offered):
                return None  # RFC 6455 4.1: a list of tokens
            protocols += offered
    if not (upgrade and connection and version == b"13" and key is not None):
        return None
    try:
        if len(base64.b64decode(key, validate=True)) != 16:
            return None
    except binascii.Error:
        return None
    return base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode(), protocols


def refusal_for(target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """websockets' answer (400 or 426, with its reason) to a handshake request that
    fails a check, as bytes to write."""
    conn = ServerProtocol()
    request = Request(
        target.decode("latin-1"),
        Headers((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers),
    )
    response = conn.accept(request)
    if response.status_code == 101:  # the headers pass, the target does not
        response = conn.reject(400, "Failed to open a WebSocket connection.\n")
    conn.send_response(response)
    return b"".join(conn.data_to_send())


def build_scope(
    *,
    scheme: str,
    server: tuple[str, int | None] | None,
    client: tuple[str, int] | None,
    root_path: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    subprotocols: list[str],
    state: dict[str, Any],
) -> dict[str, Any] | None:
    """The ASGI ``websocket`` scope of a handshake request (names lower case); None if
    the target is not an absolute path in ASCII."""
    if not target.isascii() or not target.startswith(b"/"):
        return None
    raw_path, _, query = target.partition(b"?")
    return {
        "type": "websocket",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "scheme": scheme,
        "server": server,
        "client": client,
        "root_path": root_path,
        "path": root_path + unquote(raw_path.decode("ascii")),
        "raw_path": root_path.encode("ascii") + raw_path,
        "query_string": query,
        "headers": headers,
        "subprotocols": subprotocols,
        "state": state,
    }
