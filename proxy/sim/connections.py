"""The simulated GPU's connections, found by their peer address so a fault can abort one.

uvicorn serves a simulated GPU with its own HTTP protocol, used as a black box: the
class given as uvicorn's ``http`` option (:func:`tracked_http`) builds it with the
keyword arguments uvicorn passes and forwards every callback of the asyncio Protocol
interface to it, after recording the connection's transport in a
:class:`ConnectionTable` under its peer address. The simulator serves with
``proxy_headers=False``, so an ASGI scope's ``client`` is that same peer address, one
per connection. A WebSocket upgrade keeps the transport (uvicorn's WebSocket protocol
takes its callbacks from then on), so the entry stays valid for the whole connection;
entries of closed connections are dropped as new ones come.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, cast

from proxy.relay.library_contract import uvicorn_http

__all__ = ["ConnectionTable", "TrackedHttp", "tracked_http"]

Peer = tuple[str, int]


class ConnectionTable:
    """Open connections' transports by peer address."""

    def __init__(self) -> None:
        self._by_peer: dict[Peer, asyncio.Transport] = {}

    def add(self, peer: Peer, transport: asyncio.Transport) -> None:
        if len(self._by_peer) >= 64:
            for key, known in list(self._by_peer.items()):
                if known.is_closing():
                    del self._by_peer[key]
        self._by_peer[peer] = transport

    def remove(self, peer: Peer, transport: asyncio.Transport) -> None:
        if self._by_peer.get(peer) is transport:
            del self._by_peer[peer]

    def abort(self, peer: Any) -> bool:
        """Abort the connection from ``peer`` (an ASGI scope's ``client``); False if there
        is none open."""
        if not isinstance(peer, (tuple, list)) or len(peer) != 2:
            return False
        transport = self._by_peer.pop((str(peer[0]), int(peer[1])), None)
        if transport is None or transport.is_closing():
            return False
        transport.abort()
        return True

    def __len__(self) -> int:
        return sum(1 for t in self._by_peer.values() if not t.is_closing())


class TrackedHttp(asyncio.Protocol):
    """uvicorn's HTTP protocol, with the connection recorded in :attr:`table`."""

    table: ClassVar[ConnectionTable]

    def __init__(self, **uvicorn: Any) -> None:
        self._inner = uvicorn_http(uvicorn)
        self._peer: Peer | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        info = transport.get_extra_info("peername")
        if isinstance(info, tuple):
            self._peer = (str(info[0]), int(info[1]))
            self.table.add(self._peer, self._transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None and self._transport is not None:
            self.table.remove(self._peer, self._transport)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def tracked_http(table: ConnectionTable) -> type[TrackedHttp]:
    """The :class:`TrackedHttp` class for uvicorn's ``http`` option, recording in ``table``."""
    return type("TrackedHttp", (TrackedHttp,), {"table": table})
