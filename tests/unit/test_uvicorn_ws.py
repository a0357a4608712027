"""HeadroomWebSocketProtocol's lean handshake builds the same ASGI scope as uvicorn's
own (websockets-parsed) handshake, and leaves anything unusual to websockets."""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import weakref
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

from proxy.relay.uvicorn_ws import HeadroomWebSocketProtocol, whole_frames
from tests.unit.test_splice import Harness, client_frame, parse_frames

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.protocol: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(
            name, default
        )

    def write(self, data: Any) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.Event().wait()  # never runs far: the test cancels it


def _open(
    cls: type[WebSocketsSansIOProtocol], request: bytes, **options: Any
) -> tuple[Any, Transport]:
    config = uvicorn.Config(
        app=_app, ws=cls, ws_per_message_deflate=False, log_level="critical", **options
    )
    config.load()
    state = ServerState()
    protocol = cls(config=config, server_state=state, app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(request)
    for task in state.tasks:
        task.cancel()
    return protocol, transport


def _request(target: bytes, *extra: bytes, key: bytes = KEY, version: bytes = b"13") -> bytes:
    lines = [
        b"GET " + target + b" HTTP/1.1",
        b"host: 127.0.0.1:8000",
        b"upgrade: websocket",
        b"connection: Upgrade",
        b"sec-websocket-key: " + key,
        b"sec-websocket-version: " + version,
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        _request(b"/v1/audio/speech/stream"),
        _request(b"/ws?api_key=a%20b&x=1", b"sec-websocket-protocol: a, b", b"x-custom: 1"),
        _request(b"/caf%C3%A9/x%2Fy?q=%23", b"user-agent: test", b"x-dup: 1", b"x-dup: 2"),
        _request(b"/ws", b"sec-websocket-protocol: one", b"sec-websocket-protocol: two"),
    ],
)
async def test_the_lean_scope_equals_uvicorns(request_bytes: bytes) -> None:
    lean, _ = _open(HeadroomWebSocketProtocol, request_bytes)
    stock, _ = _open(WebSocketsSansIOProtocol, request_bytes)
    assert lean._accept_key, "the lean path was not taken"
    ours = {k: v for k, v in lean.scope.items() if k != "extensions"}
    theirs = {k: v for k, v in stock.scope.items() if k != "extensions"}
    assert ours == theirs
    assert set(lean.scope["extensions"]) == {"websocket.http.response", "headroom.splice"}


@pytest.mark.parametrize(
    "request_bytes",
    [
        _request(b"/ws", key=b"short"),  # not 16 bytes
        _request(b"/ws", version=b"8"),
        _request(b"/ws", b"sec-websocket-key: " + KEY),  # two keys
        _request(b"/ws").replace(b"upgrade: websocket", b"upgrade: h2c"),
        _request(b"/ws").replace(b"connection: Upgrade", b"connection: keep-alive"),
    ],
)
async def test_invalid_handshakes_are_left_to_websockets(request_bytes: bytes) -> None:
    lean, transport = _open(HeadroomWebSocketProtocol, request_bytes)
    assert not lean._accept_key
    assert transport.out.startswith(b"HTTP/1.1 4")  # websockets' own error answer


