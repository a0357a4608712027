"""A WebSocket upstream on 127.0.0.1 whose connections a test can cut without a close
frame (as a crashed engine's would end).

websockets' asyncio server publishes no way to drop a connection without the closing
handshake, so this upstream runs websockets' Sans-I/O server (``ServerProtocol``: the
handshake, frames, the reply to a close) over asyncio streams and keeps each
connection's stream writer, whose transport :meth:`UpstreamConnection.abort` aborts.
Frames from the gateway are read and dropped; a close is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from tests.integration.raw_upstream import serving

__all__ = ["AbortableUpstream", "UpstreamConnection", "abortable_ws_upstream"]


class UpstreamConnection:
    """One accepted WebSocket connection of the upstream."""

    def __init__(self, protocol: ServerProtocol, writer: asyncio.StreamWriter) -> None:
        self.protocol = protocol
        self.writer = writer

    def flush(self) -> None:
        """Write what the protocol has to send (an empty chunk: half-close)."""
        for data in self.protocol.data_to_send():
            if data:
                self.writer.write(data)
            elif self.writer.can_write_eof():
                self.writer.write_eof()

    async def send(self, data: bytes) -> None:
        self.protocol.send_binary(data)
        self.flush()
        await self.writer.drain()

    def abort(self) -> None:
        """End the TCP connection with a reset: no close frame, no FIN."""
        self.writer.transport.abort()


@dataclass
class AbortableUpstream:
    """``on_open`` runs for each connection once its handshake is answered."""

    on_open: Callable[[UpstreamConnection], Awaitable[None]]
    port: int = 0
    connections: list[UpstreamConnection] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = UpstreamConnection(ServerProtocol(), writer)
        try:
            request = await self._request(reader, conn)
            if request is None:
                return
            conn.protocol.send_response(conn.protocol.accept(request))
            conn.flush()
            self.connections.append(conn)
            await self.on_open(conn)
            while conn.protocol.state is not State.CLOSED:
                data = await reader.read(65536)
                if data:
                    conn.protocol.receive_data(data)
                else:
                    conn.protocol.receive_eof()
                conn.protocol.events_received()  # frames are dropped; a close is answered
                conn.flush()
                if not data:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass  # aborted by the test, or the test ended
        finally:
            writer.transport.abort()

    @staticmethod
    async def _request(reader: asyncio.StreamReader, conn: UpstreamConnection) -> Request | None:
        """The handshake request, or None if the connection ends before it is whole."""
        while True:
            data = await reader.read(65536)
            if not data:
                return None
            conn.protocol.receive_data(data)
            for event in conn.protocol.events_received():
                if isinstance(event, Request):
                    return event


@contextlib.asynccontextmanager
async def abortable_ws_upstream(
    on_open: Callable[[UpstreamConnection], Awaitable[None]],
) -> AsyncIterator[AbortableUpstream]:
    upstream = AbortableUpstream(on_open)
    async with serving(upstream):
        yield upstream
