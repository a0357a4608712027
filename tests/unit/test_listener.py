"""The client listener (proxy.relay.listener) on a fake transport: every request head
is read under the size, count and time limits, WebSocket handshakes go to Headroom's
server, everything else to uvicorn's h11 protocol, whose later heads and trailers are
still bounded. Timers are recorded and fired by the test; no real time passes."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn

from proxy.process.serving import running_server
from proxy.relay.library_contract import connection_protocol
from proxy.relay.listener import LINGER_S, ClientListener, client_listener
from proxy.relay.ws_server import ClientWebSocket, WebSocketSessions
from proxy.settings import LimitsSettings

__all__ = ["Timers", "Transport", "open_listener", "settle"]


class Transport(asyncio.Transport):
    def __init__(self, ssl: bool = False) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.aborted = False
        self.eof = False
        self.reading = True
        self.ssl = ssl
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        info = {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}
        if self.ssl:
            info["sslcontext"] = object()  # type: ignore[assignment]
        return info.get(name, default)

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

    def abort(self) -> None:
        self.closed = self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def take(self) -> bytes:
        out = bytes(self.out)
        self.out.clear()
        return out


class Timers:
    """A stand-in for the loop's ``call_later``: records what is scheduled; the test
    decides when it fires. Everything else is the running loop's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: (delay, handle, callback, args) of every timer scheduled and not yet fired
        self.pending: list[tuple[float, asyncio.TimerHandle, Callable[..., Any], tuple[Any, ...]]]
        self.pending = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loop, name)

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Any:
        handle = asyncio.TimerHandle(self.loop.time() + delay, callback, args, self.loop)
        self.pending.append((delay, handle, callback, args))
        return handle

    def armed(self) -> list[float]:
        return [d for d, h, _, _ in self.pending if not h.cancelled()]

    def fire(self, delay: float) -> int:
        """Run every live timer scheduled with ``delay`` (as if that much time passed)."""
        fired = 0
        for timer in list(self.pending):
            d, handle, callback, args = timer
            if d == delay and not handle.cancelled():
                self.pending.remove(timer)
                callback(*args)
                fired += 1
        return fired


async def settle(done: Callable[[], bool]) -> None:
    """Let the loop run the app's task until ``done()`` (a bounded number of turns:
    ordering, not timing)."""
    for _ in range(200):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif scope["type"] == "websocket":
        await asyncio.Event().wait()  # the test cancels it


def open_listener(
    limits: LimitsSettings | Callable[[], LimitsSettings] | None = None,
    app: Any = _app,
    sessions: WebSocketSessions | None = None,
    root_path: str = "",
    transport: Transport | None = None,
) -> tuple[ClientListener, Transport, Timers]:
    """A listener as uvicorn builds one (the gateway's uvicorn options), on a fake
    transport, with the loop's timers recorded."""
    source = limits if callable(limits) else (lambda: limits or LimitsSettings())
    cls = client_listener(app, source, sessions or WebSocketSessions(), root_path)
    config = uvicorn.Config(app=app, log_level="critical", lifespan="off", http=cls, ws=cls)
    config.load()
    timers = Timers(asyncio.get_running_loop())
    listener = connection_protocol(cls, config, timers)  # type: ignore[arg-type]
    transport = transport or Transport()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncio, "get_event_loop", lambda: timers)
        listener.connection_made(transport)
    return listener, transport, timers


def _feed(listener: ClientListener, data: bytes, pieces: int = 1) -> None:
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        listener.data_received(data[i : i + step])


async def _served(transport: Transport, count: int = 1) -> None:
    await settle(lambda: transport.out.count(b"HTTP/1.1 204 ") >= count)


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


# -- the first head -------------------------------------------------------------------------


async def test_a_partial_head_gets_408_when_the_deadline_fires() -> None:
    listener, transport, timers = open_listener(LimitsSettings(handshake_timeout_s=7))
    assert timers.armed() == [7]  # armed when the connection was accepted
    listener.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n")  # no blank line yet
    assert not transport.out
    timers.fire(7)
    assert transport.out.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"connection: close\r\n" in transport.out and transport.eof
    assert not transport.closed
    assert timers.armed() == [LINGER_S]  # lingers, then closes
    listener.data_received(b"more of the head\r\n\r\n")  # read and thrown away
    timers.fire(LINGER_S)
    assert transport.closed and transport.out.count(b"HTTP/1.1") == 1


