"""uvicorn's sans-I/O WebSocket protocol, plus a way for Headroom to take the socket over.

Headroom keeps ASGI for what ASGI is good at -- the handshake, authentication,
admission, queueing and refusals -- and relays the frames of an admitted session in
protocol callbacks (:mod:`proxy.relay.splice`), with no task, queue or message object
per frame. :class:`HeadroomWebSocketProtocol` offers that as the ASGI extension
``headroom.splice``: ``scope["extensions"]["headroom.splice"]["take_over"]`` completes
the handshake (101 with the chosen subprotocol and extra headers) and hands the
transport, with any bytes the client sent early, to the caller in the same step, so
uvicorn never parses a frame of the session.

A client must wait for the handshake response before it sends frames (RFC 6455 4.1);
bytes that arrive before it anyway are held (bounded), not parsed, and reach whichever
relay path the app takes.

A connection the app accepted through ASGI (queue feedback: the client is accepted to
wait, told its place, then admitted) can be taken over too, once the app has written
what it had to say: the frames the app held while waiting, the messages uvicorn
queued that the app did not read, a fragmented message uvicorn was still assembling
and the bytes of a frame not yet complete are handed over as client frames, in the
order they came. To make that exact, websockets' parser is only ever fed whole frames
on an accepted connection (a frame still arriving waits here, bounded by uvicorn's
``ws_max_size``), so it never holds half a frame; uvicorn's keepalive stops at the
take-over.

The handshake request itself (already parsed once by uvicorn's HTTP parser and handed
over re-serialised) is read here with a lean parser that checks what RFC 6455 4.2.1
requires -- GET, HTTP/1.1, ``Connection: Upgrade``, ``Upgrade: websocket``, one valid
``Sec-WebSocket-Key``, version 13 -- and builds the ASGI scope directly. Anything else
goes through websockets' own parser, which answers it with the right HTTP error; the
``websockets`` request/response objects are only built when a path needs them (an
ASGI ``websocket.accept``). The take-over writes the 101 itself, whichever parser read
the request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import unquote

from uvicorn.config import Config
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.extensions.base import ServerExtensionFactory
from websockets.extensions.permessage_deflate import ServerPerMessageDeflateFactory
from websockets.http11 import Request
from websockets.server import ServerProtocol

from proxy.relay.wsframes import BINARY, TEXT, frame

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

__all__ = ["EARLY_LIMIT", "HeadroomWebSocketProtocol", "TakeOver", "whole_frames"]

_UVICORN_LOG = logging.getLogger("uvicorn.error")

#: Bytes a client may send between its handshake request and our response; beyond
#: this the connection is dropped (the session ends as a client disconnect).
EARLY_LIMIT = 256 * 1024


class TakeOver(Protocol):
    """``take_over(subprotocol, headers, protocol, on_shutdown, held=())`` -> (transport,
    early bytes), or None if the client is already gone. ``protocol`` receives the
    transport's callbacks from then on; ``on_shutdown`` is called if uvicorn shuts down
    while it runs. On a connection already accepted through ASGI, ``subprotocol`` and
    ``headers`` are not used (the handshake was answered) and ``held`` are the ASGI
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


def whole_frames(data: bytes | bytearray, max_size: int | None) -> int:
    """How many leading bytes of ``data`` (client frames from a frame boundary) are
    whole frames. A frame still arriving that declares more than ``max_size`` bytes
    counts as whole, so that the parser sees (and refuses) it at once."""
    pos, end = 0, len(data)
    while end - pos >= 2:
        b1 = data[pos + 1]
        length = b1 & 0x7F
        head = 2
        if length == 126:
            head = 4
            if end - pos < head:
                break
            length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        elif length == 127:
            head = 10
            if end - pos < head:
                break
            length = int.from_bytes(data[pos + 2 : pos + 10], "big")
        if b1 & 0x80:
            head += 4
        if pos + head + length > end:
            if max_size is not None and length > max_size:
                return end
            break
        pos += head + length
    return pos


def _serialised(target: bytes, headers: list[tuple[bytes, bytes]], method: bytes = b"GET") -> bytes:
    """A parsed request as uvicorn hands an upgrade over (its HTTP version always 1.1)."""
    out = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        out += [name, b": ", value, b"\r\n"]
    out.append(b"\r\n")
    return b"".join(out)


def _client_frame(message: Mapping[str, Any]) -> bytes:
    """An ASGI ``websocket.receive`` message as the masked frame a client would send."""
    text = message.get("text")
    if text is not None:
        return frame(TEXT, text.encode(), masked=True)
    return frame(BINARY, message.get("bytes") or b"", masked=True)


