"""Headroom's client WebSocket server (proxy.relay.ws_server), driven through the client
listener on a fake transport: the ASGI scope and extensions, websockets' refusals, the
take-over (101, early bytes, what an ASGI-accepted connection carries over), frames
while the app holds an accepted connection, keepalive, failures and shut-down. Timers
are recorded and fired by the test; no real time passes. The last tests run a real
server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedOK

from proxy.process.serving import running_server
from proxy.relay.listener import ClientListener, client_listener
from proxy.relay.ws_server import (
    EARLY_LIMIT,
    ClientDisconnected,
    ClientWebSocket,
    WebSocketSessions,
)
from proxy.settings import LimitsSettings
from tests.unit.test_listener import Timers, Transport, open_listener, settle
from tests.unit.test_splice import Harness, client_frame, parse_frames

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
        (bytes((0xC1,)) + masked(1, b"x")[1:], 1002),  # a reserved bit
        (masked(9, b"p" * 126), 1002),  # a control frame over 125 bytes
        (masked(9, b"p", fin=False), 1002),  # a fragmented control frame
        (masked(8, close_payload(999)), 1002),  # a close code no peer may send
        (masked(8, close_payload(1000, b"\xff")), 1007),  # a close reason not in UTF-8
        (masked(1, b"x", fin=False) + masked(8, close_payload(1000)), 1002),  # mid-message
    ],
    ids=["utf8", "utf8-fragmented", "unmasked", "stray-continuation", "interleaved", "rsv",
         "long-ping", "fragmented-ping", "close-code", "close-utf8", "close-mid-message"],
)  # fmt: skip
async def test_protocol_violations_close_with_their_codes(data: bytes, code: int) -> None:
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
    session = await accepted(app, max_message_bytes=1024)  # the limit here: twice that
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


# -- taking over a connection accepted through ASGI (queue feedback) ----------------------


async def test_take_over_after_accept_carries_everything_over_in_order() -> None:
    """Held messages, then the messages the app did not read, then the fragments of the
    message being assembled, then the frame still arriving: the relay reads them as the
    client sent them, and the rest of the message follows on the socket."""
    app = App()
    session = await accepted(app, ping_interval_s=20, ping_timeout_s=20)
    transport, timers = session.transport, session.timers
    assert timers.armed() == [20]  # the keepalive runs while the client waits
    await app.send({"type": "websocket.send", "text": '{"type": "headroom.queue"}'})
    cont = masked(0, b"-end", fin=True)
    session.listener.data_received(
        masked(2, b"queued") + masked(1, b"frag", fin=False) + cont[:3]
    )  # fmt: skip
    await app.send({"type": "websocket.send", "text": '{"type": "headroom.admitted"}'})
    written = bytes(transport.out)
    harness = Harness()
    held = [{"type": "websocket.receive", "text": "held-1"},
            {"type": "websocket.receive", "bytes": b"held-2"}]  # fmt: skip
    taken = app.take_over(None, [], harness.splice.client, lambda: None, held)
    assert taken is not None
    client, early = taken
    assert client is transport and transport.protocol is harness.splice.client
    assert bytes(transport.out) == written  # no second handshake answer
    assert timers.armed() == []  # no keepalive ping mid-stream
    assert early.endswith(cont[:3])
    assert parse_frames(early[:-3]) == [
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
    assert app.take_over(None, [], harness.splice.client, lambda: None) is None  # once
    assert not session.ws._reading and not session.ws._fragments  # nothing read here now
    with pytest.raises(RuntimeError):
        await app.send({"type": "websocket.send", "text": "stray"})
    await app.end(session.ws)


@pytest.mark.parametrize("cut", [1, 2, 5, 8, 100, 299])
async def test_a_frame_still_arriving_at_the_take_over_is_carried_whole(cut: int) -> None:
    app = App()
    session = await accepted(app)
    raw = masked(2, b"z" * 300)
    session.listener.data_received(masked(1, b"whole") + raw[:cut])
    taken = app.take_over(None, [], asyncio.Protocol(), lambda: None)
    assert taken is not None
    assert taken[1].endswith(raw[:cut])
    assert parse_frames(taken[1][:-cut]) == [(1, True, b"whole")]
    await app.end(session.ws)


async def test_a_take_over_resumes_reading_paused_for_the_app() -> None:
    app = App()
    session = await accepted(app)
    for i in range(16):
        session.listener.data_received(masked(1, str(i).encode()))
    assert not session.transport.reading
    taken = app.take_over(None, [], asyncio.Protocol(), lambda: None)
    assert taken is not None and len(parse_frames(taken[1])) == 16
    assert session.transport.reading
    await app.end(session.ws)


async def test_no_take_over_after_the_client_closed_while_waiting() -> None:
    app = App()
    session = await accepted(app)
    session.listener.data_received(masked(8, close_payload(1000)))
    assert session.transport.closed
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.end(session.ws)


async def test_no_take_over_after_the_client_left_before_an_accept() -> None:
    app = App()
    session = await handshake(app)
    session.listener.connection_lost(None)
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    assert session.transport.out == b""
    await app.end(session.ws)


async def test_a_disconnect_not_yet_read_forbids_the_take_over() -> None:
    app = App()
    session = await accepted(app)
    session.listener.data_received(masked(1, b"unread"))
    session.listener.connection_lost(None)
    session.transport.closed = False  # as if the transport had not said so yet
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.end(session.ws)


async def test_no_take_over_after_an_http_denial() -> None:
    app = App()
    session = await handshake(app)
    assert await app.receive() == {"type": "websocket.connect"}
    headers = [(b"retry-after", b"3"), (b"connection", b"keep-alive")]
    await app.send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.send({"type": "websocket.http.response.body", "body": b"busy ", "more_body": True})
    assert session.transport.out == b""
    await app.send({"type": "websocket.http.response.body", "body": b"now"})
    out = bytes(session.transport.out)
    assert out.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"retry-after: 3\r\n" in out and b"keep-alive" not in out
    assert b"content-length: 8\r\n" in out and out.endswith(b"\r\n\r\nbusy now")
    assert session.transport.closed
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.end(session.ws)


async def test_no_take_over_after_the_app_closed() -> None:
    app = App()
    session = await accepted(app)
    await app.send({"type": "websocket.close", "code": 1008})
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.end(session.ws)


async def test_a_close_before_an_accept_is_a_403() -> None:
    app = App()
    session = await handshake(app)
    await app.send({"type": "websocket.close", "code": 1008})
    assert session.transport.out.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert session.transport.closed
    assert app.take_over(None, [], asyncio.Protocol(), lambda: None) is None
    await app.end(session.ws)


async def test_gone_is_done_when_the_connection_is_lost() -> None:
    """The ``gone`` future a session not yet accepted races its waits against: done
    when the client's connection is lost, the same future each time, and done at once
    when asked for after the loss."""
    app = App()
    session = await handshake(app)
    gone = app.scope["extensions"]["headroom.splice"]["gone"]
    first = gone()
    assert gone() is first and not first.done()
    session.listener.connection_lost(None)
    assert first.done() and first.result() is None
    assert await app.receive() == {"type": "websocket.connect"}
    assert (await app.receive())["type"] == "websocket.disconnect"  # ASGI is told too
    await app.end(session.ws)

    late = App()
    session = await handshake(late)
    session.listener.connection_lost(None)
    assert late.scope["extensions"]["headroom.splice"]["gone"]().done()
    await late.end(session.ws)


# -- the app's failures ----------------------------------------------------------------------


async def test_an_app_raising_before_an_accept_gets_500() -> None:
    app = App()
    session = await handshake(app)
    app.raises = ValueError("boom")
    await app.end(session.ws)
    assert session.transport.out.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert session.transport.closed


async def test_an_app_raising_after_an_accept_closes_with_1011() -> None:
    app = App()
    session = await accepted(app)
    app.raises = ValueError("boom")
    await app.end(session.ws)
    assert parse_frames(session.transport.take()) == [(8, True, close_payload(1011))]


async def test_an_app_returning_without_an_answer_gets_500() -> None:
    app = App()
    session = await handshake(app)
    await app.end(session.ws)
    assert session.transport.out.startswith(b"HTTP/1.1 500 ")


async def test_an_app_stopped_by_a_client_disconnect_is_not_answered() -> None:
    app = App()
    session = await accepted(app)
    session.listener.connection_lost(None)
    app.raises = ClientDisconnected("gone")
    await app.end(session.ws)
    assert session.transport.out == b""


async def test_a_cancelled_app_before_an_accept_gets_500_and_stays_cancelled() -> None:
    app = App()
    session = await handshake(app)
    (task,) = session.ws.sessions.live.values()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert session.transport.out.startswith(b"HTTP/1.1 500 ")


async def test_unexpected_asgi_messages_raise() -> None:
    app = App()
    session = await handshake(app)
    with pytest.raises(RuntimeError, match=r"websocket\.send"):
        await app.send({"type": "websocket.send", "text": "before accept"})
    await app.accept()
    with pytest.raises(RuntimeError, match=r"websocket\.accept"):
        await app.send({"type": "websocket.accept"})
    await app.end(session.ws)


# -- keepalive ------------------------------------------------------------------------------


async def test_keepalive_pings_and_a_missing_pong_fails_with_1011() -> None:
    app = App()
    session = await accepted(app, ping_interval_s=20, ping_timeout_s=20)
    transport, timers = session.transport, session.timers
    assert timers.armed() == [20]
    timers.fire(20)
    ((opcode, _, payload),) = parse_frames(transport.take())
    assert opcode == 9 and payload
    session.listener.data_received(masked(10, payload))  # the pong
    timers.fire(20)
    ((opcode, _, _),) = parse_frames(transport.take())  # the next ping
    assert opcode == 9
    session.listener.data_received(masked(10, b"not the payload"))
    timers.fire(20)  # no pong for the last ping
    assert parse_frames(transport.take()) == [
        (8, True, close_payload(1011, b"keepalive ping timeout"))
    ]
    assert transport.closed
    await app.end(session.ws)


async def test_no_keepalive_when_the_interval_is_zero() -> None:
    app = App()
    session = await accepted(app, ping_interval_s=0)
    assert session.timers.armed() == []
    await app.end(session.ws)


async def test_a_pong_may_take_the_whole_ping_timeout() -> None:
    app = App()
    session = await accepted(app, ping_interval_s=5, ping_timeout_s=20)
    session.timers.fire(5)
    ((opcode, _, _),) = parse_frames(session.transport.take())
    assert opcode == 9
    session.timers.fire(5)  # 5 s after the ping: still within ping_timeout_s
    assert not session.transport.closed
    await app.end(session.ws)


async def test_pings_are_sent_every_ping_interval() -> None:
    app = App()
    session = await accepted(app, ping_interval_s=20, ping_timeout_s=5)
    session.timers.fire(20)
    ((_, _, payload),) = parse_frames(session.transport.take())
    session.listener.data_received(masked(10, payload))
    assert session.timers.armed() == [20]
    await app.end(session.ws)


# -- shut-down -------------------------------------------------------------------------------


async def test_shutdown_tells_every_session() -> None:
    sessions = WebSocketSessions()
    apps = [App() for _ in range(4)]
    states = []
    for app in apps:
        listener, transport, timers = open_listener(app=app, sessions=sessions)
        listener.data_received(request())
        await app.started.wait()
        states.append(Session(listener, transport, timers))
    waiting, open_, taken, left = states
    await apps[1].accept()
    open_.transport.take()
    stopped: list[str] = []
    assert apps[2].take_over(None, [], asyncio.Protocol(), lambda: stopped.append("taken"))
    taken.transport.take()
    left.listener.connection_lost(None)
    sessions.shutdown()
    assert waiting.transport.out.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"server shutting down" in waiting.transport.out and waiting.transport.closed
    assert parse_frames(open_.transport.take()) == [
        (8, True, close_payload(1012, b"server shutting down"))
    ]
    assert stopped == ["taken"] and taken.transport.out == b""
    assert left.transport.out == b""
    for app in apps:
        app.release.set()
    await sessions.wait(30)
    assert not sessions.live


async def test_shutdown_waits_then_cancels_what_is_left() -> None:
    sessions = WebSocketSessions()

    async def stuck(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.Event().wait()

    listener, transport, _ = open_listener(app=stuck, sessions=sessions)
    listener.data_received(request())
    await settle(lambda: bool(sessions.live))
    (task,) = sessions.live.values()
    await sessions.wait(0)
    assert task.cancelled() and not sessions.live
    assert transport.out.startswith(b"HTTP/1.1 500 ")  # cancelled before an answer


# -- memory ----------------------------------------------------------------------------------


async def _refusing(scope: Any, receive: Any, send: Any) -> None:
    await receive()  # websocket.connect
    await send({"type": "websocket.close", "code": 1008})


async def _taking(scope: Any, receive: Any, send: Any) -> None:
    scope["extensions"]["headroom.splice"]["take_over"](None, [], asyncio.Protocol(), lambda: None)


async def _accepting(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "websocket.accept"})
    await receive()  # the client's first message: admitted
    scope["extensions"]["headroom.splice"]["take_over"](None, [], asyncio.Protocol(), lambda: None)


@pytest.mark.parametrize(
    "app", [_refusing, _taking, _accepting], ids=["refused", "spliced", "accepted-spliced"]
)
async def test_a_finished_connection_is_freed_without_the_garbage_collector(app: Any) -> None:
    """The scope's ``headroom.splice`` extension (a bound take_over) and httptools'
    callbacks tied the objects of a connection together: they go with their last
    reference, not in a later collection."""
    sessions = WebSocketSessions()
    gc.disable()
    try:
        listener, transport, timers = open_listener(app=app, sessions=sessions)
        listener.data_received(request())
        ws = listener._ws
        assert ws is not None
        await settle(lambda: bool(sessions.live))
        listener.data_received(masked(1, b"go"))
        await settle(lambda: not sessions.live)
        assert transport.out.startswith(b"HTTP/1.1 403" if app is _refusing else b"HTTP/1.1 101")
        assert "headroom.splice" not in ws.scope["extensions"]
        if app is _refusing:
            listener.connection_lost(None)
        refs = [weakref.ref(listener), weakref.ref(ws)]
        timers.pending.clear()  # cancelled timers (the loop drops them)
        del listener, ws
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


# -- on a real socket ------------------------------------------------------------------------


class Recorder(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.more = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.more.set()


async def test_a_real_connection_is_taken_over_with_its_early_bytes() -> None:
    recorder = Recorder()
    taken: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        taken.append(scope["extensions"]["headroom.splice"]["take_over"](
            "chat", [], recorder, lambda: None
        ))  # fmt: skip

    listener = client_listener(app, LimitsSettings, WebSocketSessions())
    async with running_server(app, http=listener, lifespan="off") as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(request(b"/ws", b"Sec-WebSocket-Protocol: chat") + b"early")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
            assert f"Sec-WebSocket-Accept: {ACCEPT}\r\n".encode() in head
            assert b"Sec-WebSocket-Protocol: chat\r\n" in head
            (result,) = taken
            assert result is not None and result[1] == b"early"
            writer.write(b"later")
            while bytes(recorder.data) != b"later":
                recorder.more.clear()
                await asyncio.wait_for(recorder.more.wait(), 30)
            result[0].close()
        finally:
            writer.close()


async def test_a_real_client_talks_to_an_app_that_accepts() -> None:
    async def echo(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept", "subprotocol": "b"})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") == "bye":
                await send({"type": "websocket.close", "code": 1000, "reason": "bye"})
                return
            await send({"type": "websocket.send", **{k: v for k, v in message.items()
                                                     if k in ("text", "bytes")}})  # fmt: skip

    listener = client_listener(echo, LimitsSettings, WebSocketSessions())
    async with (
        running_server(echo, http=listener, lifespan="off") as server,
        connect(f"{server.ws_url}/echo", subprotocols=["a", "b"], compression=None) as ws,  # type: ignore[list-item]
    ):
        assert ws.subprotocol == "b"
        await ws.send("héllo")
        assert await asyncio.wait_for(ws.recv(), 30) == "héllo"
        await ws.send(b"\x00" * 70_000)
        assert await asyncio.wait_for(ws.recv(), 30) == b"\x00" * 70_000
        await ws.send("bye")
        with pytest.raises(ConnectionClosedOK):
            await asyncio.wait_for(ws.recv(), 30)
        assert ws.close_code == 1000 and ws.close_reason == "bye"
