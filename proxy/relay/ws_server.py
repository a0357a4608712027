"""The client side of a WebSocket session: Headroom's own, from the handshake to the take-over.

:class:`proxy.relay.listener.ClientListener` reads every request head; a WebSocket
handshake (a GET over HTTP/1.1 asking to upgrade to ``websocket``) becomes a
:class:`ClientWebSocket`, which runs the ASGI app with a ``websocket`` scope. The app
stays the one place a session is decided -- authentication, admission, queueing,
refusals -- through plain ASGI messages, plus one extension:

- ``scope["extensions"]["headroom.splice"]["take_over"]`` (:class:`TakeOver`) answers the
  handshake with 101 (the chosen subprotocol and extra headers) and hands the transport,
  with any bytes the client sent early, to the caller's protocol in the same step; from
  then on the session's frames are relayed in protocol callbacks
  (:mod:`proxy.relay.splice`) and nothing here parses them;
- ``...["gone"]()`` is a future done once the client's connection is lost: what a session
  not yet accepted races its waits against, without a task blocked in ``receive``.

The handshake's checks and answers are in :mod:`proxy.relay.ws_handshake`.

A connection the app accepts through ASGI (``websocket.accept``: queue feedback, where
the client is told its place before it is admitted) has its frames read here with
:mod:`proxy.relay.wsframes` (the framing rules the splice applies too): pings are
answered, close handshakes completed, a frame that breaks RFC 6455 is answered with the
close code :class:`~proxy.relay.wsframes.FrameError` names (1002, 1007, 1009) and the
connection closed. Frames are read only whole (a frame still arriving waits here,
bounded by ``max_size``), so at a take-over what the app held, the messages it did not
read, the fragments of a message still being assembled and the bytes of a frame not yet
complete all go to the relay as client frames, in the order they came.

A client must wait for the handshake response before it sends frames (RFC 6455 4.1);
bytes that arrive before it anyway are held (:data:`EARLY_LIMIT`), not parsed, and reach
whichever path the app takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.relay.ws_handshake import ASGIApp, TakeOver, http_response
from proxy.relay.wsframes import (
    BINARY,
    CLOSE,
    CONT,
    PING,
    PONG,
    TEXT,
    Frame,
    FrameError,
    client_frame,
    close_fields,
    close_frame,
    decode_text,
    fragment,
    frame,
    parse_frame,
    whole_frames,
)

__all__ = [
    "EARLY_LIMIT",
    "ClientDisconnected",
    "ClientWebSocket",
    "TakeOver",
    "WebSocketOptions",
    "WebSocketSessions",
]

log = logging.getLogger("headroom.http")

#: Bytes a client may send between its handshake request and our response; beyond
#: this the connection is dropped (the session ends as a client disconnect).
EARLY_LIMIT = 256 * 1024


class ClientDisconnected(OSError):
    """An ASGI ``send`` after the client's connection was lost."""


@dataclass(frozen=True)
class WebSocketOptions:
    """What bounds a client WebSocket before it is taken over."""

    #: The largest message read from an accepted client (1009 beyond it); None: no limit.
    max_size: int | None = 1 << 20
    #: Messages read from the client and not yet received by the app; reading pauses
    #: beyond it.
    max_queue: int = 16
    #: Seconds between keepalive pings while the app holds an accepted connection (0:
    #: none), and how long a pong may take before the connection fails with 1011.
    ping_interval_s: float = 0.0
    ping_timeout_s: float = 20.0
    #: How long a close handshake the app started may take before the socket is dropped.
    close_timeout_s: float = 10.0


class WebSocketSessions:
    """The client WebSockets a server holds, for its shut-down: each one's ASGI task, and
    what it should be told when the server stops."""

    def __init__(self) -> None:
        self.live: dict[ClientWebSocket, asyncio.Task[None]] = {}

    def add(self, ws: ClientWebSocket, task: asyncio.Task[None]) -> None:
        self.live[ws] = task
        task.add_done_callback(lambda _: self.live.pop(ws, None))

    def shutdown(self) -> None:
        """Tell every session the server is stopping: a relayed session is stopped with
        1012, an accepted one closed with 1012, a handshake still open answered 503."""
        for ws in list(self.live):
            ws.shutdown()

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the sessions' tasks, then cancel the rest."""
        tasks = list(self.live.values())
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            log.error("cancelled %d WebSocket session(s) still open at shut-down", len(pending))
            await asyncio.wait(pending)