async def test_silence_is_closed_without_an_answer() -> None:
    _, transport, timers = open_listener(LimitsSettings(handshake_timeout_s=7))
    timers.fire(7)
    assert transport.closed and not transport.out


async def test_a_complete_head_disarms_the_deadline_and_a_late_next_head_is_closed() -> None:
    listener, transport, timers = open_listener(LimitsSettings(handshake_timeout_s=7))
    listener.data_received(GET)
    assert 7 not in timers.armed()  # the request is being served: no head deadline
    await _served(transport)
    listener.data_received(b"GET / HTTP/1.1\r\n")  # the next head starts...
    assert 7 in timers.armed()
    answered = bytes(transport.out)
    timers.fire(7)  # ...and is not complete in time: closed without a word
    assert transport.closed and bytes(transport.out) == answered


async def test_a_second_head_in_time_is_served() -> None:
    listener, transport, timers = open_listener(LimitsSettings(handshake_timeout_s=7))
    listener.data_received(GET)
    await _served(transport)
    listener.data_received(GET[:10])
    listener.data_received(GET[10:])
    assert 7 not in timers.armed()
    await _served(transport, 2)
    assert not transport.closed


_PADDED = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n"


@pytest.mark.parametrize("pieces", [1, 2, 3, 50, len(_PADDED)])
@pytest.mark.parametrize("over", [0, 1])
async def test_the_size_limit_holds_however_the_head_is_split(pieces: int, over: int) -> None:
    """The limit exactly at the head's length serves it; one byte below refuses it,
    however the reads cut the head (the blank line too)."""
    limits = LimitsSettings(max_head_bytes=len(_PADDED) - over)
    listener, transport, _ = open_listener(limits)
    _feed(listener, _PADDED, pieces)
    if over:
        assert transport.out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        assert transport.eof
    else:
        await _served(transport)


@pytest.mark.parametrize("split", [1, 2, 3])
async def test_a_body_after_a_blank_line_split_across_reads_is_not_counted(split: int) -> None:
    """The head ends where its blank line ends, also when the blank line spans two reads
    and the body follows in the second."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\nX-Pad: " + b"a" * 1000
    head += b"\r\n\r\n"
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=len(head)))
    listener.data_received(head[:-split])
    listener.data_received(head[-split:] + b"b" * 2000)
    await _served(transport)


async def test_a_head_never_ending_is_refused_at_the_limit_not_buffered() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=1024))
    listener.data_received(b"GET / HTTP/1.1\r\nX-Pad: ")
    for _ in range(10):
        listener.data_received(b"a" * 200)
    assert transport.out.startswith(b"HTTP/1.1 431 ")
    assert len(listener._buffer) <= 1024 + 200  # the limit and the read that crossed it


async def test_too_many_header_lines_get_431() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_headers=3))
    listener.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n")
    assert transport.out.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"more than 3 header lines" in transport.out


async def test_as_many_header_lines_as_allowed_are_served() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_headers=3))
    listener.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nHost: x\r\n\r\n")
    await _served(transport)


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", b"Invalid header token"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked"
         b"\r\n\r\n0\r\n\r\n", b"Transfer-Encoding can't be present with Content-Length"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", b"whitespace"),
        (b"GET / HTTP/1.1\nHost: x\n\n", b"CRLF"),
    ],
    ids=["bad-header", "length-and-chunked", "obs-fold", "bare-lf"],
)  # fmt: skip
async def test_a_malformed_head_is_answered_400_by_headroom_not_uvicorn(
    head: bytes, reason: bytes
) -> None:
    """uvicorn's h11 protocol would read some of these (Content-Length with
    Transfer-Encoding as chunked, a folded header unfolded, bare LF): it never sees them."""
    requests: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        requests.append(scope)
        await _app(scope, receive, send)

    listener, transport, timers = open_listener(app=app)
    listener.data_received(head + GET)
    assert transport.out.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"malformed request: " in transport.out and reason in transport.out
    assert b"connection: close\r\n" in transport.out and transport.eof
    assert timers.armed() == [LINGER_S]  # lingers, then closes
    listener.data_received(GET)  # read and thrown away
    timers.fire(LINGER_S)
    assert transport.closed and transport.out.count(b"HTTP/1.1") == 1
    assert listener._inner is None and requests == []


async def test_a_malformed_later_head_closes_without_an_answer() -> None:
    listener, transport, _ = open_listener()
    listener.data_received(GET)
    await _served(transport)
    answered = bytes(transport.out)
    listener.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           b"Content-Length: 0\r\n\r\n0\r\n\r\n" + GET)  # fmt: skip
    assert transport.closed and bytes(transport.out) == answered


async def test_malformed_chunked_framing_after_the_head_was_handed_on_closes() -> None:
    """A chunk size line ended by a bare LF, read after uvicorn's protocol got the head:
    the connection closes, and uvicorn's protocol never gets the bytes."""
    received: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            received.append(message.get("body", b""))
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    listener, transport, _ = open_listener(app=app)
    listener.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert listener._inner is not None
    listener.data_received(b"3\nabc\r\n0\r\n\r\n")
    assert transport.closed and not transport.out
    listener.connection_lost(None)  # what the closed transport tells next
    await settle(lambda: bool(received))
    assert b"abc" not in b"".join(received)


