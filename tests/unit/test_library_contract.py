"""What proxy/relay/library_contract.py takes from uvicorn and websockets beyond their
published API still exists and behaves as Headroom uses it. CI runs this module on the
newest releases pyproject.toml allows and again on the lowest (.ci/run). Real sockets on
127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import uvicorn

from proxy.process.serving import bind_socket
from proxy.relay import library_contract
from proxy.relay.library_contract import (
    UVICORN_HTTP,
    QuietServer,
    connection_protocol,
    lifespan_state,
    listening_servers,
    uvicorn_http,
)
from proxy.relay.wsframes import mask_bytes


def test_websockets_c_masking_is_the_rfc_6455_xor() -> None:
    fast = library_contract.fast_mask()
    assert fast is not None  # the wheels CI installs carry it
    key = b"\x01\x80\xfe\x7f"
    for size in (0, 1, 3, 4, 5, 125, 126, 9600, 65537):
        data = os.urandom(size)
        assert bytes(fast(data, key)) == mask_bytes(data, key), size


class Front(asyncio.Protocol):
    """A protocol class given as Config(http=...): it keeps uvicorn's keyword arguments
    and puts uvicorn's h11 protocol behind itself, as the client listener does."""

    built: list[dict[str, Any]] = []

    def __init__(self, **arguments: Any) -> None:
        type(self).built.append(arguments)
        self.inner = uvicorn_http(arguments)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)


class Upgraded(asyncio.Protocol):
    """A protocol class given as Config(ws=...): records how uvicorn hands it a later
    WebSocket upgrade."""

    seen: list[tuple[str, Any]] = []

    def __init__(self, **arguments: Any) -> None:
        type(self).seen.append(("built", sorted(arguments)))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        type(self).seen.append(("connection_made", transport))
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        type(self).seen.append(("data", data))
        self.transport.close()


class App:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete", "state": {}})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert scope["type"] == "http"
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})


async def _serve(config: uvicorn.Config) -> tuple[QuietServer, asyncio.Task[None], int]:
    sock = bind_socket()
    server = QuietServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done()
        await asyncio.sleep(0.005)
    return server, task, sock.getsockname()[1]


async def test_protocol_classes_get_the_arguments_uvicorns_own_protocol_takes() -> None:
    """A class given as ``http`` is built with keyword arguments that build uvicorn's
    h11 protocol (uvicorn_http) and carry the lifespan state; a class given as ``ws``
    gets a WebSocket upgrade that came after a plain request only once that request's
    response is written: built, then ``connection_made`` with the same transport, then
    the upgrade's head. connection_protocol builds the class with the same arguments."""
    Front.built.clear()
    Upgraded.seen.clear()
    app = App()
    config = uvicorn.Config(app, http=Front, ws=Upgraded, log_level="warning", log_config=None)
    server, task, port = await _serve(config)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )  # pipelined: the upgrade waits for the first response
        for _ in range(20):
            await asyncio.sleep(0)
        assert Upgraded.seen == []
        app.release.set()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and await reader.readexactly(2) == b"ok"
        assert await reader.read() == b""  # the ws class closed it
        writer.close()
        (arguments,) = Front.built
        assert lifespan_state(arguments) == {}
        loop = asyncio.get_running_loop()
        built = connection_protocol(Front, config, loop)  # builds uvicorn's h11 behind it
        assert isinstance(built, Front) and isinstance(built.inner, UVICORN_HTTP)
        by_contract = Front.built[1]
        assert sorted(by_contract) == sorted(arguments)
        assert type(by_contract["server_state"]) is type(arguments["server_state"])
        assert by_contract["config"] is arguments["config"] is config
        assert by_contract["_loop"] is loop and lifespan_state(by_contract) == {}
        kinds = [kind for kind, _ in Upgraded.seen]
        assert kinds == ["built", "connection_made", "data"], Upgraded.seen
        data = Upgraded.seen[2][1]
        assert data.startswith(b"GET /ws HTTP/1.1\r\n") and data.endswith(b"\r\n\r\n")
        assert b"upgrade: websocket\r\n" in data.lower()
    finally:
        server.should_exit = True
        await task


async def test_a_quiet_server_leaves_signal_handlers_alone_and_lists_its_listeners() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    config = uvicorn.Config(App(), lifespan="off", log_level="warning", log_config=None)
    server, task, port = await _serve(config)
    try:
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        (listener,) = listening_servers(server)
        assert isinstance(listener, asyncio.AbstractServer)
        assert listener.sockets[0].getsockname()[1] == port
    finally:
        server.should_exit = True
        await task
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
