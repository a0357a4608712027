"""The control plane is bounded before it reads, over real sockets (issue 26, item 2).

Gang reservations, the admin listener and the rest of the client listener are attacked
the way the relay routes are in test_http_hardening.py and test_hostile_clients.py: the
key is checked from the head before a byte of body is read (401 while the body is still
unsent), a body over ``limits.max_control_body_bytes`` gets 413 without being read,
one that drips gets 408 at ``limits.handshake_timeout_s`` on the injected clock, JSON
nested past what the parser takes is a 400, and a client that leaves mid-body leaves no
ERROR record behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.process.admin import create_admin_app
from proxy.process.serving import running_server
from proxy.relay.listener import client_listener
from proxy.relay.ws_server import WebSocketSessions
from proxy.runtime import Runtime
from proxy.settings import Settings
from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import RawUpstream, raw_upstream
from tests.integration.test_ws_relay import wait_until

RESERVE = "/v1/headroom/reservations"
ADMIN_KEY = "admin-secret"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def settings(upstream: RawUpstream, **top: Any) -> Settings:
    return proxy_settings(
        [("gpu0", upstream.url, 2)],
        [{"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"}],
        auth={"keys": [{"name": "team-a", "sha256": sha("key-a")}]},
        guard={"mode": "off"},
        limits={"handshake_timeout_s": 10},
        **top,
    )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """Every record at ERROR or above, from any logger, while the block runs."""
    root = logging.getLogger()
    handler = _Records()
    handler.setLevel(logging.ERROR)
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)


async def response_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {n.strip().lower(): v.strip() for n, _, v in
               (line.partition(":") for line in lines[1:] if line)}  # fmt: skip
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
    return status, headers, body


def head(method: str, path: str, length: int, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: x", f"content-length: {length}",
             "content-type: application/json", *extra]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()


# -- the key before the body ---------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("POST", RESERVE), ("DELETE", f"{RESERVE}/t0ken")])
async def test_a_reservation_call_without_a_key_is_refused_before_its_body(
    start_proxy: Any, method: str, path: str
) -> None:
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        async with connection(proxy.server.port) as (reader, writer):
            # 300 MB promised, not one byte sent: the answer comes from the head alone
            writer.write(head(method, path, 300_000_000))
            status, headers, body = await response_of(reader)
        assert status == 401 and headers["www-authenticate"] == 'Bearer realm="headroom"'
        assert json.loads(body)["error"]["code"] == "unauthorized"
        assert proxy.gate.active == 0


# -- size ------------------------------------------------------------------------------------


async def test_an_oversize_reservation_body_gets_413_without_being_read(start_proxy: Any) -> None:
    """``[`` x 300 MB: answered once ``max_control_body_bytes`` are in, never parsed."""
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        with errors_logged() as errors:
            async with connection(proxy.server.port) as (reader, writer):
                writer.write(head("POST", RESERVE, 300_000_000, "authorization: Bearer key-a"))
                answer = asyncio.ensure_future(response_of(reader))
                sent = 0
                while not answer.done() and sent < 300_000_000:
                    writer.write(b"[" * 65536)
                    sent += 65536
                    await writer.drain()
                    await asyncio.sleep(0)  # the answer is read as soon as it comes
                status, headers, body = await answer
        assert status == 413 and "connection" not in headers
        assert json.loads(body)["error"]["code"] == "message_too_large"
        assert sent < 64 * 1024 * 1024  # answered long before the body was all sent
        assert not errors and proxy.gate.active == 0


async def test_json_nested_too_deep_is_a_400_not_a_traceback(start_proxy: Any) -> None:
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        limit = proxy.runtime.settings.limits.max_control_body_bytes
        with errors_logged() as errors:
            for body in (b"[" * limit, b"[" * 5000 + b"]" * 5000, b'{"pools": [' * 1200):
                async with connection(proxy.server.port) as (reader, writer):
                    writer.write(head("POST", RESERVE, len(body), "authorization: Bearer key-a")
                                 + body)  # fmt: skip
                    status, _, answer = await response_of(reader)
                assert status == 400, answer
                assert json.loads(answer)["error"]["code"] == "invalid_reservation"
        assert not errors and proxy.gate.active == 0


async def test_every_other_endpoint_bounds_its_body_too(start_proxy: Any) -> None:
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        for path in ("/healthz", "/readyz", "/metrics", "/nowhere"):
            async with connection(proxy.server.port) as (reader, writer):
                writer.write(head("POST", path, 300_000_000) + b"x" * (64 * 1024))
                status, _, body = await response_of(reader)
            assert status == 413, (path, body)


# -- time ------------------------------------------------------------------------------------


async def drip_until_answered(
    clock: FakeClock, port: int, request_head: bytes, timeout_s: float
) -> tuple[int, dict[str, str], bytes]:
    """Send ``request_head`` and one byte of body, then a byte every 4 s of the injected
    clock; the answer must come once the body has taken ``timeout_s``."""
    async with connection(port) as (reader, writer):
        armed = clock.pending_timers
        writer.write(request_head + b"{")
        await wait_until(lambda: clock.pending_timers > armed)  # the body deadline
        answer = asyncio.ensure_future(response_of(reader))
        waited = 0.0
        while waited < timeout_s:
            assert not answer.done(), "answered before the body deadline"
            clock.advance(4)
            waited += 4
            if waited < timeout_s:
                writer.write(b" ")
                await writer.drain()
        return await answer


async def test_a_dripping_reservation_body_gets_408(start_proxy: Any) -> None:
    clock = FakeClock()
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream), clock)
        await asyncio.sleep(0)
        with errors_logged() as errors:
            status, _, body = await drip_until_answered(
                clock, proxy.server.port,
                head("POST", RESERVE, 1000, "authorization: Bearer key-a"), 10,
            )  # fmt: skip
        assert status == 408
        assert json.loads(body)["error"]["code"] == "timeout"
        assert not errors and proxy.gate.active == 0


async def test_a_client_leaving_mid_body_logs_no_error(start_proxy: Any) -> None:
    async with raw_upstream() as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        with errors_logged() as errors:
            for _ in range(3):
                async with connection(proxy.server.port) as (_, writer):
                    writer.write(head("POST", RESERVE, 1000, "authorization: Bearer key-a")
                                 + b'{"pools": ')  # fmt: skip
                    await writer.drain()
            # a whole request on a new connection is still served: the gateway is fine
            body = json.dumps({"pools": ["main"], "hold_s": 5}).encode()
            async with connection(proxy.server.port) as (reader, writer):
                writer.write(head("POST", RESERVE, len(body), "authorization: Bearer key-a")
                             + body)  # fmt: skip
                status, _, answer = await response_of(reader)
            assert status == 201
            token = json.loads(answer)["token"]
            async with connection(proxy.server.port) as (reader, writer):
                writer.write(head("DELETE", f"{RESERVE}/{token}", 0, "authorization: Bearer key-a"))
                assert (await response_of(reader))[0] == 200
        assert not errors
        await wait_until(lambda: proxy.gate.active == 0)


# -- the admin listener -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def admin_listener(
    upstream: RawUpstream, clock: FakeClock | None = None
) -> AsyncIterator[tuple[int, list[str]]]:
    """The admin app with a key, on its own socket; yields (port, calls made)."""
    admin = {"enabled": True, "api_key_sha256": sha(ADMIN_KEY)}
    runtime = Runtime(settings(upstream, admin=admin), clock=clock)
    calls: list[str] = []

    def reload(*_: Any) -> Any:
        raise AssertionError("nothing here may reach the reload")

    def drain() -> None:
        calls.append("drain")

    app = create_admin_app(runtime, reload, drain)
    limits = client_listener(app, lambda: runtime.settings.limits, WebSocketSessions())
    async with running_server(app, lifespan="off", http=limits) as server:
        yield server.port, calls


@pytest.mark.parametrize("path", ["/admin/reload", "/admin/drain", "/admin/status"])
async def test_the_admin_listener_checks_the_key_before_the_body(path: str) -> None:
    async with raw_upstream() as upstream, admin_listener(upstream) as (port, calls):
        async with connection(port) as (reader, writer):
            writer.write(head("POST", path, 300_000_000))
            status, headers, _ = await response_of(reader)
        assert status == 401 and headers["www-authenticate"] == 'Bearer realm="headroom-admin"'
        async with connection(port) as (reader, writer):
            writer.write(head("POST", path, 300_000_000, f"authorization: Bearer {ADMIN_KEY}")
                         + b"[" * (64 * 1024))  # fmt: skip
            status, _, body = await response_of(reader)
        assert status == 413 and json.loads(body)["error"]["code"] == "message_too_large"
        assert calls == []  # neither reloaded nor drained


async def test_a_dripping_admin_body_gets_408() -> None:
    clock = FakeClock()
    async with raw_upstream() as upstream, admin_listener(upstream, clock) as (port, calls):
        with errors_logged() as errors:
            status, _, body = await drip_until_answered(
                clock, port,
                head("POST", "/admin/reload", 1000, f"authorization: Bearer {ADMIN_KEY}"), 10,
            )  # fmt: skip
        assert status == 408 and json.loads(body)["error"]["code"] == "timeout"
        assert calls == [] and not errors
        # a whole request is served as before
        async with connection(port) as (reader, writer):
            writer.write(head("POST", "/admin/drain", 0, f"authorization: Bearer {ADMIN_KEY}"))
            status, _, body = await response_of(reader)
        assert status == 202 and json.loads(body)["draining"] is True and calls == ["drain"]