#: The request headers the handshake checks read (the others go to the app as they are).
_HANDSHAKE_FIELDS = frozenset(
    (b"sec-websocket-key", b"sec-websocket-version", b"upgrade", b"connection",
     b"sec-websocket-protocol")
)  # fmt: skip


class HeadroomWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets-sansio`` protocol with the ``headroom.splice`` extension."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._uvicorn_init(config, server_state, app_state, _loop)
        self._conn: ServerProtocol | None = None  # websockets' protocol, on first use
        self._conn_gone = False  # taken over: never built again
        self._early = bytearray()
        self._accept_key = ""  # Sec-WebSocket-Accept, once a handshake request is read
        #: A request the lean parser read (target, headers), for websockets' if needed.
        self._request: tuple[bytes, list[tuple[bytes, bytes]]] | None = None
        self.on_shutdown: Callable[[], None] | None = None  # set once taken over
        self._tail = bytearray()  # after an ASGI accept: a client frame still arriving
        self._gone: asyncio.Future[None] | None = None  # see gone()

    def _uvicorn_init(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        """uvicorn's constructor (the same in every uvicorn pyproject.toml allows) but
        for websockets' ServerProtocol (:attr:`conn`), built on first use: a spliced
        session never uses it, and it cost about 5 us (a uuid4 and a parser generator)
        of every session's set-up (issue 17). The fence
        (:func:`proxy.relay.uvicorn_fence.splice_problems`) checks that this sets every
        attribute uvicorn's constructor sets, and only those."""
        if not config.loaded:
            config.load()  # pragma: no cover
        self.config = config
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.logger = _UVICORN_LOG  # logging.getLogger("uvicorn.error"), looked up once
        self.root_path = config.root_path
        self.asgi_version = config.asgi_version
        self.app_state = app_state
        self.connections = server_state.connections
        self.tasks = server_state.tasks
        self.default_headers = server_state.default_headers
        self.transport = None  # type: ignore[assignment]
        self.server = None
        self.client = None
        self.scheme = None  # type: ignore[assignment]
        self.queue = asyncio.Queue()
        self.handshake_initiated = False
        self.handshake_complete = False
        self.close_sent = False
        self.disconnected = False
        self.close_timer = None
        self.close_timeout = 10.0
        self.initial_response = None
        self.read_paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.ping_interval = config.ws_ping_interval
        self.ping_timeout = config.ws_ping_timeout
        self.ping_timer = None
        self.pong_timer = None
        self.pending_ping_payload = None
        self.ping_sent_at = 0.0
        self.last_ping_rtt = 0.0
        self.frames = []
        self.curr_msg_data_type = "bytes"

    @property
    def conn(self) -> ServerProtocol:
        """websockets' protocol, as uvicorn's constructor builds it, on first use (a
        handshake websockets parses, an ASGI accept); gone once taken over."""
        conn = self._conn
        if conn is None:
            if self._conn_gone:
                raise AttributeError("conn")
            extensions: list[ServerExtensionFactory] = []
            if self.config.ws_per_message_deflate:
                extensions = [
                    ServerPerMessageDeflateFactory(
                        server_max_window_bits=12,
                        client_max_window_bits=12,
                        compress_settings={"memLevel": 5},
                    )
                ]
            conn = self._conn = ServerProtocol(
                extensions=extensions,
                max_size=self.config.ws_max_size,
                logger=logging.getLogger("uvicorn.error"),
            )
        return conn

    @conn.setter
    def conn(self, value: ServerProtocol) -> None:
        self._conn = value

    @conn.deleter
    def conn(self) -> None:
        self._conn = None
        self._conn_gone = True

    # -- handshake ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.handshake_initiated and not self.handshake_complete:
            if len(self._early) + len(data) > EARLY_LIMIT:
                self.transport.close()
                return
            self._early += data
            return
        if not self.handshake_initiated and self._lean_handshake(data):
            return
        if not self.handshake_complete:
            super().data_received(data)
            return
        # Accepted through ASGI: the parser gets whole frames only, so that a take-over
        # can carry over exactly what it has not turned into messages yet.
        tail = self._tail
        tail += data
        whole = whole_frames(tail, self.config.ws_max_size)
        if not whole:
            return
        data = bytes(tail[:whole])
        del tail[:whole]
        # uvicorn's own version drops the frames read before a protocol violation in
        # the same read; deliver them first, as the splice does, then fail with 1002
        # (websockets' parser refuses unmasked frames, reserved bits and opcodes).
        self.conn.receive_data(data)
        self.handle_events()
        if self.conn.parser_exc is not None:
            self.handle_parser_exception()

    def upgrade_parsed(
        self,
        transport: asyncio.Transport,
        http: tuple[tuple[str, int | None] | None, tuple[str, int] | None, str | None],
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        """An upgrade that uvicorn's HTTP protocol has already read
        (:class:`proxy.relay.uvicorn_http.HeadLimitedProtocol` hands it over): uvicorn's
        ``connection_made`` with the addresses and scheme the HTTP protocol found for
        the connection (``http``: server, client, "http"/"https"; not asked of the
        socket again), then the request as parsed, rather than re-serialised by uvicorn
        and parsed again. ``headers`` are uvicorn's: names lower-cased. Anything the
        lean reading does not take goes to websockets' parser as uvicorn would send it."""
        self.connections.add(self)
        self.transport = transport
        self.server, self.client, scheme = http
        self.scheme = "wss" if scheme == "https" else "ws"
        if method == "GET" and self._lean_request(target, headers):
            return
        self.data_received(_serialised(target, headers, method.encode()))

    def _lean_handshake(self, data: bytes) -> bool:
        """Read a well-formed handshake request (the common case) without websockets'
        parser; False leaves it to that parser (errors, odd requests)."""
        if not data.endswith(b"\r\n\r\n"):
            return False
        lines = data[:-4].split(b"\r\n")
        request_line = lines[0].split(b" ")
        if len(request_line) != 3 or request_line[0] != b"GET" or request_line[2] != b"HTTP/1.1":
            return False
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(b": ")
            if not sep or not name or b":" in name or name != name.lower():
                return False
            headers.append((name, value))
        return self._lean_request(request_line[1], headers)

    def _lean_request(self, target: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
        """The RFC 6455 4.2.1 checks of a GET request's target and headers (names lower
        case, non-empty, without a colon: as an HTTP parser gives them), then the scope
        and the ASGI task; False (nothing done) if one fails."""
        if not target.isascii() or not target.startswith(b"/"):
            return False
        key: bytes | None = None
        version: bytes | None = None
        upgrade = connection = False
        protocols: list[str] = []
        handshake = _HANDSHAKE_FIELDS
        for name, value in headers:
            if name not in handshake:
                continue
            if name == b"sec-websocket-key":
                if key is not None:
                    return False
                key = value
            elif name == b"sec-websocket-version":
                if version is not None:
                    return False
                version = value
            elif name == b"upgrade":
                if upgrade or value.strip().lower() != b"websocket":
                    return False
                upgrade = True
            elif name == b"connection":
                connection = connection or any(
                    t.strip().lower() == b"upgrade" for t in value.split(b",")
                )
            elif name == b"sec-websocket-protocol":
                protocols += [t.strip() for t in value.decode("latin-1").split(",")]
        if not (upgrade and connection and version == b"13" and key is not None):
            return False
        try:
            if len(base64.b64decode(key, validate=True)) != 16:
                return False
        except binascii.Error:
            return False
        self._accept_key = base64.b64encode(hashlib.sha1(key + _GUID).digest()).decode()
        self._request = (target, headers)
        raw_path, _, query = target.decode("ascii").partition("?")
        self.handshake_initiated = True
        self.scope = {
            "type": "websocket",
            "asgi": {"version": self.asgi_version, "spec_version": "2.4"},
            "http_version": "1.1",
            "scheme": self.scheme,
            "server": self.server,
            "client": self.client,
            "root_path": self.root_path,
            "path": self.root_path + unquote(raw_path),
            "raw_path": self.root_path.encode("ascii") + raw_path.encode("ascii"),
            "query_string": query.encode("ascii"),
            "headers": headers,
            "subprotocols": protocols,
            "state": self.app_state.copy(),
            "extensions": {"websocket.http.response": {}, **self._splice_extension()},
        }
        self.queue.put_nowait({"type": "websocket.connect"})
        task = self.loop.create_task(self.run_asgi())
        task.add_done_callback(self.on_task_complete)
        self.tasks.add(task)
        return True

    def _websockets_handshake(self) -> None:
        """Build the websockets request/response objects the lean handshake skipped,
        for uvicorn's own ``websocket.accept`` path."""
        if self._request is None:
            return
        # websockets' parser reads the request now, so that it then reads frames
        self.conn.receive_data(_serialised(*self._request))
        self._request = None
        (request,) = self.conn.events_received()
        assert isinstance(request, Request)
        self.request = request
        self.response = self.conn.accept(request)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if self.handshake_initiated and not self.handshake_complete:
            self._accept_key = self.response.headers["Sec-WebSocket-Accept"]
            self.scope["extensions"].update(self._splice_extension())

    def _splice_extension(self) -> dict[str, Any]:
        return {"headroom.splice": {"take_over": self.take_over, "gone": self.gone}}

    def gone(self) -> asyncio.Future[None]:
        """A future that is done once the client's connection is lost: what a session
        not yet accepted races its waits against (the queue, the upstream connect).
        Before an accept nothing but a disconnect can come from the client, so this
        says what a ``websocket.disconnect`` from ASGI ``receive`` would, without a task
        blocked in ``receive`` (a task, a queue getter and a cancellation per session
        set-up: issue 17)."""
        gone = self._gone
        if gone is None:
            gone = self._gone = self.loop.create_future()
            if self.disconnected:
                gone.set_result(None)
        return gone

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        gone = self._gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.accept":
            self._websockets_handshake()
        await super().send(message)
        if message["type"] == "websocket.accept" and self._early and self.handshake_complete:
            early, self._early = bytes(self._early), bytearray()
            self.data_received(early)

    def take_over(
        self,
        subprotocol: str | None,
        headers: list[tuple[bytes, bytes]],
        protocol: asyncio.Protocol,
        on_shutdown: Callable[[], None],
        held: Iterable[Mapping[str, Any]] = (),
    ) -> tuple[asyncio.Transport, bytes] | None:
        """Answer the handshake with 101 (unless the app accepted it already) and give
        the socket to ``protocol``, with what the client sent that nobody relayed."""
        if (
            self.disconnected
            or self.on_shutdown is not None
            or self.initial_response is not None  # the app answered with HTTP
            or self.transport.is_closing()
        ):
            return None
        if self.handshake_complete:
            return self._take_over_accepted(protocol, on_shutdown, held)
        self.handshake_complete = True
        head = [
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: ",
            self._accept_key.encode(),
            b"\r\n",
        ]
        for name, value in (*self.default_headers, *headers):
            head += [name, b": ", value, b"\r\n"]
        if subprotocol:
            head += [b"Sec-WebSocket-Protocol: ", subprotocol.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        self.transport.write(b"".join(head))
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        early, self._early = bytes(self._early), bytearray()
        self.on_shutdown = on_shutdown
        self.transport.set_protocol(protocol)
        self._let_go()
        return self.transport, early

    def _take_over_accepted(
        self,
        protocol: asyncio.Protocol,
        on_shutdown: Callable[[], None],
        held: Iterable[Mapping[str, Any]],
    ) -> tuple[asyncio.Transport, bytes] | None:
        """The take-over of a connection accepted through ASGI: the early bytes are, in
        order, ``held``, the messages still in uvicorn's queue, the fragmented message
        uvicorn was assembling and the frame still arriving."""
        if self.close_sent:
            return None  # the app closed it
        parts = [_client_frame(message) for message in held]
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if message["type"] == "websocket.disconnect":
                return None
            if message["type"] == "websocket.receive":
                parts.append(_client_frame(message))
        if self.frames:  # the first fragments of a message, as one unfinished frame
            opcode = TEXT if self.curr_msg_data_type == "text" else BINARY
            first = frame(opcode, b"".join(self.frames), masked=True)
            parts.append(bytes((first[0] & 0x7F,)) + first[1:])
            self.frames = []
        parts.append(bytes(self._tail))
        self._tail = bytearray()
        self.stop_keepalive()  # its pings would land inside the relayed stream
        # websockets' request and response (headers and all) served the ASGI accept;
        # the session may last an hour without them (about 1 KB each)
        del self.request, self.response
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.on_shutdown = on_shutdown
        self.transport.set_protocol(protocol)
        self._let_go()
        return self.transport, b"".join(parts)

    def _let_go(self) -> None:
        """Taken over, the connection never reaches uvicorn's WebSocket machinery again:
        the transport's callbacks go to the splice, and the app neither receives nor
        sends (a stray send fails rather than writing into the relayed stream). Drop
        what would otherwise live as long as the session: websockets' protocol (about
        1.9 KB), the ASGI receive queue (3.3 KB) and the write-flow event (0.9 KB),
        some 20 objects the garbage collector would walk on every pass; and the request
        kept for websockets' parser, which will not read it now."""
        del self.conn, self.queue, self.writable
        self._request = None

    def released(self) -> None:
        """The taken-over connection is closed: uvicorn stops tracking it."""
        self.connections.discard(self)
        self.disconnected = True

    # -- while taken over ----------------------------------------------------------------

    def shutdown(self) -> None:
        if self.on_shutdown is None:
            super().shutdown()
        else:
            self.on_shutdown()

    async def run_asgi(self) -> None:
        try:
            await super().run_asgi()
        finally:
            # The extension's bound take_over ties the scope back to this protocol: a
            # cycle that left the connection's objects to the garbage collector.
            self.scope["extensions"].pop("headroom.splice", None)
        if self.on_shutdown is not None:
            self.released()
