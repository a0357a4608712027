"""bench/chaos_proc.py's count of the upstream HTTP client's open connections
(``upstream_pool_connections`` in its probe), against real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from chaos_proc import PoolSockets, socket_inodes  # bench/chaos_proc.py (see conftest.py)


class _KeepAliveServer:
    """A minimal HTTP/1.1 server on 127.0.0.1 port 0: answers every request on a
    connection with a small keep-alive response; counts the connections it accepted."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: list[asyncio.Task[object]] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers)  # each ends at its connection's close
        await self._server.wait_closed()


@pytest.fixture
async def server() -> AsyncIterator[_KeepAliveServer]:
    srv = _KeepAliveServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


def test_socket_inodes_lists_this_process_open_sockets() -> None:
    a, b = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        ours = {os.fstat(s.fileno()).st_ino for s in (a, b, listener)}
        assert ours <= socket_inodes()
    finally:
        a.close()
        listener.close()
    left = socket_inodes()
    assert os.fstat(b.fileno()).st_ino in left
    assert not (ours - {os.fstat(b.fileno()).st_ino}) & left
    b.close()


async def test_counts_the_clients_open_connections_and_nothing_else(
    server: _KeepAliveServer,
) -> None:
    sockets = PoolSockets()
    base = f"http://127.0.0.1:{server.port}"
    client = httpx.AsyncClient(base_url=base, trust_env=False)
    sockets.watch(client)
    sockets.watch(client)  # once per client: one hook, not two
    assert len(client.event_hooks["response"]) == 1
    # a connection to the same server the client did not open (as a WebSocket relay's)
    reader, other = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        other.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        assert sockets.count() == 0
        assert (await client.get("/")).text == "ok"
        assert sockets.count() == 1  # the idle keep-alive connection
        assert (await client.get("/")).text == "ok"
        assert sockets.count() == 1  # reused, not a second one
        # two responses open at once: two busy connections, then two idle ones
        async with client.stream("GET", "/") as first, client.stream("GET", "/") as second:
            assert sockets.count() == 2
            assert await first.aread() == await second.aread() == b"ok"
        assert sockets.count() == 2
        assert server.accepted == 3  # two by the client, one beside it
        await client.aclose()
        assert sockets.count() == 0  # closed connections are not counted
    finally:
        other.close()
        await client.aclose()


async def test_a_second_client_is_counted_on_its_own_hook(server: _KeepAliveServer) -> None:
    sockets = PoolSockets()
    base = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=base, trust_env=False) as unwatched:
        await unwatched.get("/")
        async with httpx.AsyncClient(base_url=base, trust_env=False) as watched:
            sockets.watch(watched)
            await watched.get("/")
            assert sockets.count() == 1  # the unwatched client's connection is not counted