async def test_a_reload_applies_to_the_next_head() -> None:
    limits = [LimitsSettings(max_headers=5)]
    listener, transport, _ = open_listener(lambda: limits[0])
    listener.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nHost: x\r\n\r\n")
    await _served(transport)
    limits[0] = LimitsSettings(max_headers=2)
    answered = bytes(transport.out)
    listener.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nHost: x\r\n\r\n")
    assert transport.closed and bytes(transport.out) == answered


# -- later heads and trailers on a kept-alive connection ------------------------------------


async def test_a_later_head_over_the_size_limit_closes_without_an_answer() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=1024))
    listener.data_received(GET)
    await _served(transport)
    answered = bytes(transport.out)
    listener.data_received(b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 1100)
    assert transport.closed and bytes(transport.out) == answered


async def test_a_later_head_with_too_many_lines_closes_without_an_answer() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_headers=3))
    listener.data_received(GET)
    await _served(transport)
    answered = bytes(transport.out)
    listener.data_received(b"GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n")
    assert transport.closed and bytes(transport.out) == answered


def _chunked(trailers: bytes) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n" + trailers + b"\r\n")  # fmt: skip


_BIG_TRAILERS = _chunked(b"X-Trailer: " + b"t" * 1100 + b"\r\n")


@pytest.mark.parametrize("pieces", [50, len(_BIG_TRAILERS)])
async def test_trailers_over_the_head_limit_close_the_connection(pieces: int) -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=1024))
    _feed(listener, _BIG_TRAILERS, pieces)
    assert transport.closed
    assert not transport.out.startswith(b"HTTP/1.1 431")  # no answer of ours


@pytest.mark.parametrize("pieces", [1, 7])
async def test_trailers_over_the_head_limit_in_few_reads_close_the_connection(
    pieces: int,
) -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=1024))
    _feed(listener, _BIG_TRAILERS, pieces)
    assert transport.closed


async def test_small_trailers_are_served() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=1024))
    _feed(listener, _chunked(b"X-Trailer: " + b"t" * 900 + b"\r\n"), 7)
    await _served(transport)
    assert not transport.closed


async def test_head_and_trailer_lines_together_are_bounded_by_max_headers() -> None:
    listener, transport, _ = open_listener(LimitsSettings(max_headers=4))
    listener.data_received(_chunked(b"T1: 1\r\nT2: 2\r\nT3: 3\r\n"))
    assert transport.closed  # Host, Transfer-Encoding and three trailer lines
    listener2, transport2, _ = open_listener(LimitsSettings(max_headers=4))
    listener2.data_received(_chunked(b"T1: 1\r\nT2: 2\r\n"))
    await _served(transport2)


# -- WebSocket handshakes and other upgrades ------------------------------------------------

