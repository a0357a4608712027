"""A WebSocket session's upstream set-up: one deadline for every attempt, abandoned at
once when the client leaves or the gateway drains, failover bounded, and no request
able to eject a replica (issue 14, item 3).

The upstreams here are raw asyncio servers on 127.0.0.1 port 0 that accept TCP and
answer the health check, but answer a WebSocket upgrade in a chosen way: never (as an
engine that will not parse an oversized header), or with a fixed status. Deadlines
run on a FakeClock that the tests advance; nothing sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from proxy.clock import FakeClock
from proxy.process.gateway import Gateway
from proxy.process.serving import RunningServer, running_server
from proxy.runtime import Runtime
from proxy.settings import Settings
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import hello, wait_until
from tests.integration.upstream import FakeEngine

T = TypeVar("T")

#: An upgrade request with a 9,000-byte header, as in the reproduction.
UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: headroom\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"X-Big: " + b"a" * 9000 + b"\r\n\r\n"
)


class RawUpstream:
    """Answers plain HTTP requests (the health check) with 200 and a WebSocket upgrade
    with ``answer`` -- or, if None, never: it holds the connection until the proxy
    closes it."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.upgrades = 0
        self.upgrade_seen = asyncio.Event()
        self.closed_by_proxy = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if b"upgrade: websocket" not in head.lower():
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                self.upgrades += 1
                self.upgrade_seen.set()
                if self.answer is not None:
                    writer.write(self.answer)
                    await writer.drain()
                if await reader.read() == b"":
                    self.closed_by_proxy.set()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_proxy.set()
        finally:
            writer.close()
            self._handlers.discard(task)


def status(answer: int) -> bytes:
    return f"HTTP/1.1 {answer} Nope\r\ncontent-length: 0\r\n\r\n".encode()


@contextlib.asynccontextmanager
async def upstreams(*answers: bytes | None) -> AsyncIterator[list[RawUpstream]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(RawUpstream(a)) for a in answers]


def settings_for(*urls: str, path: str = "/ws", **route: Any) -> Settings:
    return proxy_settings(
        [(f"gpu{i}", url, 1) for i, url in enumerate(urls)],
        [{"path": path, "pool": "main", "protocol": "passthrough-ws", **route}],
        limits={"handshake_timeout_s": 10, "upstream_connect_timeout_s": 5},
    )


async def send_upgrade(proxy_port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
    writer.write(UPGRADE)
    await writer.drain()
    return reader, writer


#: A generous bound on waiting for an event, so a regression fails instead of hanging
#: (ordering, not timing, is asserted).
BOUND_S = 30.0


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND_S)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await bounded(reader.readuntil(b"\r\n\r\n"))
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = await bounded(reader.readexactly(int(headers.get("content-length", "0"))))
    return int(lines[0].split()[1]), headers, body


def healthy(proxy: Proxy | Runtime) -> dict[str, bool]:
    gate = proxy.gate
    return {r.name: r.healthy for r in gate.statistics()["main"].replicas}


def errors(proxy: Proxy, replica: str, kind: str) -> float:
    return proxy.metric("headroom_upstream_errors_total", pool="main", replica=replica, kind=kind)


