"""proxy.process.serving: uvicorn servers embedded in a running event loop, with Headroom's
client listener (proxy.relay.listener) told of the shut-down."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.process.serving import running_server
from proxy.relay.listener import client_listener
from proxy.relay.ws_server import WebSocketSessions
from proxy.settings import LimitsSettings


async def nothing(scope: Any, receive: Any, send: Any) -> None:
    return None


async def test_a_server_stopped_with_a_connection_open_still_stops() -> None:
    async with running_server(nothing) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            await server.stop()
            assert server.task.done()
            assert await reader.read() == b""  # uvicorn closed the idle connection
        finally:
            writer.close()


class Lifespan:
    """An app that answers only the lifespan protocol and records its messages."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return
        while True:
            message = await receive()
            self.messages.append(message["type"])
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return


async def test_a_stopped_server_runs_the_lifespan_shutdown_and_stops_listening() -> None:
    app = Lifespan()
    async with running_server(app) as server:
        await server.stop()
        assert app.messages == ["lifespan.startup", "lifespan.shutdown"]
        with (
            contextlib.suppress(OSError),
            socket.create_connection((server.host, server.port), timeout=1),
        ):
            raise AssertionError("the listener still accepts connections")


class Waiting:
    """Accepts ``/accept`` and waits for the client; leaves ``/wait`` unanswered."""

    def __init__(self) -> None:
        self.started = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return
        await receive()  # websocket.connect
        if scope["path"] == "/accept":
            await send({"type": "websocket.accept"})
        self.started.set()
        while (await receive())["type"] != "websocket.disconnect":
            pass


async def test_the_shutdown_closes_accepted_sessions_with_1012() -> None:
    app = Waiting()
    listener = client_listener(app, LimitsSettings, WebSocketSessions())
    async with (
        running_server(app, http=listener, lifespan="off") as server,
        connect(f"{server.ws_url}/accept", compression=None) as ws,
    ):
        await app.started.wait()
        stopping = asyncio.ensure_future(server.stop())
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
        await stopping


async def test_the_shutdown_answers_an_open_handshake_503() -> None:
    app = Waiting()
    listener = client_listener(app, LimitsSettings, WebSocketSessions())
    async with running_server(app, http=listener, lifespan="off") as server:
        opening = asyncio.ensure_future(connect(f"{server.ws_url}/wait", compression=None))
        await app.started.wait()
        await server.stop()
        with pytest.raises(InvalidStatus) as refused:
            await asyncio.wait_for(opening, 30)
        assert refused.value.response.status_code == 503
