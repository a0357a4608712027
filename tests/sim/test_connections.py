"""proxy.sim.connections: a simulated GPU aborts a connection by its scope's peer address,
for HTTP requests and upgraded WebSockets alike (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from proxy.process.serving import running_server
from proxy.sim.connections import ConnectionTable, tracked_http


class Holding:
    """Answers HTTP with a started, never-finished body and accepts WebSockets, telling
    the test each one's ``client``."""

    def __init__(self) -> None:
        self.clients: asyncio.Queue[Any] = asyncio.Queue()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            await self.clients.put(scope["client"])
            await asyncio.Event().wait()
        elif scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            await self.clients.put(scope["client"])
            while (await receive())["type"] != "websocket.disconnect":
                pass


async def test_an_http_connection_is_aborted_by_its_peer_address() -> None:
    app, table = Holding(), ConnectionTable()
    async with running_server(app, http=tracked_http(table), lifespan="off",
                              proxy_headers=False) as server:  # fmt: skip
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        client = await asyncio.wait_for(app.clients.get(), 30)
        assert len(table) == 1
        assert table.abort(client)
        rest = await asyncio.wait_for(reader.read(), 30)
        assert not rest.endswith(b"0\r\n\r\n")  # no end of the body
        assert not table.abort(client)  # gone
        writer.close()


async def test_an_upgraded_websocket_is_aborted_too() -> None:
    app, table = Holding(), ConnectionTable()
    options: dict[str, Any] = {"http": tracked_http(table), "ws": "websockets-sansio",
                               "lifespan": "off", "proxy_headers": False}  # fmt: skip
    async with (
        running_server(app, **options) as server,
        connect(server.ws_url, compression=None) as ws,
    ):
        client = await asyncio.wait_for(app.clients.get(), 30)
        assert table.abort(client)
        with pytest.raises(ConnectionClosedError) as closed:
            await asyncio.wait_for(ws.recv(), 30)
        assert closed.value.rcvd is None  # no close frame: the TCP connection went


def test_an_unknown_or_malformed_peer_aborts_nothing() -> None:
    table = ConnectionTable()
    assert not table.abort(None)
    assert not table.abort(("127.0.0.1", 1))
    assert not table.abort("127.0.0.1")
