"""proxy.serving: uvicorn servers embedded in a running event loop."""

from __future__ import annotations

import asyncio
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
