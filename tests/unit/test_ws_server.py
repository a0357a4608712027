"""Headroom's client WebSocket server (proxy.relay.ws_server), driven through the client
listener on a fake transport: the ASGI scope and extensions, websockets' refusals, the
take-over (101, early bytes, what an ASGI-accepted connection carries over), frames
while the app holds an accepted connection, keepalive, failures and shut-down. Timers
are recorded and fired by the test; no real time passes. The last tests run a real
server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.relay.listener import ClientListener
from proxy.relay.ws_server import (
    EARLY_LIMIT,
    ClientDisconnected,
    ClientWebSocket,
)
from proxy.settings import LimitsSettings
from tests.unit.test_listener import Timers, Transport, open_listener, settle
from tests.unit.test_splice import client_frame, parse_frames

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
ACCEPT = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455 1.3's example


def request(
    target: bytes = b"/ws", *extra: bytes, key: bytes = KEY, version: bytes = b"13"
) -> bytes:
    lines = [
        b"GET " + target + b" HTTP/1.1",
        b"Host: 127.0.0.1:8000",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"Sec-WebSocket-Key: " + key,
        b"Sec-WebSocket-Version: " + version,
        *extra,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class App:
    """Hands ``receive`` and ``send`` to the test and runs until released (or raises
    what the test sets)."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.raises: BaseException | None = None
        self.runs = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.runs += 1
        self.scope, self.receive, self.send = scope, receive, send
        self.started.set()
        await self.release.wait()
        if self.raises is not None:
            raise self.raises

    @property
    def take_over(self) -> Any:
        return self.scope["extensions"]["headroom.splice"]["take_over"]

    async def accept(self, subprotocol: str | None = None) -> None:
        assert await self.receive() == {"type": "websocket.connect"}
        await self.send({"type": "websocket.accept", "subprotocol": subprotocol, "headers": []})

    async def end(self, ws: ClientWebSocket) -> None:
        self.release.set()
        await settle(lambda: ws not in ws.sessions.live)


class Session:
    def __init__(self, listener: ClientListener, transport: Transport, timers: Timers) -> None:
        self.listener, self.transport, self.timers = listener, transport, timers
        ws = listener._ws
        assert isinstance(ws, ClientWebSocket)
        self.ws = ws


async def handshake(
    app: App,
    data: bytes | None = None,
    transport: Transport | None = None,
    root_path: str = "",
    **limits: Any,
) -> Session:
    listener, transport, timers = open_listener(
        LimitsSettings(**limits), app, root_path=root_path, transport=transport
    )
    listener.data_received(request() if data is None else data)
    await asyncio.wait_for(app.started.wait(), 30)
    return Session(listener, transport, timers)


async def accepted(app: App, **limits: Any) -> Session:
    session = await handshake(app, **limits)
    await app.accept()
    assert session.transport.take().startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    return session


def masked(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    return client_frame(opcode, payload, fin)


def unmasked(opcode: int, payload: bytes) -> bytes:
    assert len(payload) < 126
    return bytes((0x80 | opcode, len(payload))) + payload


def close_payload(code: int, reason: bytes = b"") -> bytes:
    return code.to_bytes(2, "big") + reason


# -- the scope ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "extra", "expected"),
    [
        (b"/v1/audio/speech", (), ("/v1/audio/speech", b"/v1/audio/speech", b"", [])),
        (b"/ws?api_key=a%20b&x=1", (b"Sec-WebSocket-Protocol: a, b", b"X-Custom: V"),
         ("/ws", b"/ws", b"api_key=a%20b&x=1", ["a", "b"])),
        (b"/caf%C3%A9/x%2Fy?q=%23", (b"X-Dup: 1", b"x-dup: 2"),
         ("/café/x/y", b"/caf%C3%A9/x%2Fy", b"q=%23", [])),
        (b"/ws", (b"Sec-WebSocket-Protocol: one", b"sec-websocket-protocol: two, three"),
         ("/ws", b"/ws", b"", ["one", "two", "three"])),
    ],
)  # fmt: skip
async def test_the_scope_of_a_handshake(
    target: bytes, extra: tuple[bytes, ...], expected: tuple[str, bytes, bytes, list[str]]
) -> None:
    app = App()
    data = request(target, *extra)
    session = await handshake(app, data)
    path, raw_path, query, subprotocols = expected
    scope = app.scope
    lines = data.split(b"\r\n")[1:-2]
    headers = [(n.lower(), v) for n, _, v in (line.partition(b": ") for line in lines)]
    assert {k: v for k, v in scope.items() if k != "extensions"} == {
        "type": "websocket",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "scheme": "ws",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5555),
        "root_path": "",
        "path": path,
        "raw_path": raw_path,
        "query_string": query,
        "headers": headers,
        "subprotocols": subprotocols,
        "state": {},
    }
    assert set(scope["extensions"]) == {"websocket.http.response", "headroom.splice"}
    assert set(scope["extensions"]["headroom.splice"]) == {"take_over", "gone"}
    assert session.transport.out == b""  # nothing answered yet: the app decides
    await app.end(session.ws)