#: What real clients send (python-websockets, Chrome, curl-style lower case).
REAL_HEADS = [
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


def _lower_headers(head: bytes) -> list[tuple[bytes, bytes]]:
    lines = head.split(b"\r\n")[1:-2]
    return [(n.lower(), v) for n, _, v in (line.partition(b": ") for line in lines)]


class TakingApp:
    """Takes every WebSocket session over at once, as the gateway's splice does."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.taken: list[tuple[asyncio.Transport, bytes] | None] = []
        self.protocol = asyncio.Protocol()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append({k: v for k, v in scope.items() if k != "extensions"})
        take_over = scope["extensions"]["headroom.splice"]["take_over"]
        self.taken.append(take_over(None, [], self.protocol, lambda: None))


async def test_handshakes_share_websocket_options_until_a_reload() -> None:
    """The options a ClientWebSocket gets follow the limits of its handshake's time:
    one object for the connections of one set of limits, a new one after a reload."""
    limits = [LimitsSettings(max_message_bytes=2048, ping_interval_s=5)]
    seen = []
    for _ in range(2):
        listener, _, _ = open_listener(lambda: limits[0], TakingApp())
        listener.data_received(REAL_HEADS[0])
        assert listener._ws is not None
        seen.append(listener._ws.options)
    assert seen[0] == seen[1] and (seen[0].max_size, seen[0].ping_interval_s) == (4096, 5)
    cls = type(listener)
    assert cls._ws_options() is cls._ws_options()
    limits[0] = LimitsSettings(max_message_bytes=3000, ping_interval_s=0)
    reloaded = cls._ws_options()
    assert (reloaded.max_size, reloaded.ping_interval_s) == (6000, 0)
    assert cls._ws_options() is reloaded


@pytest.mark.parametrize("head", REAL_HEADS)
@pytest.mark.parametrize("cut", [None, 10, -1])
async def test_an_upgrade_in_one_or_two_reads_goes_to_the_websocket_server(
    head: bytes, cut: int | None
) -> None:
    """Real clients' handshakes, whole or split (the last byte alone too), with a frame
    sent early in the same read: Headroom's WebSocket server runs the app, with the
    target and the headers (names lower-cased) as sent, and the early bytes reach the
    take-over."""
    app = TakingApp()
    listener, transport, timers = open_listener(LimitsSettings(handshake_timeout_s=7), app)
    early = b"\x81\x82\x01\x02\x03\x04ik"
    data = head + early
    cut = len(head) + cut if cut is not None and cut < 0 else cut
    for piece in [data] if cut is None else [data[:cut], data[cut:]]:
        listener.data_received(piece)
    assert isinstance(listener._ws, ClientWebSocket) and listener._inner is None
    assert 7 not in timers.armed()  # the head deadline is disarmed
    await settle(lambda: bool(app.taken))
    (scope,) = app.scopes
    target = head.split(b" ")[1]
    assert (
        scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        == target
    )
    assert scope["headers"] == _lower_headers(head)
    assert app.taken == [(transport, early)]
    assert transport.protocol is app.protocol
    assert transport.out.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")


async def test_limits_hold_for_an_upgrade_in_one_read() -> None:
    head = REAL_HEADS[1]
    app = TakingApp()
    listener, transport, _ = open_listener(LimitsSettings(max_headers=4), app)
    listener.data_received(head)
    assert transport.out.startswith(b"HTTP/1.1 431 ") and b"more than 4 header" in transport.out
    padded = head[:-2] + b"X-Pad: " + b"p" * 1100 + b"\r\n\r\n"
    listener, transport, _ = open_listener(LimitsSettings(max_head_bytes=len(padded) - 1), app)
    listener.data_received(padded)
    assert transport.out.startswith(b"HTTP/1.1 431 ")
    assert listener._ws is None and not app.scopes


class HttpRecorder:
    """Answers HTTP with 204 and records the scopes uvicorn gives it."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.extensions: list[set[str]] = []  # each scope's, when the app was called

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        self.extensions.append(set(scope.get("extensions") or ()))
        if scope["type"] == "http":
            await _app(scope, receive, send)
        else:
            await receive()
            await send({"type": "websocket.close", "code": 1000})


async def test_a_non_websocket_upgrade_is_served_by_uvicorn_as_http() -> None:
    app = HttpRecorder()
    listener, transport, _ = open_listener(app=app)
    listener.data_received(
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    )
    assert listener._ws is None and listener._inner is not None
    await _served(transport)
    assert [scope["type"] for scope in app.scopes] == ["http"]


_WS_HEADERS = (
    b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


async def test_a_post_websocket_upgrade_is_refused_405() -> None:
    app = HttpRecorder()
    listener, transport, _ = open_listener(app=app)
    listener.data_received(b"POST / HTTP/1.1\r\nHost: x\r\n" + _WS_HEADERS + b"\r\n")
    assert listener._ws is None and listener._inner is None
    assert transport.out.startswith(b"HTTP/1.1 405 ") and b"\r\nallow: GET\r\n" in transport.out
    assert transport.closed and not app.scopes


async def test_an_http10_websocket_upgrade_is_refused_400() -> None:
    """RFC 6455 4.1: a handshake is a GET over HTTP/1.1 or later."""
    app = HttpRecorder()
    listener, transport, _ = open_listener(app=app)
    listener.data_received(b"GET / HTTP/1.0\r\nHost: x\r\n" + _WS_HEADERS + b"\r\n")
    assert listener._ws is None and listener._inner is None
    assert transport.out.startswith(b"HTTP/1.1 400 ") and transport.closed
    assert not app.scopes


async def test_an_upgrade_on_a_kept_alive_connection_is_served_by_a_listener() -> None:
    """An upgrade after a plain request: its head is checked under the limits, then
    uvicorn's HTTP protocol hands the connection, once its response is written, to its
    WebSocket protocol class -- the listener class again, which serves the upgrade as
    its first head (Headroom's WebSocket server, the take-over offered)."""
    app = HttpRecorder()
    listener, transport, _ = open_listener(LimitsSettings(max_headers=3), app=app)
    listener.data_received(GET)
    await _served(transport)
    listener.data_received(REAL_HEADS[2])
    assert transport.closed  # five header lines: over the limit, closed
    listener, transport, _ = open_listener(app=app)
    listener.data_received(GET)
    await _served(transport)
    listener.data_received(REAL_HEADS[2])
    await settle(lambda: len(app.scopes) == 3)
    assert listener._ws is None and app.scopes[-1]["type"] == "websocket"
    assert "headroom.splice" in app.extensions[-1]
    later = transport.protocol
    assert isinstance(later, ClientListener) and later is not listener
    assert isinstance(later._ws, ClientWebSocket)
    assert app.scopes[-1]["path"] == "/" and (b"host", b"x") in app.scopes[-1]["headers"]


@pytest.mark.parametrize("pieces", [1, 2])
async def test_a_listener_is_freed_at_the_take_over_without_the_garbage_collector(
    pieces: int,
) -> None:
    """Once the relay has the connection and the app is done, nothing refers to the
    listener or its WebSocket server (httptools' callbacks made it a cycle)."""
    app = TakingApp()
    sessions = WebSocketSessions()
    listener, transport, timers = open_listener(app=app, sessions=sessions)
    listener_ref = weakref.ref(listener)
    gc.disable()
    try:
        _feed(listener, REAL_HEADS[0], pieces)
        ws_ref = weakref.ref(listener._ws)  # type: ignore[arg-type]
        await settle(lambda: bool(app.taken))
        await settle(lambda: not sessions.live)
        assert transport.protocol is app.protocol
        timers.pending.clear()  # the cancelled head deadline (the loop drops it)
        del listener
        assert listener_ref() is None and ws_ref() is None
    finally:
        gc.enable()


# -- the write-stall guard ------------------------------------------------------------------


async def test_a_stalled_response_of_a_closing_connection_is_aborted() -> None:
    listener, transport, timers = open_listener(LimitsSettings(client_write_timeout_s=9))
    listener.data_received(GET)
    await _served(transport)
    listener.pause_writing()
    assert timers.armed().count(9) == 1
    listener.pause_writing()  # once is enough
    assert timers.armed().count(9) == 1
    timers.fire(9)  # not closing: the client may still read, keep waiting
    assert not transport.aborted and timers.armed().count(9) == 1
    transport.closed = True  # the response was ended; what is unsent is still queued
    timers.fire(9)
    assert transport.aborted


async def test_resuming_writes_disarms_the_stall_guard() -> None:
    listener, transport, timers = open_listener(LimitsSettings(client_write_timeout_s=9))
    listener.data_received(GET)
    await _served(transport)
    listener.pause_writing()
    listener.resume_writing()
    assert 9 not in timers.armed()
    transport.closed = True
    timers.fire(9)
    assert not transport.aborted


# -- on a real socket -----------------------------------------------------------------------


async def test_a_real_client_reads_the_431_then_is_served_on_a_new_connection() -> None:
    """End to end on 127.0.0.1: a client still sending its oversized head reads the 431
    (the connection lingers rather than resets), and a keep-alive connection is served
    request after request."""
    limits = LimitsSettings(max_head_bytes=1024)
    listener = client_listener(_app, lambda: limits, WebSocketSessions())
    async with running_server(_app, http=listener, lifespan="off") as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4000)
            answer = await asyncio.wait_for(reader.read(), 30)  # until the server closes
            assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        finally:
            writer.close()
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            for _ in range(2):
                writer.write(GET)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                assert head.startswith(b"HTTP/1.1 204 ")
        finally:
            writer.close()
