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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["EARLY_LIMIT", "HeadroomWebSocketProtocol", "TakeOver"]

#: Bytes a client may send between its handshake request and our response; beyond
#: this the connection is dropped (the session ends as a client disconnect).
EARLY_LIMIT = 256 * 1024

#: ``take_over(subprotocol, headers, protocol, on_shutdown)`` -> (transport, early bytes),
#: or None if the client is already gone. ``protocol`` receives the transport's callbacks
#: from then on; ``on_shutdown`` is called if uvicorn shuts down while it runs.
TakeOver = Callable[
    [str | None, list[tuple[bytes, bytes]], asyncio.Protocol, Callable[[], None]],
    "tuple[asyncio.Transport, bytes] | None",
]


class HeadroomWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's ``websockets-sansio`` protocol with the ``headroom.splice`` extension."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early = bytearray()
        self._taken: asyncio.Protocol | None = None
        self.on_shutdown: Callable[[], None] | None = None

    # -- handshake ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.handshake_initiated and not self.handshake_complete:
            if len(self._early) + len(data) > EARLY_LIMIT:
                self.transport.close()
                return
            self._early += data
            return
        super().data_received(data)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if self.handshake_initiated and not self.handshake_complete:
            self.scope["extensions"]["headroom.splice"] = {"take_over": self.take_over}

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.accept" and self._early and self.handshake_complete:
            early, self._early = bytes(self._early), bytearray()
            super().data_received(early)

    def take_over(
        self,
        subprotocol: str | None,
        headers: list[tuple[bytes, bytes]],
        protocol: asyncio.Protocol,
        on_shutdown: Callable[[], None],
    ) -> tuple[asyncio.Transport, bytes] | None:
        """Answer the handshake with 101 and give the socket to ``protocol``."""
        if self.disconnected or self.handshake_complete or self.transport.is_closing():
            return None
        extra = [
            (name.decode("latin-1").lower(), value.decode("latin-1"))
            for name, value in (*self.default_headers, *headers)
        ]
        if subprotocol:
            extra.append(("Sec-WebSocket-Protocol", subprotocol))
        del self.response.headers["Date"]
        self.response.headers.update(extra)
        self.handshake_complete = True
        self.conn.send_response(self.response)
        self.transport.write(b"".join(self.conn.data_to_send()))
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        early, self._early = bytes(self._early), bytearray()
        self._taken = protocol
        self.on_shutdown = on_shutdown
        self.transport.set_protocol(protocol)
        return self.transport, early

    def released(self) -> None:
        """The taken-over connection is closed: uvicorn stops tracking it."""
        self.connections.discard(self)
        self.disconnected = True

    # -- while taken over ----------------------------------------------------------------

    def shutdown(self) -> None:
        if self._taken is None:
            super().shutdown()
        elif self.on_shutdown is not None:
            self.on_shutdown()
        else:
            self.transport.close()

    async def run_asgi(self) -> None:
        await super().run_asgi()
        if self._taken is not None:
            self.released()