async def test_the_scope_under_a_root_path_and_tls() -> None:
    app = App()
    session = await handshake(app, request(b"/ws?x=1"), transport=Transport(ssl=True),
                              root_path="/r")  # fmt: skip
    assert app.scope["scheme"] == "wss"
    assert (app.scope["root_path"], app.scope["path"], app.scope["raw_path"]) == (
        "/r", "/r/ws", b"/r/ws",
    )  # fmt: skip
    assert app.scope["query_string"] == b"x=1"
    await app.end(session.ws)


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (request().replace(b"Sec-WebSocket-Key: " + KEY + b"\r\n", b""), 400),
        (request(key=b"short"), 400),  # not 16 bytes
        (request(key=b"not base64 at all!!!!!!="), 400),
        (request(version=b"12"), 400),  # websockets' answer (RFC 6455 4.2.2 says 426)
        (request(b"/ws", b"Upgrade: websocket"), 426),  # two Upgrade headers
        (request(b"/ws", b"Sec-WebSocket-Key: " + KEY), 400),  # two keys
        (request(b"/ws", b"Sec-WebSocket-Version: 13"), 400),  # two versions
        (request(b"http://example.com/ws"), 400),  # not an absolute path
    ],
    ids=[
        "no-key",
        "short-key",
        "bad-key",
        "version-12",
        "two-upgrades",
        "two-keys",
        "two-versions",
        "target",
    ],
)
async def test_invalid_handshakes_are_answered_by_websockets_and_closed(
    data: bytes, status: int
) -> None:
    app = App()
    listener, transport, _ = open_listener(app=app)
    listener.data_received(data + masked(1, b"early"))
    assert transport.out.startswith(b"HTTP/1.1 %d " % status)
    assert b"Failed to open a WebSocket connection" in transport.out
    assert transport.closed and listener._ws is None
    listener.data_received(masked(1, b"more"))  # thrown away
    assert transport.out.count(b"HTTP/1.1") == 1
    await asyncio.sleep(0)
    assert app.runs == 0


