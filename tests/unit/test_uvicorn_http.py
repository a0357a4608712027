"""HeadLimitedProtocol (proxy.relay.uvicorn_http) against the installed uvicorn: the
internals it relies on are there, and its limits hold when driven byte by byte with an
injected timer (no real time passes: the test fires the deadline itself)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from typing import Any

import httptools
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

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol


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


# -- WebSocket upgrade heads: read by httptools, handed to the splice ---------------------

#: What real clients send (python-websockets 13+, Chrome, curl-style lower case).
_REAL_HEADS = [
    b"GET /v1/audio/speech/stream HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: permessage-deflate; "
    b"client_max_window_bits\r\nUser-Agent: Python/3.11 websockets/15.0.1\r\n\r\n",
    b"GET /chat?room=a%20b&x=1 HTTP/1.1\r\nHost: example.com\r\nConnection: Upgrade\r\n"
    b"Pragma: no-cache\r\nCache-Control: no-cache\r\nUser-Agent: Mozilla/5.0 (X11; Linux "
    b"x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36\r\n"
    b"Upgrade: websocket\r\nOrigin: https://example.com\r\nSec-WebSocket-Version: 13\r\n"
    b"Accept-Encoding: gzip, deflate, br, zstd\r\nAccept-Language: en-US,en;q=0.9\r\n"
    b"Sec-WebSocket-Key: x3JJHMbDL1EzLkh9GBhXDw==\r\nSec-WebSocket-Protocol: a, b\r\n\r\n",
    b"GET / HTTP/1.1\r\nhost: x\r\nupgrade: WebSocket\r\nconnection: keep-alive, upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n",
]


class _Parsed:
    """httptools' view of a head, as uvicorn's callbacks collect it."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.complete = True


def _httptools(head: bytes) -> tuple[_Parsed, httptools.HttpRequestParser, bool]:
    parsed = _Parsed()
    parser = httptools.HttpRequestParser(parsed)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    try:
        parser.feed_data(head)
    except httptools.HttpParserUpgrade:
        return parsed, parser, True
    return parsed, parser, False


class _Splice:
    """A stand-in for the splice's WebSocket protocol: records the hand-over."""

    taken: list[tuple[str, bytes, list[tuple[bytes, bytes]]]] = []

    def __init__(self, **_: Any) -> None: ...

    def upgrade_parsed(
        self, transport: Any, http: Any, method: str, target: bytes, headers: Any
    ) -> None:
        self.taken.append((method, target, headers))


@pytest.mark.parametrize("head", _REAL_HEADS)
async def test_an_upgrade_in_one_or_two_reads_is_handed_over_as_httptools_reads_it(
    head: bytes,
) -> None:
    """Real clients' upgrade heads, whole in one read or split over two: the splice gets
    the GET with the target and headers (names lower-cased) httptools reads, once."""
    parsed, parser, upgraded = _httptools(head)
    assert upgraded and parsed.complete and parser.get_method() == b"GET"
    for pieces in ([head], [head[:10], head[10:]]):
        _Splice.taken = []
        protocol, transport, timers = _open(LimitsSettings())
        protocol.ws_protocol_class = _Splice  # type: ignore[assignment]
        for piece in pieces:
            protocol.data_received(piece)
        assert isinstance(getattr(transport, "protocol", None), _Splice)
        assert timers.armed() == []  # the head deadline is disarmed
        assert protocol not in protocol.connections
        assert _Splice.taken == [("GET", parsed.url, parsed.headers)]


async def test_limits_hold_for_an_upgrade_in_one_read() -> None:
    head = _REAL_HEADS[1]
    protocol, transport, _ = _open(LimitsSettings(max_headers=4))
    protocol.ws_protocol_class = _Splice  # type: ignore[assignment]
    protocol.data_received(head)
    assert transport.out.startswith(b"HTTP/1.1 431 ") and b"more than 4 header" in transport.out
    protocol, transport, _ = _open(LimitsSettings())
    protocol.ws_protocol_class = _Splice  # type: ignore[assignment]
    protocol._max_head_bytes = len(head) - 1
    protocol.data_received(head)
    assert transport.out.startswith(b"HTTP/1.1 431 ")


@pytest.mark.parametrize("pieces", [1, 2])
async def test_the_http_protocol_is_freed_at_the_upgrade_without_the_garbage_collector(
    pieces: int,
) -> None:
    """Once the splice has the connection, nothing refers to the HTTP protocol: it goes
    with its last reference, not in a later collection (the parser's callbacks made it
    a cycle)."""
    head = _REAL_HEADS[0]
    protocol, transport, timers = _open(LimitsSettings())
    protocol.ws_protocol_class = _Splice  # type: ignore[assignment]
    gone = weakref.ref(protocol)
    gc.disable()
    try:
        for piece in [head] if pieces == 1 else [head[:10], head[10:]]:
            protocol.data_received(piece)
        assert isinstance(getattr(transport, "protocol", None), _Splice)
        timers.pending.clear()  # the cancelled head deadline (the loop drops it)
        del protocol
        assert gone() is None
    finally:
        gc.enable()


# -- connection_made ----------------------------------------------------------------------


def test_a_uvicorn_whose_connection_made_sets_more_fails_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HeadLimitedProtocol.connection_made is uvicorn's rewritten: a uvicorn whose own
    sets something more is refused at start-up, naming it."""

    def connection_made(self: Any, transport: Any) -> None:
        self.transport = transport
        self.stream_id = 0

    monkeypatch.setattr(HttpToolsProtocol, "connection_made", connection_made)
    with pytest.raises(ImportError, match="stream_id"):
        uvicorn_http._check_uvicorn()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_connection_made_finds_the_addresses_uvicorns_finds(host: str, loop_kind: str) -> None:
    """On a real connection, on either event loop: the same server, client and scheme
    as uvicorn's own connection_made, without asking for a socket object."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_addresses_match(host))
    finally:
        loop.close()


async def _addresses_match(host: str) -> None:
    config = uvicorn.Config(app=_app, log_level="critical", lifespan="off")
    config.load()
    loop = asyncio.get_running_loop()
    made: asyncio.Future[tuple[Any, Any]] = loop.create_future()
    asked: list[str] = []

    class Asked:
        """The transport, recording what is asked of it (uvloop's cannot be patched)."""

        def __init__(self, transport: asyncio.Transport) -> None:
            self.transport = transport

        def get_extra_info(self, name: str, default: Any = None) -> Any:
            asked.append(name)
            return self.transport.get_extra_info(name, default)

        def is_closing(self) -> bool:
            return self.transport.is_closing()

    class Watched(HeadLimitedProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            try:
                super().connection_made(Asked(transport))  # type: ignore[arg-type]
                stock = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
                stock.connection_made(transport)
                made.set_result((self, stock))
            except BaseException as exc:  # the event loop would only log it
                made.set_exception(exc)
            self.transport = transport

    try:
        server = await loop.create_server(
            lambda: Watched(config=config, server_state=ServerState(), app_state={}), host, 0
        )
    except OSError:
        pytest.skip(f"no {host} here")  # no IPv6 on this machine
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection(host, port)
        ours, stock = await asyncio.wait_for(made, 30)
        assert (ours.server, ours.client, ours.scheme) == (stock.server, stock.client, stock.scheme)
        assert ours.server == (host, port) and ours.client is not None
        assert "socket" not in asked
        writer.close()
        ours.transport.close()
    finally:
        server.close()
