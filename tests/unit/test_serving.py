"""proxy.serving: uvicorn servers embedded in a running event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from proxy.serving import EmbeddedServer, make_config, running_server


async def nothing(scope: Any, receive: Any, send: Any) -> None:
    return None


async def test_should_exit_ends_an_idle_servers_main_loop_without_waiting_for_a_tick() -> None:
    """uvicorn's loop sleeps 0.1 s between ticks and only then sees ``should_exit``; with
    no connection open the embedded server's loop ends within a few turns of the event
    loop (every server the tests start and stop used to cost up to 0.1 s more)."""
    config = make_config(nothing)
    config.load()
    server = EmbeddedServer(config)
    assert server.should_exit is False
    loop = asyncio.create_task(server.main_loop())
    for _ in range(5):  # the loop has ticked once and waits for the next tick
        await asyncio.sleep(0)
    assert not loop.done()
    server.should_exit = True
    for _ in range(20):
        if loop.done():
            break
        await asyncio.sleep(0)
    assert loop.done()
    await loop
    assert server.should_exit is True


async def test_a_server_stopped_with_a_connection_open_still_stops() -> None:
    """With a connection open the loop keeps uvicorn's tick (see main_loop); the stop
    still closes the connection and ends the server."""
    async with running_server(nothing) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            for _ in range(2000):  # until uvicorn has taken the connection
                if server.server.server_state.connections:
                    break
                await asyncio.sleep(0.005)
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


async def test_an_idle_server_shuts_down_without_uvicorns_pause_and_runs_the_lifespan() -> None:
    """With no connection open, the stop skips uvicorn's 0.1 s pause for connections to
    answer their close: the serve task ends within a few turns of the event loop, and
    the app still gets its lifespan shutdown (Headroom's Runtime closes there)."""
    app = Lifespan()
    async with running_server(app) as server:
        server.server.should_exit = True
        for _ in range(200):
            if server.task.done():
                break
            await asyncio.sleep(0)
        assert server.task.done()
        assert app.messages == ["lifespan.startup", "lifespan.shutdown"]
        with contextlib.suppress(OSError), socket.create_connection(
            (server.host, server.port), timeout=1
        ):
            raise AssertionError("the listener still accepts connections")