async def test_a_handshake_without_connection_upgrade_is_plain_http() -> None:
    """Without ``Connection: Upgrade`` the request asks for no upgrade: uvicorn serves it
    as HTTP (the app answers it, here with 204)."""
    scopes: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append(scope["type"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    listener, transport, _ = open_listener(app=app)
    listener.data_received(request().replace(b"Connection: Upgrade", b"Connection: keep-alive"))
    await settle(lambda: bool(transport.out))
    assert transport.out.startswith(b"HTTP/1.1 204 ") and scopes == ["http"]
    assert listener._ws is None


# -- the take-over --------------------------------------------------------------------------


async def test_take_over_answers_101_with_the_right_accept_key_and_the_early_bytes() -> None:
    app = App()
    early = masked(1, b"sent early") + masked(2, b"x" * 300)[:50]
    session = await handshake(app, request(b"/ws", b"Sec-WebSocket-Protocol: a, b") + early[:9])
    session.listener.data_received(early[9:])
    new = asyncio.Protocol()
    taken = app.take_over("b", [(b"x-headroom-fallback", b"lite")], new, lambda: None)
    transport = session.transport
    assert taken == (transport, early)
    assert transport.protocol is new
    head = bytes(transport.out).decode()
    assert head.startswith("HTTP/1.1 101 Switching Protocols\r\n")
    assert f"Sec-WebSocket-Accept: {ACCEPT}\r\n" in head
    assert "Sec-WebSocket-Protocol: b\r\n" in head
    assert "x-headroom-fallback: lite\r\n" in head
    assert "Upgrade: websocket\r\n" in head and "Connection: Upgrade\r\n" in head
    assert head.endswith("\r\n\r\n") and head.count("\r\n\r\n") == 1
    assert app.take_over(None, [], new, lambda: None) is None  # only once
    written = bytes(transport.out)
    with pytest.raises(RuntimeError, match="taken over"):
        await app.send({"type": "websocket.close", "code": 1011})
    assert bytes(transport.out) == written
    await app.end(session.ws)
    assert "headroom.splice" not in app.scope["extensions"]  # let go when the app ends


async def test_a_take_over_without_a_subprotocol_names_none() -> None:
    app = App()
    session = await handshake(app)
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is not None
    assert b"Sec-WebSocket-Protocol" not in session.transport.out
    await app.end(session.ws)


@pytest.mark.parametrize("over", [0, 1])
async def test_early_bytes_beyond_the_limit_drop_the_connection(over: int) -> None:
    app = App()
    session = await handshake(app)
    for _ in range(EARLY_LIMIT // 4096):
        session.listener.data_received(b"\x00" * 4096)
    session.listener.data_received(b"\x00" * (EARLY_LIMIT % 4096 + over))
    assert session.transport.closed == bool(over)
    if over:
        assert session.transport.out == b""
        assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
        session.listener.connection_lost(None)
        assert await app.receive() == {"type": "websocket.connect"}
        assert (await app.receive())["type"] == "websocket.disconnect"
    else:
        taken = app.take_over(None, [], asyncio.Protocol(), lambda: None)
        assert taken is not None and len(taken[1]) == EARLY_LIMIT
    await app.end(session.ws)


# -- frames while the app holds an accepted connection ------------------------------------


async def test_an_accept_answers_101_and_frames_are_delivered() -> None:
    app = App()
    session = await handshake(app, request(b"/ws", b"Sec-WebSocket-Protocol: a, b"))
    await app.accept("a")
    out = bytes(session.transport.out)
    assert out.startswith(b"HTTP/1.1 101 ") and f"Sec-WebSocket-Accept: {ACCEPT}".encode() in out
    assert b"Sec-WebSocket-Protocol: a\r\n" in out
    session.listener.data_received(masked(1, b"hi") + masked(2, b"\x00\x01"))
    assert await app.receive() == {"type": "websocket.receive", "text": "hi"}
    assert await app.receive() == {"type": "websocket.receive", "bytes": b"\x00\x01"}
    await app.send({"type": "websocket.send", "text": "hello"})
    await app.send({"type": "websocket.send", "bytes": b"\x02"})
    assert parse_frames(session.transport.take()[len(out) :]) == [
        (1, True, b"hello"),
        (2, True, b"\x02"),
    ]
    await app.end(session.ws)
    assert parse_frames(session.transport.take()) == [(8, True, close_payload(1000))]


async def test_early_bytes_are_read_as_frames_after_an_accept() -> None:
    app = App()
    session = await handshake(app, request() + masked(1, b"early"))
    await app.accept()
    assert await app.receive() == {"type": "websocket.receive", "text": "early"}
    await app.end(session.ws)


async def test_a_frame_split_across_reads_is_delivered_whole() -> None:
    app = App()
    session = await accepted(app)
    raw = masked(1, b"x" * 200)
    session.listener.data_received(raw[:1])
    session.listener.data_received(raw[1:3])
    session.listener.data_received(raw[3:150])
    assert not session.ws._messages
    session.listener.data_received(raw[150:])
    assert await app.receive() == {"type": "websocket.receive", "text": "x" * 200}
    await app.end(session.ws)


async def test_a_fragmented_message_with_a_ping_between_is_one_message() -> None:
    app = App()
    session = await accepted(app)
    session.listener.data_received(
        masked(1, "hé".encode()[:2], fin=False) + masked(9, b"p1")
        + masked(0, "hé".encode()[2:], fin=False) + masked(0, b"!")
    )  # fmt: skip
    assert await app.receive() == {"type": "websocket.receive", "text": "hé!"}
    assert parse_frames(session.transport.take()) == [(10, True, b"p1")]  # the pong
    await app.end(session.ws)


async def test_a_client_close_is_answered_and_told_to_the_app() -> None:
    app = App()
    session = await accepted(app)
    session.listener.data_received(masked(8, close_payload(1001, b"bye")))
    assert parse_frames(session.transport.take()) == [(8, True, close_payload(1001, b"bye"))]
    assert session.transport.closed
    session.listener.connection_lost(None)
    assert await app.receive() == {"type": "websocket.disconnect", "code": 1001}
    assert await app.receive() == {"type": "websocket.disconnect", "code": 1001}  # stays
    with pytest.raises(ClientDisconnected):
        await app.send({"type": "websocket.send", "text": "late"})
    assert issubclass(ClientDisconnected, OSError)
    await app.end(session.ws)


async def test_a_lost_connection_is_a_disconnect_with_1006() -> None:
    app = App()
    session = await accepted(app)
    session.listener.connection_lost(ConnectionResetError())
    assert await app.receive() == {"type": "websocket.disconnect", "code": 1006}
    await app.end(session.ws)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (masked(1, b"\xff\xfe"), 1007),  # invalid UTF-8
        (masked(1, "é".encode()[:1], fin=False) + masked(0, "é".encode()[1:] + b"\xff"), 1007),
        (unmasked(1, b"hi"), 1002),  # a client must mask
        (masked(0, b"no start"), 1002),
        (masked(1, b"x", fin=False) + masked(2, b"y"), 1002),  # a new message mid-message
    ],
    ids=["utf8", "utf8-fragmented", "unmasked", "stray-continuation", "interleaved"],
)
async def test_protocol_violations_close_with_websockets_codes(data: bytes, code: int) -> None:
    app = App()
    session = await accepted(app)
    session.listener.data_received(data)
    frames = parse_frames(session.transport.take())
    assert frames[-1][0] == 8 and int.from_bytes(frames[-1][2][:2], "big") == code
    assert session.transport.closed
    assert not any(m.get("type") == "websocket.receive" for m in session.ws._messages)
    session.listener.connection_lost(None)
    await app.end(session.ws)


async def test_a_message_far_over_the_limit_is_refused_with_1009_before_it_arrives() -> None:
    app = App()
    session = await accepted(app, max_message_bytes=1024)  # websockets' limit: twice that
    big = masked(2, b"b" * 4096)
    session.listener.data_received(big[:100])  # the frame's length is enough to refuse it
    frames = parse_frames(session.transport.take())
    assert frames == [(8, True, frames[0][2])] and frames[0][2][:2] == close_payload(1009)
    await app.end(session.ws)


async def test_reading_pauses_when_the_app_falls_behind_and_resumes() -> None:
    app = App()
    session = await accepted(app)
    for i in range(16):
        session.listener.data_received(masked(1, str(i).encode()))
    assert not session.transport.reading
    for i in range(8):
        assert await app.receive() == {"type": "websocket.receive", "text": str(i)}
    assert session.transport.reading
    await app.end(session.ws)


async def test_send_waits_while_the_client_does_not_read() -> None:
    app = App()
    session = await accepted(app)
    session.listener.pause_writing()
    sending = asyncio.ensure_future(app.send({"type": "websocket.send", "text": "x"}))
    await asyncio.sleep(0)
    assert not sending.done()
    session.listener.resume_writing()
    await asyncio.wait_for(sending, 30)
    await app.end(session.ws)


async def test_an_app_close_waits_for_the_client_then_drops_the_socket() -> None:
    app = App()
    session = await accepted(app)
    await app.send({"type": "websocket.close", "code": 4000, "reason": "done"})
    assert parse_frames(session.transport.take()) == [(8, True, close_payload(4000, b"done"))]
    assert not session.transport.closed and 10 in session.timers.armed()
    session.timers.fire(10)  # no close frame back in time
    assert session.transport.aborted
    await app.end(session.ws)


async def test_an_app_close_answered_by_the_client_closes_the_socket() -> None:
    app = App()
    session = await accepted(app)
    await app.send({"type": "websocket.close", "code": 1000})
    session.listener.data_received(masked(8, close_payload(1000)))
    assert session.transport.closed and not session.transport.aborted
    await app.end(session.ws)
