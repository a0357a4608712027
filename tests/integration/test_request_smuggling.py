"""Request heads that two HTTP parsers could read two ways never get past the listener
(proxy.relay.listener): Content-Length with Transfer-Encoding, a header folded onto a
continuation line (obs-fold) and bare LF line ends get 400 and the connection closed,
on the client listener and the admin listener alike, and neither the upstream nor the
admin app sees the request or the one smuggled behind it. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.wsraw import read_head, read_http_body
from proxy.process.gateway import Gateway
from proxy.process.serving import RunningServer, running_server
from proxy.settings import load_settings
from tests.integration.test_head_limits import CountingUpstream, send_and_read_head

#: Malformed request heads (``{t}``: the request target), each followed on the wire by a
#: well-formed request that a lenient parser would read as the next one.
MALFORMED = {
    "content-length-then-transfer-encoding": b"POST {t} HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "transfer-encoding-then-content-length": b"POST {t} HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n0\r\n\r\n",
    "transfer-encoding-folded": b"POST {t} HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
    "other-header-folded": b"GET {t} HTTP/1.1\r\nHost: x\r\nX-Note: a\r\n\tb\r\n\r\n",
    "bare-lf-head": b"GET {t} HTTP/1.1\nHost: x\n\n",
    "bare-lf-one-header-line": b"GET {t} HTTP/1.1\r\nHost: x\nX-Note: a\r\n\r\n",
    "bare-lf-chunk-size": b"POST {t} HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n",
}


def request(template: bytes, target: str) -> bytes:
    return template.replace(b"{t}", target.encode())


#: Per listener: the target of the malformed request, and the request smuggled behind
#: it (on the admin listener, a drain: the gateway's ``draining`` tells it arrived).
LISTENERS = {
    "client": ("/http", b"GET /http HTTP/1.1\r\nHost: x\r\n\r\n"),
    "admin": (
        "/admin/drain",
        b"POST /admin/drain HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    ),
}


@pytest.fixture
async def counting() -> AsyncIterator[tuple[RunningServer, CountingUpstream]]:
    app = CountingUpstream()
    async with running_server(app) as server:
        yield server, app


@pytest.fixture
async def gateway(counting: Any, tmp_path: Path) -> AsyncIterator[Gateway]:
    server, _ = counting
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "pools": [{"name": "main", "replicas": [{"name": "gpu0", "url": server.http_url,
                                                 "max_sessions": 2}]}],
        "routes": [{"path": "/http", "pool": "main", "protocol": "passthrough-http"}],
    }  # fmt: skip
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = Gateway(load_settings(path, env={}), config_path=str(path), env={})
    task = asyncio.ensure_future(gateway.serve(install_signals=False))
    ready = asyncio.ensure_future(gateway.server.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    assert gateway.server.started and gateway.admin_port is not None
    try:
        yield gateway
    finally:
        ready.cancel()
        gateway.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)


def port_of(gateway: Gateway, listener: str) -> int:
    port = gateway.port if listener == "client" else gateway.admin_port
    assert port is not None
    return port


@pytest.mark.parametrize("listener", list(LISTENERS))
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_first_request_gets_400_and_the_connection_closes(
    gateway: Gateway, counting: Any, listener: str, case: str
) -> None:
    _, upstream = counting
    target, smuggled = LISTENERS[listener]
    status, data = await send_and_read_head(
        port_of(gateway, listener), request(MALFORMED[case], target) + smuggled
    )  # read until the server closes
    assert status == 400, data[:300]
    assert data.count(b"HTTP/1.1 ") == 1, data  # the smuggled request is not answered
    assert b"connection: close" in data.lower()
    assert upstream.http == 0
    assert not gateway.runtime.gate.draining


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes
) -> int | None:
    writer.write(raw)
    await writer.drain()
    head = await asyncio.wait_for(read_head(reader), 30)
    if head is None:
        return None
    await asyncio.wait_for(read_http_body(reader, head), 30)
    return head.status


@pytest.mark.parametrize("listener", list(LISTENERS))
@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_later_request_closes_the_connection(
    gateway: Gateway, counting: Any, listener: str, case: str
) -> None:
    """On a kept-alive connection, a malformed request after a served one closes the
    connection (a response may be under way on it: no answer is written into it); the
    first request alone was served."""
    _, upstream = counting
    target, smuggled = LISTENERS[listener]
    first = (
        b"GET /http HTTP/1.1\r\nHost: x\r\n\r\n"
        if listener == "client"
        else b"GET /admin/status HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gateway, listener))
    try:
        assert await _exchange(reader, writer, first) == 200
        writer.write(request(MALFORMED[case], target) + smuggled)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, nothing written
    finally:
        writer.close()
    assert upstream.http == (1 if listener == "client" else 0)
    assert not gateway.runtime.gate.draining
