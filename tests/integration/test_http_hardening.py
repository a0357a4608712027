"""HTTP relay hardening (issue 14), over real sockets with a raw upstream.

A stream that fails midway is aborted, never delivered as complete; HTTP sessions
honour the write, session-length and (reloaded) idle limits and drain; the upstream
gets the client's headers only; X-Forwarded-For carries the peer exactly once; a
completed session is not logged as the client leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from proxy.clock import FakeClock
from proxy.settings import Settings
from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import RawUpstream, raw_upstream
from tests.integration.test_ws_relay import wait_until

# (protocol, request body, response content type, the two chunks the upstream sends)
WAV_HEADER = (
    b"RIFF\xff\xff\xff\xffWAVEfmt \x10\x00\x00\x00\x01\x00\x01\x00\xc0\x5d\x00\x00"
    b"\x80\xbb\x00\x00\x02\x00\x10\x00data\xff\xff\xff\xff"
)
PROTOCOLS = {
    "speech-sse": ("openai-speech-http", {"input": "hi", "stream_format": "sse"},
                   "text/event-stream",
                   [b'data: {"type": "speech.audio.delta", "audio": "AAAA"}\n\n'] * 2),
    "speech-pcm": ("openai-speech-http", {"input": "hi", "response_format": "pcm"},
                   "audio/pcm", [b"\x01\x00" * 2400] * 2),
    "speech-wav": ("openai-speech-http", {"input": "hi", "response_format": "wav"},
                   "audio/wav", [WAV_HEADER + b"\x01\x00" * 100, b"\x01\x00" * 2400]),
    "transcription-sse": ("openai-transcription-sse", {"stream": True}, "text/event-stream",
                          [b'data: {"type": "transcript.text.delta", "delta": "hi"}\n\n'] * 2),
    "passthrough": ("passthrough-http", {}, "application/octet-stream", [b"x" * 1000] * 2),
}  # fmt: skip


def route(protocol: str = "passthrough-http") -> dict[str, Any]:
    return {"path": "/v1/stream", "pool": "main", "protocol": protocol}


def settings(upstream: RawUpstream, protocol: str = "passthrough-http", **top: Any) -> Settings:
    return proxy_settings([("gpu0", upstream.url, 2)], [route(protocol)], **top)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def captured(name: str) -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger(name)
    handler = _Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def session_fields(records: list[logging.LogRecord]) -> dict[str, Any]:
    (record,) = [r for r in records if getattr(r, "fields", None)]
    fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    return fields


async def read_truncated(proxy: Proxy, body: dict[str, Any], received: list[bytes],
                         after_first: Any = None) -> None:  # fmt: skip
    """Stream the response into ``received``; it must end in an incomplete read."""

    async def stream() -> None:
        nonlocal after_first
        async with (
            httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client,
            client.stream("POST", "/v1/stream", json=body) as response,
        ):
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                received.append(chunk)
                if after_first is not None and sum(map(len, received)) >= after_first[0]:
                    after_first[1]()
                    after_first = None

    with pytest.raises(httpx.RemoteProtocolError, match=r"incomplete|complete message"):
        await stream()


# -- item 2: a stream that fails midway is aborted --------------------------------------


@pytest.mark.parametrize("mode", ["reset", "fin", "short", "stall"])
@pytest.mark.parametrize("kind", list(PROTOCOLS))
async def test_a_stream_that_fails_midway_reaches_the_client_truncated(
    start_proxy: Any, kind: str, mode: str
) -> None:
    protocol, body, content_type, chunks = PROTOCOLS[kind]
    clock = FakeClock()
    async with raw_upstream(mode=mode, content_type=content_type, chunks=chunks) as upstream:
        proxy: Proxy = await start_proxy(
            settings(upstream, protocol, limits={"idle_timeout_s": 30}), clock
        )
        received: list[bytes] = []
        # a stalled upstream is given up on once it has been idle for idle_timeout_s
        stall = (sum(map(len, chunks)), lambda: clock.advance(31)) if mode == "stall" else None
        with captured("headroom.session") as log, captured("uvicorn.error") as errors:
            await read_truncated(proxy, body, received, stall)
            await wait_until(lambda: proxy.gate.active == 0 and bool(log))
        assert b"".join(received) == b"".join(chunks)  # everything relayed, nothing added
        fields = session_fields(log)
        assert "mid-stream" in fields["error"] and fields["client_close"] is None
        assert proxy.metric("headroom_upstream_errors_total", pool="main", replica="gpu0",
                            kind="midstream") == 1  # fmt: skip
        # the abort is normal operation: no ERROR (traceback) from uvicorn
        assert not [r.getMessage() for r in errors if r.levelno >= logging.ERROR]


async def test_the_truncated_response_has_no_terminating_chunk(start_proxy: Any) -> None:
    """What curl sees (exit 18): the chunks, then the connection closed, no ``0\\r\\n\\r\\n``."""
    async with raw_upstream(mode="fin", chunks=[b"one", b"two"]) as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.server.port)
        writer.write(b"POST /v1/stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 30)  # to EOF: the proxy closed it
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert body == b"3\r\none\r\n3\r\ntwo\r\n"
    await wait_until(lambda: proxy.gate.active == 0)


# -- item 5: write, session-length and idle limits; drain --------------------------------


async def test_a_client_that_stops_reading_loses_its_slot(start_proxy: Any) -> None:
    clock = FakeClock()
    async with raw_upstream(mode="flood") as upstream:
        proxy: Proxy = await start_proxy(
            settings(upstream, limits={"idle_timeout_s": 0, "max_session_s": 0,
                                       "client_write_timeout_s": 5}),
            clock,
        )  # fmt: skip
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", proxy.server.port))
        await loop.sock_sendall(
            sock, b"POST /v1/stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
        )
        with captured("headroom.session") as log:
            await wait_until(lambda: proxy.gate.active == 1)
            # Never read. Each step moves the clock one write timeout; once a send to
            # this client has been blocked that long, the session ends.
            for _ in range(2000):
                if proxy.gate.active == 0:
                    break
                clock.advance(5)
                await asyncio.sleep(0.01)
            assert proxy.gate.active == 0
            await wait_until(lambda: bool(log))
        fields = session_fields(log)
        assert fields["error"] == "client stopped reading" and fields["client_close"] is None
        await wait_until(lambda: upstream.closed == 1)
        # the connection was reset: reading what is left ends in a reset or EOF
        tail = b""
        with contextlib.suppress(ConnectionResetError):  # a reset, or EOF: both are fine
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 30):
                tail += chunk
        assert not tail.endswith(b"0\r\n\r\n")  # never the end of the body
        sock.close()


async def test_max_session_ends_an_http_stream_truncated(start_proxy: Any) -> None:
    clock = FakeClock()
    async with raw_upstream(mode="stall") as upstream:
        proxy: Proxy = await start_proxy(
            settings(upstream, limits={"idle_timeout_s": 0, "max_session_s": 100}), clock
        )
        received: list[bytes] = []

        def almost_then_past() -> None:
            clock.advance(99)
            assert proxy.gate.active == 1  # not yet
            clock.advance(2)

        with captured("headroom.session") as log:
            await read_truncated(proxy, {}, received, (9600, almost_then_past))
            await wait_until(lambda: proxy.gate.active == 0 and bool(log))
            await wait_until(lambda: upstream.closed == 1)  # the upstream request closed
        assert session_fields(log)["error"] == "maximum session duration reached"


async def test_a_reloaded_idle_timeout_reaches_http_sessions(start_proxy: Any) -> None:
    clock = FakeClock()
    async with raw_upstream(mode="stall") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream, limits={"idle_timeout_s": 300}), clock)
        proxy.runtime.apply(settings(upstream, limits={"idle_timeout_s": 5}))
        received: list[bytes] = []
        await read_truncated(proxy, {}, received, (9600, lambda: clock.advance(6)))
        await wait_until(lambda: proxy.gate.active == 0)
        # before the response: the same reloaded limit gives 504
        upstream.mode = "never"
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            pending = asyncio.ensure_future(client.post("/v1/stream", content=b"{}"))
            await wait_until(lambda: len(upstream.requests) == 2)
            clock.advance(6)
            response = await pending
        assert response.status_code == 504
        assert "no response" in response.json()["error"]["message"]
        await wait_until(lambda: proxy.gate.active == 0)


async def test_drain_deadline_ends_http_sessions(start_proxy: Any) -> None:
    async with raw_upstream(mode="stall") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        received: list[bytes] = []

        def drain_deadline() -> None:
            assert proxy.runtime.close_sessions(1012, "server restarting") == 1

        await read_truncated(proxy, {}, received, (9600, drain_deadline))
        await wait_until(lambda: proxy.gate.active == 0)
        upstream.mode = "never"  # and before the response: 503
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            pending = asyncio.ensure_future(client.post("/v1/stream", content=b"{}"))
            await wait_until(lambda: len(upstream.requests) == 2)
            assert proxy.runtime.close_sessions(1012, "server restarting") == 1
            response = await pending
        assert response.status_code == 503
        assert response.headers["x-headroom-reason"] == "draining"
        await wait_until(lambda: proxy.gate.active == 0)


# -- item 9: a completed session is not the client leaving --------------------------------


async def test_completed_session_is_not_logged_as_client_gone(start_proxy: Any) -> None:
    async with raw_upstream(mode="chunks") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        with captured("headroom.session") as log:
            async with httpx.AsyncClient(base_url=proxy.http_url) as client:
                response = await client.post("/v1/stream", content=b"{}")
                assert response.status_code == 200 and len(response.content) == 9600
            await wait_until(lambda: bool(log))
        fields = session_fields(log)
        assert fields["client_close"] is None and "error" not in fields


async def test_client_leaving_mid_stream_is_logged_1006(start_proxy: Any) -> None:
    async with raw_upstream(mode="stall") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        with captured("headroom.session") as log:
            async with (
                httpx.AsyncClient(base_url=proxy.http_url) as client,
                client.stream("POST", "/v1/stream", content=b"{}") as response,
            ):
                await anext(response.aiter_raw())
            await wait_until(lambda: bool(log) and proxy.gate.active == 0)
        assert session_fields(log)["client_close"] == 1006


# -- item 6: the client's headers only ------------------------------------------------------


async def raw_request(port: int, head: bytes) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    response_head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in response_head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    body = await reader.readexactly(length)
    writer.close()
    result: dict[str, Any] = json.loads(body)
    return result


async def test_only_the_clients_headers_reach_the_upstream(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))
        head = (b"POST /v1/stream HTTP/1.1\r\nhost: gateway\r\nx-thing: t\r\n"
                b"content-length: 2\r\n\r\n{}")  # fmt: skip
        first = await raw_request(proxy.server.port, head)
        names = sorted(name for name, _ in first["headers"])
        assert names == ["content-length", "host", "x-forwarded-for", "x-forwarded-proto",
                         "x-thing"]  # fmt: skip
        # the upstream's Set-Cookie went to that client only, never into later requests
        second = await raw_request(proxy.server.port, head)
        assert "cookie" not in dict(second["headers"])
        # what the client does send is relayed as sent
        asked = await raw_request(
            proxy.server.port,
            head.replace(
                b"x-thing: t", b"accept: audio/pcm\r\naccept-encoding: identity\r\nuser-agent: me"
            ),
        )
        got = dict(asked["headers"])
        assert (got["accept"], got["accept-encoding"], got["user-agent"]) == (
            "audio/pcm", "identity", "me")  # fmt: skip


async def test_an_encoded_response_is_relayed_as_is_and_not_metered(start_proxy: Any) -> None:
    """The client asked for gzip and the upstream compressed the PCM: those bytes go to
    the client unchanged, but they are not audio and are not counted as such."""
    pcm = b"\x01\x00" * 24000  # one second at 24 kHz, 16-bit mono
    packed = gzip.compress(pcm)
    async with raw_upstream(mode="chunks", content_type="audio/pcm", chunks=[packed],
                            extra_headers=b"content-encoding: gzip\r\n") as upstream:  # fmt: skip
        proxy: Proxy = await start_proxy(settings(upstream, "openai-speech-http"))
        with captured("headroom.session") as log:
            async with httpx.AsyncClient(base_url=proxy.http_url) as client:
                request = {"input": "hi", "response_format": "pcm"}
                response = await client.post("/v1/stream", json=request,
                                             headers={"accept-encoding": "gzip"})  # fmt: skip
            await wait_until(lambda: bool(log))
        assert response.headers["content-encoding"] == "gzip" and response.content == pcm
        assert upstream.requests[0] and dict(upstream.requests[0])["accept-encoding"] == "gzip"
        fields = session_fields(log)
        assert "error" not in fields and not fields["audio_s"] and not fields["chunks"]
        # the same audio unencoded is metered: the test above measures the right thing
        upstream.extra_headers, upstream.chunks = b"", [pcm]
        with captured("headroom.session") as log:
            async with httpx.AsyncClient(base_url=proxy.http_url) as client:
                response = await client.post("/v1/stream", json=request)
            await wait_until(lambda: bool(log))
        assert response.content == pcm and session_fields(log)["audio_s"] == 1.0


# -- item 13: X-Forwarded-For carries the peer exactly once ----------------------------------


async def test_forwarded_headers_from_an_untrusted_peer(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(settings(upstream))  # default: nobody trusted
        got = dict((await raw_request(proxy.server.port, (
            b"POST /v1/stream HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 6.6.6.6\r\n"
            b"x-forwarded-for: 7.7.7.7\r\nx-forwarded-proto: https\r\ncontent-length: 0\r\n\r\n"
        )))["headers"])  # fmt: skip
    assert got["x-forwarded-for"] == "6.6.6.6, 7.7.7.7, 127.0.0.1"  # kept, peer appended
    assert got["x-forwarded-proto"] == "http"  # an untrusted peer cannot choose it


async def test_forwarded_headers_from_a_trusted_proxy(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as upstream:
        proxy: Proxy = await start_proxy(
            settings(upstream, forwarded={"trusted_proxies": ["127.0.0.0/8"]})
        )
        got = dict((await raw_request(proxy.server.port, (
            b"POST /v1/stream HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 6.6.6.6\r\n"
            b"x-forwarded-proto: https\r\ncontent-length: 0\r\n\r\n"
        )))["headers"])  # fmt: skip
    assert got["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"  # the peer, once
    assert got["x-forwarded-proto"] == "https"  # the TLS-terminating proxy's word
