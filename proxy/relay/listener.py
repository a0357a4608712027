"""The client listener: Headroom reads every request head itself.

uvicorn builds one :class:`ClientListener` per accepted connection (it is the class
given as uvicorn's ``http`` option). The listener reads the first request head with
httptools, under the limits below, and then:

- a WebSocket handshake (GET, HTTP/1.1, ``Upgrade: websocket``) becomes a
  :class:`~proxy.relay.ws_server.ClientWebSocket`, which runs the ASGI app and hands an
  admitted session's socket to the relay;
- anything else is handed to uvicorn's own HTTP protocol
  (:func:`proxy.relay.library_contract.uvicorn_http`, built with the keyword arguments
  uvicorn gave the listener) and used as a black box through the asyncio Protocol
  interface: it gets ``connection_made`` and the bytes read so far, then every later
  callback. The listener keeps reading what passes through, so the limits hold for
  every later request on the connection too.

The same class is uvicorn's ``ws`` option: a WebSocket upgrade that comes after a plain
request on a kept-alive connection is handed by uvicorn's HTTP protocol, once the
responses before it are written, to a new listener with the request head (as uvicorn
rebuilds it); the new listener reads it as its first head and serves the handshake like
any other, so every WebSocket session is Headroom's. Bytes a client sends after such a
later upgrade request and before its 101 are not handed on by uvicorn's protocol (RFC
6455 4.1 tells a client to wait for the 101).

A request head (the request line and headers of an HTTP request or a WebSocket upgrade)
is read before anything else -- authentication, admission, any upstream work -- so
whatever it costs is paid by anyone who can open a TCP connection. The limits:

- size: a head longer than ``limits.max_head_bytes`` (counted from the first byte of the
  request to its blank line, before httptools sees the bytes: it would buffer a header
  value of any size) is refused;
- count: a head with more than ``limits.max_headers`` header lines is refused; head and
  trailers of a chunked body together get that many lines (httptools reports both
  through ``on_header``);
- time: the first head must be complete within ``limits.handshake_timeout_s`` of the
  connection being accepted; a later head on a kept-alive connection within as long of
  its first byte (uvicorn's keep-alive timeout closes a connection on which nothing
  arrives);
- trailers (the fields after a chunked body's last chunk) are never headers (RFC 9110,
  6.5.1) and nothing reads them; their bytes are bounded by ``limits.max_head_bytes``.

httptools (llhttp) reads strictly, and every byte uvicorn's protocol gets has passed
it first. Whatever it refuses is never handed on: h11, under uvicorn's protocol, is
lenient where a lenient reader lets a request be read two ways (request smuggling) --
it takes Content-Length with Transfer-Encoding as chunked and keeps the connection,
unfolds a header continued on the next line (obs-fold) and honours it, and accepts bare
LF line ends. All three, and any other malformed head or chunked framing, are refused
here (RFC 9112 6.3, 5.2, 2.2).

The first head is refused with an answer: 431 Request Header Fields Too Large, 400 Bad
Request for malformed bytes (naming what httptools found), or 408 Request Timeout for a
partial head (a connection on which nothing arrived is closed without a word), and the
connection closes gracefully -- the response is written, our side is shut for writing,
and what the client still sends is read and thrown away for up to :data:`LINGER_S`, so
a client still sending its oversized head reads the 431 rather than a reset. A later
head, malformed bytes after the first head was handed on, or trailers over a limit
close the connection without an answer: a response of uvicorn's may be under way on
it. The limits are read when each head starts, so a configuration reload applies to the
next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar, cast

import httptools

from proxy.relay.library_contract import lifespan_state, uvicorn_http
from proxy.relay.ws_handshake import (
    ASGIApp,
    build_scope,
    handshake_key,
    http_response,
    refusal_for,
)
from proxy.relay.ws_server import ClientWebSocket, WebSocketOptions, WebSocketSessions
from proxy.settings import LimitsSettings

__all__ = ["LINGER_S", "ClientListener", "client_listener", "websocket_options"]

log = logging.getLogger("headroom.http")

#: How long a refused connection keeps reading (and discarding) before it closes.
LINGER_S = 2.0


class _OverLimit(Exception):
    """Raised in a parser callback to stop httptools at a head or trailer limit."""


def _address(info: Any) -> tuple[str, int] | None:
    return (str(info[0]), int(info[1])) if isinstance(info, tuple) else None


def websocket_options(limits: LimitsSettings) -> WebSocketOptions:
    """The client WebSocket bounds that follow from Headroom's limits: Headroom checks
    message sizes itself (1008); websockets' own check (1009) is a backstop for frames
    far beyond the limit."""
    return WebSocketOptions(
        max_size=2 * limits.max_message_bytes,
        max_queue=16,
        ping_interval_s=limits.ping_interval_s or 0.0,
        ping_timeout_s=limits.ping_timeout_s,
    )


class ClientListener(asyncio.Protocol):
    """One client connection, until its first head is read; then the front of uvicorn's
    HTTP protocol (plain HTTP) or of a :class:`ClientWebSocket`. :func:`client_listener`
    makes the subclass uvicorn is given."""

    app: ClassVar[ASGIApp]
    limits_source: ClassVar[Callable[[], LimitsSettings]]
    sessions: ClassVar[WebSocketSessions]
    root_path: ClassVar[str] = ""
    #: The WebSocket options and the limits they follow from, shared by the connections
    #: until a reload brings other limits.
    _options: ClassVar[tuple[LimitsSettings, WebSocketOptions] | None] = None

    def __init__(self, **uvicorn: Any) -> None:
        #: The keyword arguments uvicorn builds protocol classes with, passed on as they
        #: are to its HTTP protocol.
        self._uvicorn = uvicorn
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._inner: asyncio.Protocol | None = None
        self._ws: ClientWebSocket | None = None
        self._buffer = bytearray()  # the first head's reads, for uvicorn if it gets them
        self._first = True  # reading the connection's first request
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_open = True
        self._head_bytes = 0
        self._head_tail = b""  # the head's last 3 bytes: its blank line may span reads
        self._header_count = 0
        self._too_many = False
        self._trailer_fields = 0  # bytes of the trailer fields read whole
        self._trailers_over = False
        self._head_done = False
        self._body_bytes = 0
        self._maybe_trailers = False
        self._trailer_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None  # see _watch_writes
        self._refused = False  # input is discarded until close
        self._max_head_bytes = 0
        self._max_headers = 0
        self._head_timeout_s = 0.0
        self._read_limits()  # again when each later head begins (on_message_begin)

    # -- the head's life ------------------------------------------------------------------

    def _read_limits(self) -> None:
        limits = type(self).limits_source()
        self._max_head_bytes = limits.max_head_bytes
        self._max_headers = limits.max_headers
        self._head_timeout_s = limits.handshake_timeout_s

    def _start_head(self) -> None:
        self._head_open = True
        self._head_bytes = 0
        self._head_tail = b""
        self._header_count = 0
        self._maybe_trailers = False
        self._trailer_bytes = 0

    def _arm(self) -> None:
        self._cancel_timer()
        assert self.loop is not None
        self._timer = self.loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or not self._head_open:
            return
        if self._inner is not None:
            self._violation(f"request head not complete within {self._head_timeout_s:g} s")
        elif self._head_bytes:
            self._refuse(408, f"request head not complete within {self._head_timeout_s:g} s")
        else:
            transport.close()

    def _head_end(self, data: bytes) -> int:
        """The offset in ``data`` just past the head's blank line, or -1."""
        tail = self._head_tail
        if tail:
            k = (tail + data[:3]).find(b"\r\n\r\n")
            if k >= 0:
                return k + 4 - len(tail)
        k = data.find(b"\r\n\r\n")
        return k + 4 if k >= 0 else -1

    def _refuse(self, status: int, message: str) -> None:
        """Answer the first head with ``status`` and close gracefully."""
        self._refused = True
        self._cancel_timer()
        self._parser = None
        transport = self.transport
        assert transport is not None and self.loop is not None
        log.debug("refused a request head: %d %s", status, message)
        transport.write(http_response(
            status, [(b"content-type", b"text/plain; charset=utf-8")], message.encode(),
            time.time(),
        ))  # fmt: skip
        if transport.can_write_eof():
            transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, transport.close)
        else:  # pragma: no cover - TCP transports can always half-close
            transport.close()

    def _violation(self, message: str) -> None:
        """A later head or trailers over a limit: close without an answer."""
        log.debug("closed a connection: %s", message)
        self._refused = True
        self._cancel_timer()
        self._parser = None
        if self.transport is not None:
            self.transport.close()

    # -- httptools' callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self._first:
            self._read_limits()  # a reload applies from this head on
            self._arm()

    def on_url(self, url: bytes) -> None:
        if self._first:
            self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._max_headers:
            self._too_many = True
            raise _OverLimit
        if self._head_open:
            if self._first:
                self._headers.append((name.lower(), value))
            return
        # a trailer field: bounded with the bytes of the trailers still arriving
        self._trailer_fields += len(name) + len(value) + 4
        if self._trailer_fields > self._max_head_bytes:
            self._trailers_over = True
            raise _OverLimit

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_timer()
        if self._first:
            self._head_done = True

    def on_chunk_header(self) -> None:
        self._maybe_trailers = True

    def on_chunk_complete(self) -> None:
        self._maybe_trailers = False
        self._trailer_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._maybe_trailers = False
        self._trailer_bytes = 0
        self._body_bytes += len(body)

    def on_message_complete(self) -> None:
        self._first = False
        self._trailer_fields = 0
        self._start_head()

    # -- the transport's callbacks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.loop = asyncio.get_event_loop()
        self._arm()

    def data_received(self, data: bytes) -> None:
        inner = self._inner
        if inner is not None:
            if self._parser is not None:
                self._read(data)
            if not self._refused:
                inner.data_received(data)
            return
        ws = self._ws
        if ws is not None:
            ws.data_received(data)
            return
        if self._refused:
            return  # lingering: read and thrown away
        self._buffer += data
        self._read(data)
        if self._refused or self._ws is not None or self._inner is not None:
            return
        if self._head_done:
            self._hand_over()

    def _read(self, data: bytes) -> None:
        """Count and parse ``data``: the head limits, then httptools."""
        past_head = len(data)
        if self._head_open:
            end = self._head_end(data)
            size = self._head_bytes + (len(data) if end < 0 else end)
            if size > self._max_head_bytes:
                self._over(f"request head over {self._max_head_bytes} bytes")
                return
            self._head_bytes = size
            self._head_tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
            past_head = len(data) - end if end >= 0 else 0
        body_before = self._body_bytes
        parser = self._parser
        assert parser is not None
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if self._inner is None:
                self._upgrade(data[int(exc.args[0]) :])
            else:
                self._parser = None  # uvicorn's protocol upgrades the connection itself
            return
        except httptools.HttpParserError as exc:
            if self._trailers_over:
                self._violation(f"request trailers over {self._max_head_bytes} bytes")
                return
            if self._too_many:
                self._over(f"more than {self._max_headers} header lines")
                return
            self._malformed(str(exc) or type(exc).__name__)
            return
        if self._maybe_trailers and past_head:
            self._trailer_bytes += past_head - (self._body_bytes - body_before)
            if self._trailer_bytes > self._max_head_bytes:
                self._violation(f"request trailers over {self._max_head_bytes} bytes")

    def _malformed(self, reason: str) -> None:
        """Bytes httptools refuses (see the module docstring): never handed on."""
        message = f"malformed request: {reason}"
        if self._inner is None:
            self._refuse(400, message)
        else:
            self._violation(message)

    def _over(self, message: str) -> None:
        if self._inner is None and self._first and self._head_open:
            self._refuse(431, message)
        else:
            self._violation(message)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        if self._ws is not None:
            return self._ws.eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self._parser = None
        if self._inner is not None:
            self._inner.connection_lost(exc)
        elif self._ws is not None:
            self._ws.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()
            self._watch_writes()
        elif self._ws is not None:
            self._ws.pause_writing()

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if self._inner is not None:
            self._inner.resume_writing()
        elif self._ws is not None:
            self._ws.resume_writing()

    def _watch_writes(self) -> None:
        """While writing is paused (the client does not read), check every
        ``limits.client_write_timeout_s`` whether the connection is closing: a response
        that was ended (the relay gave up on the client) is then dropped with what is
        still unsent rather than kept until the client reads it."""
        if self._stall is None and self.loop is not None:
            wait = type(self).limits_source().client_write_timeout_s
            self._stall = self.loop.call_later(wait, self._write_stalled)

    def _write_stalled(self) -> None:
        self._stall = None
        transport = self.transport
        if transport is None:
            return
        if transport.is_closing():
            transport.abort()
        else:
            self._watch_writes()

    # -- where the connection goes ----------------------------------------------------------

    def _hand_over(self) -> None:
        """Plain HTTP: uvicorn's protocol gets the connection and what was read."""
        inner = self._inner = uvicorn_http(self._uvicorn)
        self._url = b""
        self._headers = []
        buffered, self._buffer = bytes(self._buffer), bytearray()
        inner.connection_made(self.transport)  # type: ignore[arg-type]
        inner.data_received(buffered)

    def _upgrade(self, early: bytes) -> None:
        """The first head asked to upgrade: a WebSocket handshake is served (or refused)
        here, any other upgrade is uvicorn's to answer."""
        parser = self._parser
        assert parser is not None and self.transport is not None and self.loop is not None
        self._parser = None  # it holds this object's callbacks
        self._cancel_timer()
        headers, target = self._headers, self._url
        websocket = any(
            name == b"upgrade" and value.strip().lower() == b"websocket" for name, value in headers
        )
        if not websocket:
            self._hand_over()
            return
        transport = self.transport
        self._buffer = bytearray()
        method, version = parser.get_method(), parser.get_http_version()
        if method != b"GET" or version != "1.1":  # RFC 6455 4.1: a GET, HTTP/1.1 or later
            self._refused = True
            answer = [(b"content-type", b"text/plain; charset=utf-8")]
            if method != b"GET":
                answer.append((b"allow", b"GET"))
            reason = b"a WebSocket handshake is a GET request over HTTP/1.1"
            transport.write(http_response(405 if method != b"GET" else 400, answer, reason,
                                          time.time()))  # fmt: skip
            transport.close()
            return
        checked = handshake_key(headers)
        scope = None
        if checked is not None:
            ssl = transport.get_extra_info("sslcontext") is not None
            scope = build_scope(
                scheme="wss" if ssl else "ws",
                server=_address(transport.get_extra_info("sockname")),
                client=_address(transport.get_extra_info("peername")),
                root_path=self.root_path,
                target=target,
                headers=headers,
                subprotocols=checked[1],
                state=lifespan_state(self._uvicorn),
            )
        if checked is None or scope is None:
            self._refused = True
            transport.write(refusal_for(target, headers))
            transport.close()
            return
        ws = self._ws = ClientWebSocket(transport, self.loop, self._ws_options(), self.sessions)
        self._headers = []
        ws.start(type(self).app, scope, checked[0], early)

    @classmethod
    def _ws_options(cls) -> WebSocketOptions:
        limits = cls.limits_source()
        options = cls._options
        if options is None or options[0] is not limits:
            options = cls._options = (limits, websocket_options(limits))
        return options[1]


def client_listener(
    app: ASGIApp,
    limits: Callable[[], LimitsSettings],
    sessions: WebSocketSessions,
    root_path: str = "",
) -> type[ClientListener]:
    """The :class:`ClientListener` class for uvicorn's ``http`` option: serving ``app``,
    with the limits ``limits()`` returns when each head starts (so a reload applies) and
    its WebSocket sessions in ``sessions``."""
    return type(
        "ClientListener",
        (ClientListener,),
        {
            "app": staticmethod(app),
            "limits_source": staticmethod(limits),
            "sessions": sessions,
            "root_path": root_path,
        },
    )