async def test_take_over_answers_101_with_the_right_accept_key() -> None:
    lean, transport = _open(
        HeadroomWebSocketProtocol, _request(b"/ws", b"sec-websocket-protocol: a, b")
    )
    new = asyncio.Protocol()
    taken = lean.take_over("b", [(b"x-headroom-fallback", b"lite")], new, lambda: None)
    assert taken is not None and taken[0] is transport and taken[1] == b""
    assert transport.protocol is new
    head = bytes(transport.out).decode()
    accept = base64.b64encode(hashlib.sha1(KEY + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    assert head.startswith("HTTP/1.1 101 Switching Protocols\r\n")
    assert f"Sec-WebSocket-Accept: {accept.decode()}\r\n" in head
    assert "Sec-WebSocket-Protocol: b\r\n" in head
    assert "x-headroom-fallback: lite\r\n" in head
    assert head.endswith("\r\n\r\n")
    assert lean.take_over(None, [], new, lambda: None) is None  # only once


async def test_an_asgi_accept_after_the_lean_handshake_still_reads_frames() -> None:
    """Queue-feedback sessions are accepted through ASGI: websockets' parser must then be
    past the request, reading frames."""
    lean, transport = _open(HeadroomWebSocketProtocol, _request(b"/ws"))
    await lean.send({"type": "websocket.accept", "subprotocol": None, "headers": []})
    assert transport.out.startswith(b"HTTP/1.1 101")
    lean.data_received(bytes((0x81, 0x82, 1, 2, 3, 4, ord("h") ^ 1, ord("i") ^ 2)))
    assert await lean.receive() == {"type": "websocket.connect"}
    assert await lean.receive() == {"type": "websocket.receive", "text": "hi"}


# -- taking over a connection accepted through ASGI (queue feedback) --------------------


def test_whole_frames_counts_complete_frames_only() -> None:
    small = client_frame(1, b"hi")
    medium = client_frame(2, b"m" * 300)  # 16-bit length
    large = client_frame(2, b"l" * 70_000)  # 64-bit length
    stream = small + medium + large
    assert whole_frames(stream, None) == len(stream)
    for cut in (1, 3, len(small) + 3, len(small) + len(medium) + 9, len(stream) - 1):
        expected = max(n for n in (0, len(small), len(small) + len(medium)) if n <= cut)
        assert whole_frames(stream[:cut], None) == expected, cut
    # a frame still arriving that declares more than max_size goes to the parser at once
    assert whole_frames(small + large[:20], 65_536) == len(small) + 20
    assert whole_frames(small + large[:20], 70_000) == len(small)


def _accepted(**config: Any) -> tuple[Any, Transport]:
    lean, transport = _open(HeadroomWebSocketProtocol, _request(b"/ws"), **config)
    return lean, transport


async def _accept(lean: Any) -> None:
    await lean.send({"type": "websocket.accept", "subprotocol": None, "headers": []})
    assert await lean.receive() == {"type": "websocket.connect"}


async def test_a_frame_split_across_reads_after_accept_is_still_delivered() -> None:
    lean, _ = _accepted()
    await _accept(lean)
    raw = client_frame(1, b"x" * 200)
    lean.data_received(raw[:3])
    lean.data_received(raw[3:150])
    assert lean.queue.empty()
    lean.data_received(raw[150:])
    assert await lean.receive() == {"type": "websocket.receive", "text": "x" * 200}


async def test_take_over_after_accept_carries_everything_over_in_order() -> None:
    """Held messages, then uvicorn's unread queue, then the fragments uvicorn was
    assembling, then the frame still arriving: the splice reads them as the client
    sent them, and the rest of the message follows on the socket."""
    lean, transport = _accepted(ws_ping_interval=20.0, ws_ping_timeout=20.0)
    await _accept(lean)
    assert lean.ping_timer is not None  # uvicorn's keepalive runs while the client waits
    await lean.send({"type": "websocket.send", "text": '{"type": "headroom.queue"}'})
    cont = client_frame(0, b"-end", fin=True)
    lean.data_received(
        client_frame(2, b"queued") + client_frame(1, b"frag", fin=False) + cont[:3]
    )
    await lean.send({"type": "websocket.send", "text": '{"type": "headroom.admitted"}'})
    written = bytes(transport.out)
    harness = Harness()
    held = [{"type": "websocket.receive", "text": "held-1"},
            {"type": "websocket.receive", "bytes": b"held-2"}]  # fmt: skip
    taken = lean.take_over(None, [], harness.splice.client, lambda: None, held)
    assert taken is not None
    client, early = taken
    assert client is transport and transport.protocol is harness.splice.client
    assert bytes(transport.out) == written  # no second handshake answer
    assert lean.ping_timer is None and lean.pong_timer is None  # no ping mid-stream
    assert early.endswith(cont[:3])
    assert parse_frames(early[: -3]) == [
        (1, True, b"held-1"), (2, True, b"held-2"), (2, True, b"queued"), (1, False, b"frag"),
    ]  # fmt: skip
    harness.start(client_early=early)
    harness.from_client(cont[3:])
    assert parse_frames(harness.upstream.take()) == [
        (1, True, b"held-1"), (2, True, b"held-2"), (2, True, b"queued"),
        (1, False, b"frag"), (0, True, b"-end"),
    ]  # fmt: skip
    texts = [value for kind, value in harness.adapter.events if kind == "client_text"]
    assert texts == ["held-1", "frag-end"]
    assert lean.take_over(None, [], harness.splice.client, lambda: None) is None  # once


async def test_an_accepted_take_over_lets_go_of_websockets_handshake_objects() -> None:
    lean, _ = _accepted()
    await _accept(lean)
    assert lean.request is not None and lean.response is not None
    assert lean.take_over(None, [], asyncio.Protocol(), lambda: None) is not None
    assert not hasattr(lean, "request") and not hasattr(lean, "response")


_UVICORN_SIDE = ("conn", "queue", "writable")  # websockets' protocol, receive queue, flow


async def test_a_take_over_lets_go_of_uvicorns_websocket_machinery() -> None:
    """Once taken over (lean handshake or ASGI accept), nothing of uvicorn's WebSocket
    side runs again for the connection: it is not kept for the session's life (about
    6 KB), and a stray ASGI send fails instead of writing into the relayed stream."""
    lean, transport = _open(HeadroomWebSocketProtocol, _request(b"/ws"))
    assert all(hasattr(lean, name) for name in _UVICORN_SIDE)
    assert lean.take_over(None, [], asyncio.Protocol(), lambda: None) is not None
    assert not any(hasattr(lean, name) for name in _UVICORN_SIDE)
    written = bytes(transport.out)
    with pytest.raises(AttributeError):
        await lean.send({"type": "websocket.close", "code": 1011, "reason": "internal error"})
    assert bytes(transport.out) == written
    accepted, _ = _accepted()
    await _accept(accepted)
    assert accepted.take_over(None, [], asyncio.Protocol(), lambda: None) is not None
    assert not any(hasattr(accepted, name) for name in _UVICORN_SIDE)


_OWN = {
    "_early", "_accept_key", "_request", "on_shutdown", "_tail", "_conn", "_conn_gone", "_gone",
}  # fmt: skip


@pytest.mark.parametrize("deflate", [False, True])
async def test_the_constructor_sets_what_uvicorns_does_with_websockets_protocol_lazily(
    deflate: bool,
) -> None:
    """HeadroomWebSocketProtocol copies uvicorn's constructor but for websockets'
    ServerProtocol, which it builds on first use: the same attributes, the same values,
    and the same ServerProtocol once asked for (on every uvicorn version CI runs)."""
    config = uvicorn.Config(
        app=_app, ws=HeadroomWebSocketProtocol, ws_per_message_deflate=deflate,
        ws_max_size=12345, ws_ping_interval=7.0, ws_ping_timeout=3.0, root_path="/r",
        log_level="critical",
    )  # fmt: skip
    config.load()
    state = ServerState()
    state.default_headers = [(b"server", b"x")]
    stock = WebSocketsSansIOProtocol(config=config, server_state=state, app_state={"a": 1})
    lean = HeadroomWebSocketProtocol(config=config, server_state=state, app_state={"a": 1})
    theirs, ours = vars(stock), vars(lean)
    assert set(ours) - _OWN == set(theirs) - {"conn"}
    assert lean._conn is None  # not built yet
    fresh = {"queue", "writable"}  # a new object of the same kind each
    for name, value in theirs.items():
        if name in fresh:
            assert type(ours[name]) is type(value), name
        elif name != "conn":
            assert ours[name] == value, name
    assert lean.writable.is_set() and lean.queue.empty()
    conn = lean.conn
    assert lean.conn is conn  # built once
    assert type(conn) is type(stock.conn)
    limits = {k: v for k, v in vars(conn).items() if k.startswith("max")}
    assert limits == {k: v for k, v in vars(stock.conn).items() if k.startswith("max")}
    assert 12345 in limits.values()
    assert [type(e) for e in conn.available_extensions] == [
        type(e) for e in stock.conn.available_extensions
    ]
    assert conn.logger is stock.conn.logger


async def test_a_spliced_lean_handshake_never_builds_websockets_protocol() -> None:
    lean, transport = _open(HeadroomWebSocketProtocol, _request(b"/ws"))
    assert lean._accept_key and lean._conn is None
    assert lean.take_over(None, [], asyncio.Protocol(), lambda: None) is not None
    assert transport.out.startswith(b"HTTP/1.1 101")
    assert lean._conn is None and not hasattr(lean, "conn")


async def test_no_take_over_after_the_client_closed_while_waiting() -> None:
    lean, transport = _accepted()
    await _accept(lean)
    lean.data_received(client_frame(8, (1000).to_bytes(2, "big")))
    assert transport.closed
    assert lean.take_over(None, [], asyncio.Protocol(), lambda: None) is None


async def test_no_take_over_after_an_http_refusal() -> None:
    lean, _ = _accepted()
    await lean.send({"type": "websocket.http.response.start", "status": 503, "headers": []})
    assert lean.take_over(None, [], asyncio.Protocol(), lambda: None) is None


async def _refusing_app(scope: Any, receive: Any, send: Any) -> None:
    await receive()  # websocket.connect
    await send({"type": "websocket.close", "code": 1008})


async def test_a_finished_connection_is_freed_without_the_garbage_collector() -> None:
    """The scope's ``headroom.splice`` extension (a bound take_over) tied the scope back
    to its protocol: every connection's objects waited for a collection. It goes when
    the ASGI app ends."""
    config = uvicorn.Config(
        app=_refusing_app, ws=HeadroomWebSocketProtocol, ws_per_message_deflate=False,
        log_level="critical",
    )  # fmt: skip
    config.load()
    state = ServerState()
    gc.disable()
    try:
        lean = HeadroomWebSocketProtocol(config=config, server_state=state, app_state={})
        transport = Transport()
        lean.connection_made(transport)
        lean.data_received(_request(b"/ws"))
        (task,) = state.tasks
        await task
        assert bytes(transport.out).startswith(b"HTTP/1.1 403")  # closed before accept
        assert "headroom.splice" not in lean.scope["extensions"]
        lean.connection_lost(None)
        protocol = weakref.ref(lean)
        del lean, task
        assert protocol() is None
    finally:
        gc.enable()


async def test_gone_is_done_when_the_connection_is_lost() -> None:
    """The ``gone`` future a session not yet accepted races its waits against: done
    when the client's connection is lost, the same future each time, and done at once
    when asked for after the loss."""
    lean, _ = _accepted()
    gone = lean.scope["extensions"]["headroom.splice"]["gone"]
    first = gone()
    assert gone() is first and not first.done()
    lean.connection_lost(None)
    assert first.done() and first.result() is None
    assert await lean.receive() == {"type": "websocket.connect"}
    assert (await lean.receive())["type"] == "websocket.disconnect"  # ASGI is told too

    late, _ = _accepted()
    late.connection_lost(None)
    assert late.gone().done()


# -- the upgrade handed over from uvicorn's HTTP protocol, already parsed ----------------


def _via_http(request: bytes) -> tuple[Any, Transport, ServerState]:
    """A request through HeadLimitedProtocol (uvicorn's httptools protocol with the head
    limits), configured with the splice's protocol, as the gateway serves it."""
    from proxy.relay.uvicorn_http import HeadLimitedProtocol

    config = uvicorn.Config(
        app=_app, ws=HeadroomWebSocketProtocol, ws_per_message_deflate=False,
        log_level="critical", lifespan="off",
    )  # fmt: skip
    config.load()
    state = ServerState()
    http = HeadLimitedProtocol(config=config, server_state=state, app_state={"a": 1})
    transport = Transport()
    http.connection_made(transport)
    http.data_received(request)
    for task in state.tasks:
        task.cancel()
    return transport.protocol, transport, state


async def test_an_upgrade_is_handed_over_parsed_not_reserialised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HTTP protocol gives the splice's protocol the request it parsed; nothing is
    serialised again to be read again, and the scope is the one the raw path builds."""
    request = _request(b"/ws?x=1", b"sec-websocket-protocol: a, b", b"x-custom: V")
    raw, _ = _open(HeadroomWebSocketProtocol, request)

    def reparsed(self: Any, data: bytes) -> None:
        raise AssertionError(f"request parsed again: {data!r}")

    monkeypatch.setattr(HeadroomWebSocketProtocol, "data_received", reparsed)
    lean, transport, state = _via_http(request)
    assert isinstance(lean, HeadroomWebSocketProtocol)
    assert lean in state.connections and lean.handshake_initiated
    assert transport.out == b""  # nothing answered yet: the app decides
    for name in ("path", "raw_path", "query_string", "headers", "subprotocols"):
        assert lean.scope[name] == raw.scope[name], name
    assert lean.scope["headers"][-1] == (b"x-custom", b"V")
    assert lean._accept_key == raw._accept_key
    # uvicorn's connection_made, with what the HTTP protocol read of the connection
    assert (lean.transport, lean.server, lean.client, lean.scheme) == (
        transport, raw.server, raw.client, "ws"
    )  # fmt: skip
    assert set(lean.scope["extensions"]["headroom.splice"]) == {"take_over", "gone"}


async def test_a_parsed_upgrade_the_lean_reading_refuses_goes_to_websockets() -> None:
    """A request the lean reading does not take (here: no Sec-WebSocket-Key) is still
    answered by websockets' parser, as uvicorn would hand it over."""
    request = _request(b"/ws").replace(b"sec-websocket-key: " + KEY + b"\r\n", b"")
    lean, transport, _ = _via_http(request)
    assert isinstance(lean, HeadroomWebSocketProtocol) and lean._request is None
    assert bytes(transport.out).startswith(b"HTTP/1.1 400 ")


async def test_an_asgi_accept_after_a_parsed_upgrade_still_reads_frames() -> None:
    """Queue feedback accepts through ASGI: websockets' parser is then given the
    request (serialised as uvicorn would) and reads frames after it."""
    lean, transport, _ = _via_http(_request(b"/ws"))
    await lean.send({"type": "websocket.accept", "subprotocol": None, "headers": []})
    assert transport.out.startswith(b"HTTP/1.1 101")
    lean.data_received(bytes((0x81, 0x82, 1, 2, 3, 4, ord("h") ^ 1, ord("i") ^ 2)))
    assert await lean.receive() == {"type": "websocket.connect"}
    assert await lean.receive() == {"type": "websocket.receive", "text": "hi"}