async def test_unanswered_handshake_times_out_once_and_ejects_nothing(
    start_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    async with upstreams(None, None) as (gpu0, gpu1):
        proxy: Proxy = await start_proxy(settings_for(gpu0.url, gpu1.url), clock)
        reader, writer = await send_upgrade(proxy.server.port)
        await bounded(gpu0.upgrade_seen.wait())
        assert proxy.gate.active == 1
        clock.advance(9.9)
        await asyncio.sleep(0)
        assert proxy.gate.active == 1  # not before the deadline
        with caplog.at_level(logging.INFO):
            clock.advance(0.1)
            code, _, body = await read_response(reader)
            await wait_until(lambda: proxy.gate.active == 0)
        writer.close()
        assert code == 504
        error = json.loads(body)["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_timeout"
        assert "within 10 s (TimeoutError)" in error["message"]
        assert healthy(proxy) == {"gpu0": True, "gpu1": True}
        assert gpu0.upgrades == 1 and gpu1.upgrades == 0  # one deadline, no failover
        assert errors(proxy, "gpu0", "timeout") == 1
        assert errors(proxy, "gpu0", "connect") == 0
        await bounded(gpu0.closed_by_proxy.wait())  # the upstream connection was dropped
        warnings = [r.getMessage() for r in caplog.records if r.name == "headroom.relay.ws"]
        assert any("did not complete the WebSocket handshake within 10 s (TimeoutError)" in w
                   for w in warnings), warnings  # fmt: skip
        session = next(r for r in caplog.records if r.name == "headroom.session")
        assert session.getMessage().endswith("upstream_timeout")
        assert "TimeoutError" in session.fields["error"]  # type: ignore[attr-defined]


async def test_timeout_on_a_close_mode_route_closes_with_1014(start_proxy: Any) -> None:
    clock = FakeClock()
    async with upstreams(None) as (gpu0,):
        proxy: Proxy = await start_proxy(settings_for(gpu0.url, refusal="close"), clock)
        opening = asyncio.ensure_future(
            connect(proxy.ws_url + "/ws", compression=None, open_timeout=None)
        )
        await bounded(gpu0.upgrade_seen.wait())
        clock.advance(10)
        async with await bounded(opening) as ws:
            event = json.loads(await bounded(ws.recv()))
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1014
        assert "TimeoutError" in json.dumps(event)
        await wait_until(lambda: proxy.gate.active == 0)
        assert healthy(proxy) == {"gpu0": True}


async def test_client_leaving_during_the_connect_frees_the_slot_at_once(
    start_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    async with upstreams(None, None) as (gpu0, gpu1):
        proxy: Proxy = await start_proxy(settings_for(gpu0.url, gpu1.url), clock)
        with caplog.at_level(logging.INFO):
            _, writer = await send_upgrade(proxy.server.port)
            await bounded(gpu0.upgrade_seen.wait())
            writer.close()  # the client gives up; the clock never moves
            await wait_until(lambda: proxy.gate.active == 0)
            await bounded(gpu0.closed_by_proxy.wait())  # the upstream attempt was abandoned too
        assert healthy(proxy) == {"gpu0": True, "gpu1": True}
        assert gpu1.upgrades == 0
        assert errors(proxy, "gpu0", "timeout") == errors(proxy, "gpu0", "connect") == 0
        session = next(r for r in caplog.records if r.name == "headroom.session")
        assert session.fields["error"] == "client went away during the upstream connect"  # type: ignore[attr-defined]


async def test_eight_stuck_handshakes_hold_no_slot_after_their_clients_leave(
    start_proxy: Any,
) -> None:
    """The reproduction: eight oversized upgrades whose clients give up filled 7 of 8
    slots for good. Now each slot comes back as its client leaves."""
    clock = FakeClock()
    async with upstreams(None, None) as (gpu0, gpu1):
        settings = proxy_settings(
            [("gpu0", gpu0.url, 4), ("gpu1", gpu1.url, 4)],
            [{"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}],
        )
        proxy: Proxy = await start_proxy(settings, clock)
        clients = [await send_upgrade(proxy.server.port) for _ in range(8)]
        await wait_until(lambda: gpu0.upgrades + gpu1.upgrades == 8)
        assert proxy.gate.active == 8
        for _, writer in clients:
            writer.close()
        await wait_until(lambda: proxy.gate.active == 0)
        assert healthy(proxy) == {"gpu0": True, "gpu1": True}
        assert gpu0.upgrades == gpu1.upgrades == 4  # nobody failed over


async def test_a_4xx_answer_is_the_requests_problem_not_the_replicas(start_proxy: Any) -> None:
    async with upstreams(status(400), status(400)) as (gpu0, gpu1):
        proxy: Proxy = await start_proxy(settings_for(gpu0.url, gpu1.url), FakeClock())
        reader, writer = await send_upgrade(proxy.server.port)
        code, _, body = await read_response(reader)
        writer.close()
        assert code == 502
        assert "answered the handshake with HTTP 400" in json.loads(body)["error"]["message"]
        assert gpu0.upgrades == 1 and gpu1.upgrades == 0  # not retried elsewhere
        assert healthy(proxy) == {"gpu0": True, "gpu1": True}
        await wait_until(lambda: proxy.gate.active == 0)


async def test_a_5xx_answer_fails_over_without_ejecting(start_proxy: Any) -> None:
    engine = FakeEngine()
    async with upstreams(status(503)) as (gpu0,), running_server(engine) as live:
        live_server: RunningServer = live
        settings = settings_for(gpu0.url, live_server.http_url, path="/ws/echo")
        proxy: Proxy = await start_proxy(settings, FakeClock())
        async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
            await hello(ws)
            assert proxy.gate.statistics()["main"].replicas[1].active == 1
        assert gpu0.upgrades == 1
        assert healthy(proxy) == {"gpu0": True, "gpu1": True}
        assert errors(proxy, "gpu0", "handshake") == 1
        await wait_until(lambda: proxy.gate.active == 0)


async def test_failover_tries_each_replica_once(start_proxy: Any) -> None:
    async with upstreams(status(500), status(502), status(503)) as replicas:
        proxy: Proxy = await start_proxy(settings_for(*(u.url for u in replicas)), FakeClock())
        reader, writer = await send_upgrade(proxy.server.port)
        code, _, body = await read_response(reader)
        writer.close()
        assert code == 502
        assert "answered the handshake with HTTP 50" in json.loads(body)["error"]["message"]
        assert [u.upgrades for u in replicas] == [1, 1, 1]
        assert all(healthy(proxy).values())
        await wait_until(lambda: proxy.gate.active == 0)


async def test_drain_ends_a_session_stuck_in_its_upstream_connect(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Drain reached only relaying sessions: a stuck connect held it for the full
    deadline plus 5 s and was then cancelled by uvicorn with a traceback."""
    async with upstreams(None) as (gpu0,):
        settings = settings_for(gpu0.url)
        gateway = Gateway(settings, Runtime(settings, clock=FakeClock()))
        serving = asyncio.ensure_future(gateway.serve(install_signals=False))
        with caplog.at_level(logging.INFO):
            try:
                await bounded(gateway.server.ready.wait())
                await bounded(gateway.runtime.replicas_checked.wait())
                reader, writer = await send_upgrade(gateway.port)
                await bounded(gpu0.upgrade_seen.wait())
                await asyncio.wait_for(gateway.drain(timeout_s=0), 10)
                code, headers, _ = await read_response(reader)
                writer.close()
                assert code == 503 and headers["x-headroom-reason"] == "draining"
                assert gateway.runtime.gate.active == 0
                await bounded(gpu0.closed_by_proxy.wait())
            finally:
                gateway.stop()
                await asyncio.wait_for(serving, 15)
        assert "closed 1 sessions with 1012" in caplog.text
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
