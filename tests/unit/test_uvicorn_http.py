"""HeadLimitedProtocol (proxy.relay.uvicorn_http) against the installed uvicorn: the
internals it relies on are there, and its limits hold when driven byte by byte with an
injected timer (no real time passes: the test fires the deadline itself)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.relay import uvicorn_http
from proxy.relay.uvicorn_http import HeadLimitedProtocol, head_limited
from proxy.settings import LimitsSettings


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)

    def write(self, data: Any) -> None:
        assert not self.eof, "written after write_eof"
        self.out += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Timers:
    """A stand-in for the loop's ``call_later``: records what is scheduled; the test
    decides when it fires. Everything else is the running loop's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[tuple[float, asyncio.TimerHandle]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loop, name)

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Any:
        handle = asyncio.TimerHandle(self.loop.time() + delay, callback, args, self.loop)
        self.pending.append((delay, handle))
        return handle

    def armed(self) -> list[float]:
        return [d for d, h in self.pending if not h.cancelled()]

    def fire(self, delay: float) -> None:
        """Run every live timer scheduled with ``delay`` (as if that much time passed)."""
        for d, handle in list(self.pending):
            if d == delay and not handle.cancelled():
                self.pending.remove((d, handle))
                handle._run()


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _open(limits: LimitsSettings) -> tuple[HeadLimitedProtocol, Transport, Timers]:
    config = uvicorn.Config(app=_app, log_level="critical", lifespan="off")
    config.load()
    timers = Timers(asyncio.get_running_loop())
    cls = head_limited(lambda: limits)
    protocol = cls(config=config, server_state=ServerState(), app_state={}, _loop=timers)  # type: ignore[arg-type]
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, timers


def test_uvicorn_still_has_what_the_head_limits_use() -> None:
    """If this fails, the installed uvicorn changed the internals HeadLimitedProtocol
    overrides or reads: re-check proxy/relay/uvicorn_http.py against it."""
    uvicorn_http._check_uvicorn()
    for name in uvicorn_http._METHODS:
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    config = uvicorn.Config(app=_app, log_level="critical")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        stock = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={},
                                  _loop=loop)  # fmt: skip
    finally:
        loop.close()
    for name in uvicorn_http._ATTRIBUTES:
        assert hasattr(stock, name), name
    stock.on_message_begin()
    for name in uvicorn_http._REQUEST_ATTRIBUTES:
        assert hasattr(stock, name), name


def test_a_uvicorn_without_a_hook_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "send_400_response")
    with pytest.raises(ImportError, match="send_400_response"):
        uvicorn_http._check_uvicorn()


def test_an_attribute_uvicorn_no_longer_sets_fails_at_import_not_on_a_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attributes are checked against uvicorn's source at import (start-up): a renamed
    one (here a name uvicorn never set) fails there, naming it."""
    monkeypatch.setattr(uvicorn_http, "_ATTRIBUTES", (*uvicorn_http._ATTRIBUTES, "pipline"))
    with pytest.raises(ImportError, match="pipline"):
        uvicorn_http._check_uvicorn()


async def test_a_partial_head_gets_408_when_the_deadline_fires() -> None:
    protocol, transport, timers = _open(LimitsSettings(handshake_timeout_s=7))
    assert timers.armed() == [7]  # armed when the connection was accepted
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line yet
    assert not transport.out
    timers.fire(7)
    assert transport.out.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"connection: close\r\n" in transport.out and transport.eof
    assert timers.armed() == [uvicorn_http.LINGER_S]  # lingers, then closes
    protocol.data_received(b"more of the head")  # read and thrown away
    timers.fire(uvicorn_http.LINGER_S)
    assert transport.closed and transport.out.count(b"HTTP/1.1") == 1


async def test_silence_is_closed_without_an_answer() -> None:
    _, transport, timers = _open(LimitsSettings(handshake_timeout_s=7))
    timers.fire(7)
    assert transport.closed and not transport.out


async def test_a_complete_head_disarms_the_deadline_and_the_next_one_rearms_it() -> None:
    protocol, transport, timers = _open(LimitsSettings(handshake_timeout_s=7))
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert timers.armed() == []  # the request is being served: no head deadline
    for _ in range(100):  # let the app answer
        await asyncio.sleep(0)
        if transport.out:
            break
    assert transport.out.startswith(b"HTTP/1.1 204 ")
    assert 7 in timers.armed()  # waiting for the next head (beside uvicorn's keep-alive)
    protocol.data_received(b"GET / HTTP/1.1\r\n")
    timers.fire(7)
    assert b"HTTP/1.1 408 " in transport.out


@pytest.mark.parametrize("pieces", [1, 3, 50])
async def test_the_size_limit_holds_however_the_head_is_split(pieces: int) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n"
    for size, refused in [(len(head), False), (len(head) - 1, True)]:
        protocol, transport, _ = _open(LimitsSettings(max_head_bytes=1024))
        protocol._max_head_bytes = size  # the limit exactly at, or one below, the head
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            protocol.data_received(head[i : i + step])
        assert transport.out.startswith(b"HTTP/1.1 431 ") == refused, (size, pieces)


async def test_too_many_header_lines_get_431() -> None:
    protocol, transport, _ = _open(LimitsSettings(max_headers=3))
    protocol.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n")
    assert transport.out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"more than 3 header lines" in transport.out


async def test_should_upgrade_is_asked_of_each_requests_own_headers() -> None:
    """uvicorn asks _should_upgrade several times per request; the answer is kept for
    that request's header list only, so a keep-alive connection's next request (a new
    list) is asked afresh."""
    protocol, _, _ = _open(LimitsSettings())
    protocol.ws_protocol_class = object  # type: ignore[assignment]  # any WebSocket support
    protocol.headers = [(b"connection", b"Upgrade"), (b"upgrade", b"websocket")]
    assert protocol._should_upgrade() and protocol._should_upgrade()
    protocol.headers = [(b"connection", b"keep-alive")]
    assert not protocol._should_upgrade()
    protocol.headers = [(b"connection", b"keep-alive, Upgrade"), (b"upgrade", b"WebSocket")]
    assert protocol._should_upgrade()