class ClientWebSocket:
    """One client connection whose request head was a WebSocket handshake, from the
    ASGI app's first look at it until it is taken over or closed. The listener passes
    the transport's callbacks here until the take-over."""

    __slots__ = (
        "__weakref__", "_accept_key", "_close_rcvd", "_closing", "_connect_sent", "_early",
        "_fragments", "_gone", "_message_ready", "_messages", "_msg_size", "_ping",
        "_read_paused", "_reading", "_response", "_tail", "_timer", "_write_paused",
        "accepted", "answered", "close_code", "close_sent", "disconnected", "loop",
        "on_shutdown", "options", "scope", "sessions", "taken", "transport",
    )  # fmt: skip

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        options: WebSocketOptions,
        sessions: WebSocketSessions,
    ) -> None:
        self.transport = transport
        self.loop = loop
        self.options = options
        self.sessions = sessions
        self.scope: dict[str, Any] = {}
        self._accept_key = ""
        self._connect_sent = False
        self.accepted = False  # 101 written
        self.answered = False  # an HTTP response written instead
        self.taken = False
        self.disconnected = False
        self.close_code = 1006
        self.close_sent = False
        self._early = bytearray()
        self._tail = bytearray()
        self._fragments: list[Frame] = []  # of a message still being assembled
        self._msg_size = 0
        self._reading = False  # accepted, frames are read here (until the take-over)
        self._closing = False  # a close frame was written (ours, or the echo of the client's)
        self._close_rcvd = False
        # at most options.max_queue (reading pauses there): a list, smaller than a deque
        self._messages: list[dict[str, Any]] = []
        self._message_ready: asyncio.Future[None] | None = None
        self._read_paused = False
        self._write_paused: asyncio.Future[None] | None = None
        self._gone: asyncio.Future[None] | None = None
        self._response: tuple[int, list[tuple[bytes, bytes]], bytearray] | None = None
        self._timer: asyncio.TimerHandle | None = None  # keepalive or close deadline
        self._ping: bytes | None = None  # the payload of a ping without its pong yet
        self.on_shutdown: Callable[[], None] | None = None

    # -- start ---------------------------------------------------------------------------

    def start(
        self,
        app: ASGIApp,
        scope: dict[str, Any],
        accept_key: str,
        early: bytes,
    ) -> None:
        """Run ``app`` on the handshake (``scope`` without its extensions)."""
        self._accept_key = accept_key
        if early:
            self.data_received(early)
        scope["extensions"] = {
            "websocket.http.response": {},
            "headroom.splice": {"take_over": self.take_over, "gone": self.gone},
        }
        self.scope = scope
        task = self.loop.create_task(self._run(app))
        self.sessions.add(self, task)

    async def _run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            if not isinstance(exc, (asyncio.CancelledError, ClientDisconnected)):
                log.error("exception in the ASGI application (WebSocket)", exc_info=exc)
            self._app_failed()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            if not (self.accepted or self.answered or self.disconnected):
                log.error("the ASGI application returned without answering a WebSocket handshake")
                self._app_failed()
            elif self.accepted and not (self.taken or self.close_sent or self.disconnected):
                self._close(1000, "")
        finally:
            # The extension's bound methods tie the scope back to this object.
            self.scope["extensions"].pop("headroom.splice", None)

    def _app_failed(self) -> None:
        if self.taken or self.disconnected:
            return
        if self.accepted:
            if not self.close_sent:
                self._close(1011, "")
        elif not self.answered:
            self._answer(500, [(b"content-type", b"text/plain; charset=utf-8")],
                         b"Internal Server Error")  # fmt: skip

    # -- the transport's callbacks (until the take-over) -----------------------------------

    def data_received(self, data: bytes) -> None:
        if self.answered or self.disconnected:
            return
        if not self.accepted:
            if len(self._early) + len(data) > EARLY_LIMIT:
                self.transport.close()
                return
            self._early += data
            return
        if not self._reading:
            return
        tail = self._tail
        tail += data
        whole = whole_frames(tail, self.options.max_size)
        if not whole:
            return
        chunk = bytes(tail[:whole])
        del tail[:whole]
        self._read_frames(chunk)

    def eof_received(self) -> bool | None:
        if self._reading:
            self._reading = False
            self.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disconnect(self.close_code)
        self._cancel_timer()
        paused = self._write_paused
        if paused is not None and not paused.done():
            paused.set_result(None)

    def pause_writing(self) -> None:
        if self._write_paused is None or self._write_paused.done():
            self._write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        paused = self._write_paused
        if paused is not None and not paused.done():
            paused.set_result(None)

    # -- frames while the app holds an accepted connection ----------------------------------

    def _read_frames(self, chunk: bytes) -> None:
        """The whole frames in ``chunk``, in order, until one breaks RFC 6455."""
        pos, end = 0, len(chunk)
        max_size = self.options.max_size
        while pos < end and self._reading:
            room = None if max_size is None else max_size - self._msg_size
            try:
                parsed = parse_frame(chunk, pos, from_client=True,
                                     in_message=bool(self._fragments), max_size=room)  # fmt: skip
            except FrameError as exc:
                self._fail(exc.code, exc.reason)
                return
            if parsed is None:  # pragma: no cover - whole_frames passed whole frames only
                return
            got, pos = parsed
            self._frame(got)

    def _frame(self, got: Frame) -> None:
        opcode = got.opcode
        if opcode in (TEXT, BINARY, CONT):
            if self._close_rcvd:
                return
            if not got.fin:
                self._fragments.append(got)
                self._msg_size += len(got.payload)
                return
            if self._fragments:
                first = self._fragments[0].opcode
                data = b"".join([f.payload for f in self._fragments]) + got.payload
                self._fragments = []
                self._msg_size = 0
                self._message(first, data)
            else:
                self._message(opcode, got.payload)
        elif opcode == PING:
            if not self._closing:
                self.transport.write(frame(PONG, got.payload, masked=False))
        elif opcode == PONG:
            if self._ping is not None and got.payload == self._ping:
                self._pong()
        elif opcode == CLOSE:
            if self._fragments:
                self._fail(1002, "incomplete fragmented message")
                return
            self._close_rcvd = True
            self.close_code = close_fields(got.payload)[0]
            if not self._closing:  # the client began the closing handshake: echo it
                self._closing = True
                self.transport.write(frame(CLOSE, got.payload, masked=False))
            self._reading = False
            self.transport.close()  # the server ends the TCP connection (RFC 6455 7.1.1)

    def _fail(self, code: int, reason: str) -> None:
        """Fail the connection (RFC 6455 7.1.7): our close frame, then the socket closed."""
        self._reading = False
        if not self._closing:
            self._closing = True
            self.transport.write(close_frame(code, reason, masked=False))
        self.transport.close()

    def _message(self, opcode: int, data: bytes) -> None:
        if opcode == TEXT:
            text = decode_text(data)
            if text is None:
                self._fail(1007, "invalid UTF-8")
                return
            self._push({"type": "websocket.receive", "text": text})
        else:
            self._push({"type": "websocket.receive", "bytes": data})
        if len(self._messages) >= self.options.max_queue and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _push(self, message: dict[str, Any]) -> None:
        self._messages.append(message)
        ready = self._message_ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def _close(self, code: int, reason: str) -> None:
        if not self.accepted or self.taken or self.close_sent:
            return
        self.close_sent = True
        if not self._closing:
            self._closing = True
            self.transport.write(close_frame(code, reason, masked=False))
        self._cancel_timer()
        self._timer = self.loop.call_later(self.options.close_timeout_s, self.transport.abort)

    def _keepalive(self) -> None:
        """Time for a ping: send it, then give its pong ``ping_timeout_s`` (0: no
        deadline, the next ping follows after ``ping_interval_s``)."""
        self._timer = None
        if not self._reading or self._closing:
            return
        self._ping = self.loop.time().hex().encode()
        self.transport.write(frame(PING, self._ping, masked=False))
        options = self.options
        if options.ping_timeout_s > 0:
            self._timer = self.loop.call_later(options.ping_timeout_s, self._pong_overdue)
        else:
            self._timer = self.loop.call_later(options.ping_interval_s, self._keepalive)

    def _pong(self) -> None:
        """The pong of the last ping: the next ping ``ping_interval_s`` from now."""
        self._ping = None
        if self.close_sent or self.taken:
            return
        self._cancel_timer()
        self._timer = self.loop.call_later(self.options.ping_interval_s, self._keepalive)

    def _pong_overdue(self) -> None:
        self._timer = None
        if not self._reading or self._closing or self._ping is None:
            return
        self._fail(1011, "keepalive ping timeout")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _disconnect(self, code: int) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self._push({"type": "websocket.disconnect", "code": code})
        gone = self._gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    # -- ASGI ----------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if not self._connect_sent:
            self._connect_sent = True
            return {"type": "websocket.connect"}
        messages = self._messages
        while not messages:
            ready = self._message_ready = self.loop.create_future()
            try:
                await ready
            finally:
                self._message_ready = None
        message = messages[0]
        if message["type"] == "websocket.disconnect":
            return message  # stays: every later receive says the same
        del messages[0]
        if self._read_paused and len(messages) <= self.options.max_queue // 2:
            self._read_paused = False
            if not self.taken and not self.transport.is_closing():
                self.transport.resume_reading()
        return message

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if self.taken:
            raise RuntimeError(f"ASGI {kind!r} on a WebSocket taken over by the relay")
        if self.disconnected:
            raise ClientDisconnected(f"ASGI {kind!r}: the client has left")
        if not self.accepted and not self.answered:
            if kind == "websocket.accept":
                self._accept(message.get("subprotocol"), list(message.get("headers") or ()))
                return
            if kind == "websocket.close":
                self._answer(403, [], b"")
                return
            if kind == "websocket.http.response.start":
                self._response = (int(message["status"]), list(message.get("headers") or ()),
                                  bytearray())  # fmt: skip
                self.answered = True
                return
        elif self._response is not None and kind == "websocket.http.response.body":
            status, headers, body = self._response
            body += message.get("body", b"")
            if not message.get("more_body", False):
                self._response = None
                self.transport.write(http_response(status, headers, bytes(body), time.time()))
                self.transport.close()
            return
        elif self.accepted and not self.close_sent:
            if kind == "websocket.send":
                if self._closing:
                    raise ClientDisconnected(f"ASGI {kind!r}: the connection is closing")
                text = message.get("text")
                if text is not None:
                    self.transport.write(frame(TEXT, text.encode(), masked=False))
                else:
                    self.transport.write(frame(BINARY, message.get("bytes") or b"", masked=False))
                paused = self._write_paused
                if paused is not None and not paused.done():
                    await paused
                return
            if kind == "websocket.close":
                self._close(int(message.get("code", 1000)), message.get("reason") or "")
                return
        raise RuntimeError(f"unexpected ASGI message {kind!r} in this WebSocket's state")

    def _answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.answered = True
        self.transport.write(http_response(status, headers, body, time.time()))
        self.transport.close()

    def _switch(self, subprotocol: str | None, headers: list[tuple[bytes, bytes]]) -> None:
        """Write the 101."""
        head = [
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: ",
            self._accept_key.encode(),
            b"\r\n",
        ]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        if subprotocol:
            head += [b"Sec-WebSocket-Protocol: ", subprotocol.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        self.transport.write(b"".join(head))
        self.accepted = True

    def _accept(self, subprotocol: str | None, headers: list[tuple[bytes, bytes]]) -> None:
        """``websocket.accept``: the 101, then the client's frames are read here."""
        self._switch(subprotocol, headers)
        self._reading = True
        if self.options.ping_interval_s > 0:
            self._timer = self.loop.call_later(self.options.ping_interval_s, self._keepalive)
        early, self._early = bytes(self._early), bytearray()
        if early:
            self.data_received(early)

    def gone(self) -> asyncio.Future[None]:
        """A future done once the client's connection is lost. Before an accept nothing
        but a disconnect can come from the client, so this says what a
        ``websocket.disconnect`` from ``receive`` would, without a task blocked there."""
        gone = self._gone
        if gone is None:
            gone = self._gone = self.loop.create_future()
            if self.disconnected:
                gone.set_result(None)
        return gone

    # -- the take-over -------------------------------------------------------------------

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
        transport = self.transport
        if self.disconnected or self.taken or self.answered or transport.is_closing():
            return None
        if self.accepted:
            early = self._accepted_bytes(held)
            if early is None:
                return None
        else:
            self._switch(subprotocol, headers)
            early, self._early = bytes(self._early), bytearray()
        self._cancel_timer()
        self.taken = True
        self.on_shutdown = on_shutdown
        self._reading = False
        if self._read_paused:
            self._read_paused = False
            transport.resume_reading()
        transport.set_protocol(protocol)
        return transport, early

    def _accepted_bytes(self, held: Iterable[Mapping[str, Any]]) -> bytes | None:
        """What the client sent that the app did not relay, as client frames: ``held``,
        the messages not received yet, the fragments of a message being assembled and
        the frame still arriving. None if the app closed or the client left."""
        if self.close_sent:
            return None
        parts = [client_frame(message) for message in held]
        for message in self._messages:
            if message["type"] == "websocket.disconnect":
                return None
            parts.append(client_frame(message))
        self._messages.clear()
        parts += [fragment(f.opcode, f.payload) for f in self._fragments]
        self._fragments = []
        parts.append(bytes(self._tail))
        self._tail = bytearray()
        return b"".join(parts)

    # -- shut-down -----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.taken:
            if self.on_shutdown is not None:
                self.on_shutdown()
        elif self.disconnected or self.answered:
            return
        elif self.accepted:
            self._close(1012, "server shutting down")
        else:
            self._answer(503, [(b"content-type", b"text/plain; charset=utf-8")],
                         b"server shutting down")  # fmt: skip
