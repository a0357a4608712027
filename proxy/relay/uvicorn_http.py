"""uvicorn's httptools HTTP protocol, with bounds on the request head.

A request head (the request line and headers of an HTTP request or a WebSocket upgrade)
is read before anything else -- authentication, admission, any upstream work -- so
whatever it costs is paid by anyone who can open a TCP connection. uvicorn bounds
neither its size nor its pace: a 16 MB header was parsed and relayed, and half-sent heads
held their connections open indefinitely. :class:`HeadLimitedProtocol` bounds both,
before the bytes reach the parser:

- size: a head longer than ``limits.max_head_bytes`` (counted from the first byte of the
  request to its blank line) is answered with 431 Request Header Fields Too Large;
- count: a head with more than ``limits.max_headers`` header lines gets 431 too;
- time: a head must be complete within ``limits.handshake_timeout_s`` of the connection
  being accepted, or, on a keep-alive connection, of the end of the previous response.
  A partial head then gets 408 Request Timeout; a connection on which nothing arrived is
  closed without a word (as uvicorn's keep-alive timeout does: an answer there could be
  mistaken for the answer to a request that crosses it).

After such a refusal the connection closes. It closes gracefully (a lingering close, as
nginx does): the response is written, our side is shut for writing, and what the client
still sends is read and thrown away for up to :data:`LINGER_S`. A client still sending
its oversized head then reads the 431 instead of a connection reset.

The size is counted from the raw bytes, before httptools sees them (httptools would
buffer a header value of any size), to within one socket read when a read holds more
than one request (pipelining). The limits are read when each head starts, so a
configuration reload applies to the next request.

Header lines are counted while the head is read, and so are the trailer lines of a
chunked body (httptools reports both through ``on_header``): head and trailers together
get ``limits.max_headers`` lines; a request that exceeds it after its head has been read
has its connection closed.

Trailers (the fields after a chunked body's last chunk) are dropped: they are not
headers (RFC 9110, 6.5.1), so they never join the request's headers, the relay never
sends them upstream, and nothing else reads them. Their bytes are bounded all the same,
since httptools keeps a field's value until its line ends: a request whose trailers
pass ``limits.max_head_bytes`` (counted from the bytes read once the last chunk has
begun, less its body, so within one socket read) has its connection closed.

Every request head, WebSocket upgrades included, is read by httptools under the limits
above: there is no second parser. A complete upgrade is handed to the WebSocket protocol
as httptools read it (target and headers). Bytes that come after the upgrade head in the
same read (a client that sends its first frame without waiting for the 101) go to the
WebSocket protocol with it, which holds them for the relay: uvicorn's own hand-over
drops them. At the hand-over this protocol drops its parser, so that it is freed at once
rather than left to the garbage collector (docs/performance.md).

This subclasses uvicorn's :class:`~uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`
and uses some of its internals (parser callbacks, ``cycle``, ``pipeline``, the keep-alive
hooks). :func:`_check_uvicorn` verifies at import that the methods are there, and the
first connection that the attributes are, so a uvicorn release that changes them fails
loudly rather than leaving heads silently unbounded; ``tests/unit/test_uvicorn_http.py``
checks both against the installed uvicorn (pyproject pins the versions tested).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import uvicorn
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.relay.uvicorn_fence import assigned_attributes, assigned_in
from proxy.settings import LimitsSettings

__all__ = ["LINGER_S", "HeadLimitedProtocol", "head_limited"]

log = logging.getLogger("headroom.http")

#: How long a refused connection keeps reading (and discarding) before it closes.
LINGER_S = 2.0

#: What this module relies on in uvicorn's protocol: methods it overrides or calls ...
_METHODS = (
    "connection_made", "connection_lost", "data_received", "on_header", "on_body",
    "on_headers_complete", "on_message_complete", "on_response_complete",
    "handle_websocket_upgrade", "send_400_response", "_should_upgrade",
    "_unset_keepalive_if_required",
)  # fmt: skip
#: ... attributes it reads (set in its __init__) ...
_ATTRIBUTES = (
    "parser", "cycle", "pipeline", "transport", "loop", "server_state",
    "ws_protocol_class", "connections", "config", "app_state", "scope", "headers",
    "server", "client", "scheme",
)  # fmt: skip
#: ... and those set when a request begins (``on_message_begin``).
_REQUEST_ATTRIBUTES = ("url",)

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def _check_uvicorn() -> None:
    """At import (so at start-up, never on a connection): every method and attribute this
    module uses is in uvicorn's protocol (attributes: assigned in its source, read by
    :func:`proxy.relay.uvicorn_fence.assigned_attributes`)."""
    missing = [name for name in _METHODS if not callable(getattr(HttpToolsProtocol, name, None))]
    assigned, problems = assigned_attributes(HttpToolsProtocol)
    missing += problems or [
        name for name in _ATTRIBUTES + _REQUEST_ATTRIBUTES if name not in assigned
    ]
    # HeadLimitedProtocol.connection_made is uvicorn's, rewritten: it must set all that
    # uvicorn's sets.
    try:
        theirs = assigned_in(HttpToolsProtocol.connection_made)
    except (OSError, TypeError) as exc:
        missing.append(f"a readable connection_made ({exc})")
    else:
        ours = assigned_in(HeadLimitedProtocol.connection_made)
        missing += [f"{name} (set by connection_made)" for name in sorted(theirs - ours)]
    if missing:
        raise ImportError(
            f"uvicorn {uvicorn.__version__}: HttpToolsProtocol has no {', '.join(missing)}; "
            "Headroom's request-head limits (proxy.relay.uvicorn_http) need the uvicorn "
            "versions this package was tested with (see pyproject.toml)"
        )


def _local_address(info: Any) -> tuple[str, int | None] | None:
    """uvicorn's ``get_local_addr`` of a socket's ``getsockname()``."""
    if isinstance(info, tuple):
        return (str(info[0]), int(info[1]))
    if isinstance(info, str):
        return (info, None)
    return None


def _peer_address(info: Any) -> tuple[str, int] | None:
    """uvicorn's ``get_remote_addr`` of a socket's ``getpeername()``."""
    return (str(info[0]), int(info[1])) if isinstance(info, tuple) else None


class _TooManyHeaders(Exception):
    pass


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request-head limits of the module docstring.
    :func:`head_limited` makes a subclass whose limits come from a live source."""

    #: Where the limits come from; read each time a head starts.
    limits_source: ClassVar[Callable[[], LimitsSettings]] = LimitsSettings

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # the parser is reading a head (or waiting for one)
        self._head_bytes = 0
        self._head_tail = b""  # the head's last 3 bytes: its blank line may span reads
        self._header_count = 0
        self._too_many = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False  # answered 408/431: input is discarded until close
        self._linger: asyncio.TimerHandle | None = None
        self._max_head_bytes = 0
        self._max_headers = 0
        self._head_timeout_s = 0.0
        #: uvicorn's _should_upgrade for the request whose header list this is: it asks
        #: up to four times per request, each a walk over the headers.
        self._upgrade_for: list[tuple[bytes, bytes]] | None = None
        self._upgrade = False
        #: Body bytes httptools has handed over (a feed's body is told from its other bytes).
        self._body_bytes = 0
        #: A chunk has begun and none of its body came yet: the last chunk, if the next
        #: bytes are not body -- everything read until then is trailers.
        self._maybe_trailers = False
        self._trailer_bytes = 0
        #: What of the read being parsed follows the head: the WebSocket's first bytes,
        #: if the head is an upgrade.
        self._after_head = b""
        self._start_head()

    # -- the head's life ----------------------------------------------------------------

    def _start_head(self) -> None:
        limits = type(self).limits_source()
        self._max_head_bytes = limits.max_head_bytes
        self._max_headers = limits.max_headers
        self._head_timeout_s = limits.handshake_timeout_s
        self._head_open = True
        self._head_bytes = 0
        self._head_tail = b""
        self._header_count = 0
        self._maybe_trailers = False
        self._trailer_bytes = 0

    def _await_head(self) -> None:
        """Arm the head deadline if the connection now waits for a request: no response
        is being written and no complete request is queued."""
        if self._refused or self._head_timer is not None or self.transport.is_closing():
            return
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline:
            return
        self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_open and self._head_bytes:
            self._refuse(408, f"request head not complete within {self._head_timeout_s:g} s")
        else:
            self.transport.close()

    def _head_end(self, data: bytes) -> int:
        """The offset in ``data`` just past the head's blank line, or -1."""
        tail = self._head_tail
        if tail:
            k = (tail + data[:3]).find(b"\r\n\r\n")
            if k >= 0:
                return k + 4 - len(tail)
        k = data.find(b"\r\n\r\n")
        return k + 4 if k >= 0 else -1

    # -- refusing ------------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        self._refused = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        log.debug("refused a request head from %s: %d %s", self.client, status, message)
        cycle = self.cycle
        busy = cycle is not None and not cycle.response_complete
        if not self._head_open or busy or self.pipeline:
            # past the head (trailers), or a response is being written here: there is no
            # room for another response
            self.transport.close()
            return
        body = message.encode()
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % len(body)
        )
        head.append(body)
        transport = self.transport
        transport.write(b"".join(head))
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, transport.close)
        else:  # pragma: no cover - TCP transports can always half-close
            transport.close()

    # -- uvicorn's protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """uvicorn's ``connection_made`` (:func:`_check_uvicorn` checks that this sets
        everything it sets), but the addresses come from the transport: uvicorn asks it
        for a socket object, a Python socket made per connection and three system calls
        more (set-up 2.9 % fewer instructions, docs/performance.md)."""
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = _local_address(transport.get_extra_info("sockname"))
        self.client = _peer_address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        if self.logger.level <= TRACE_LOG_LEVEL:
            client = self.client
            prefix = f"{client[0]}:{client[1]} - " if client else ""
            self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", prefix)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and thrown away
        past_head = 0  # how much of data is past the head: body, framing, trailers
        if self._head_open:
            end = self._head_end(data)
            size = self._head_bytes + (len(data) if end < 0 else end)
            if size > self._max_head_bytes:
                self._refuse(431, f"request head over {self._max_head_bytes} bytes")
                return
            self._head_bytes = size
            self._head_tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
            if end >= 0:
                past_head = len(data) - end
        else:
            past_head = len(data)
        body_before = self._body_bytes
        self._after_head = data[len(data) - past_head :] if past_head and self._head_open else b""
        super().data_received(data)
        self._after_head = b""
        if self._maybe_trailers and past_head:
            self._trailer_bytes += past_head - (self._body_bytes - body_before)
            if self._trailer_bytes > self._max_head_bytes:
                self._refuse(431, f"request trailers over {self._max_head_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self._max_headers:
            self._too_many = True
            raise _TooManyHeaders  # httptools stops; uvicorn calls send_400_response
        if self._head_open:
            super().on_header(name, value)
        # else: a trailer field, dropped (the module docstring)

    def on_chunk_header(self) -> None:
        self._maybe_trailers = True

    def on_chunk_complete(self) -> None:
        self._maybe_trailers = False
        self._trailer_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._maybe_trailers = False
        self._trailer_bytes = 0
        self._body_bytes += len(body)
        super().on_body(body)

    def send_400_response(self, msg: str) -> None:
        if self._too_many:
            self._refuse(431, f"more than {self._max_headers} header lines")
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.parser.should_upgrade() and self._should_upgrade():
            return  # the connection becomes a WebSocket
        self._start_head()
        self._await_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_head()

    def _should_upgrade(self) -> bool:
        # Asked once the head is complete (headers no longer change), then again for
        # the same request; each new request has a new header list.
        headers = self.headers
        if self._upgrade_for is not headers:
            self._upgrade = super()._should_upgrade()
            self._upgrade_for = headers
        return self._upgrade

    def handle_websocket_upgrade(self) -> None:
        early = self._after_head
        if not hasattr(self.ws_protocol_class, "upgrade_parsed"):
            self._head_open = False
            self._cancel_head_timer()
            super().handle_websocket_upgrade()
            protocol = self.transport.get_protocol()
            if early and isinstance(protocol, asyncio.Protocol):
                protocol.data_received(early)
            return
        self._upgrade_to(self.scope["method"], self.url, self.headers, early)

    def _upgrade_to(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], early: bytes = b""
    ) -> None:
        """uvicorn's hand-over to its WebSocket protocol, but the request goes over as
        parsed (the splice's protocol reads it as it is) rather than re-serialised to be
        parsed again. ``headers``: names lower-cased, as uvicorn gives them; ``early``:
        what the client sent after the head, handed over too."""
        self._head_open = False
        self._cancel_head_timer()
        self.connections.discard(self)
        # Any: uvicorn types it as asyncio.Protocol; importing the splice's class here
        # would make this module fail wherever the splice cannot load (its fence).
        cls: Any = self.ws_protocol_class
        protocol = cls(config=self.config, server_state=self.server_state,
                       app_state=self.app_state, _loop=self.loop)  # fmt: skip
        protocol.upgrade_parsed(
            self.transport, (self.server, self.client, self.scheme), method, target, headers
        )
        self.transport.set_protocol(protocol)
        if early:
            protocol.data_received(early)
        # The parser holds this protocol's callbacks, and this protocol the parser: a
        # cycle that left every upgraded connection's HTTP protocol (14 objects) to the
        # garbage collector. Nothing parses here any more; drop the parser and reference
        # counting frees the protocol now (session set-up 2.9 % fewer instructions).
        self.parser = None  # type: ignore[assignment]


def head_limited(limits: Callable[[], LimitsSettings]) -> type[HeadLimitedProtocol]:
    """A :class:`HeadLimitedProtocol` whose limits are ``limits()`` (e.g. the running
    configuration's, so that a reload applies), for uvicorn's ``http`` option."""
    return type(
        "HeadLimitedProtocol", (HeadLimitedProtocol,), {"limits_source": staticmethod(limits)}
    )


_check_uvicorn()  # at import, so at start-up: never on a connection
