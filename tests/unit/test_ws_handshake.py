"""The handshake's pieces (proxy.relay.ws_handshake): the RFC 6455 checks agree with
websockets' own handshake code, refusals are websockets', frame boundaries and the
frames rebuilt for a take-over are exact, and the HTTP answers are whole."""

from __future__ import annotations

import base64
import hashlib

import pytest
from websockets.datastructures import Headers
from websockets.http11 import Request
from websockets.server import ServerProtocol

from proxy.relay.ws_handshake import build_scope, handshake_key, http_response, refusal_for

KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
BASE = [
    (b"host", b"x"),
    (b"upgrade", b"websocket"),
    (b"connection", b"Upgrade"),
    (b"sec-websocket-key", KEY),
    (b"sec-websocket-version", b"13"),
]


def _without(name: bytes) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in BASE if n != name]


def _with(name: bytes, value: bytes) -> list[tuple[bytes, bytes]]:
    return [*_without(name), (name, value)]


HEADER_SETS = {
    "valid": BASE,
    "keep-alive-upgrade": _with(b"connection", b"keep-alive, Upgrade"),
    "upper-websocket": _with(b"upgrade", b"WebSocket"),
    "subprotocols": [
        *BASE,
        (b"sec-websocket-protocol", b"a, b"),
        (b"sec-websocket-protocol", b"c"),
    ],
    "no-key": _without(b"sec-websocket-key"),
    "short-key": _with(b"sec-websocket-key", b"c2hvcnQ="),
    "bad-key": _with(b"sec-websocket-key", b"!!!!!!!!!!!!!!!!!!!!!!!="),
    "two-keys": [*BASE, (b"sec-websocket-key", KEY)],
    "no-version": _without(b"sec-websocket-version"),
    "version-12": _with(b"sec-websocket-version", b"12"),
    "two-versions": [*BASE, (b"sec-websocket-version", b"13")],
    "no-connection": _without(b"connection"),
    "connection-keep-alive": _with(b"connection", b"keep-alive"),
    "no-upgrade": _without(b"upgrade"),
    "upgrade-h2c": _with(b"upgrade", b"h2c"),
    "two-upgrades": [*BASE, (b"upgrade", b"websocket")],
    "no-key-padding": _with(b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ"),
    "upgrade-list": _with(b"upgrade", b"websocket, h2c"),
    "connection-two-lines": [*_with(b"connection", b"keep-alive"), (b"connection", b"Upgrade")],
    "connection-no-space": _with(b"connection", b"keep-alive,upgrade"),
    "subprotocols-empty-item": [*BASE, (b"sec-websocket-protocol", b"a,,b")],
    "extensions": [*BASE, (b"sec-websocket-extensions", b"permessage-deflate")],
}


def _websockets_accepts(headers: list[tuple[bytes, bytes]]) -> tuple[bool, str | None]:
    conn = ServerProtocol()
    request = Request("/ws", Headers((n.decode(), v.decode()) for n, v in headers))
    response = conn.accept(request)
    accept = response.headers.get("Sec-WebSocket-Accept")
    return response.status_code == 101, accept


@pytest.mark.parametrize(
    "headers",
    [
        *(pytest.param(headers, id=name) for name, headers in HEADER_SETS.items()),
        pytest.param([*BASE, (b"sec-websocket-protocol", b"a b")], id="subprotocol-space"),
        pytest.param([*BASE, (b"sec-websocket-protocol", b"")], id="subprotocol-empty"),
    ],
)  # fmt: skip
def test_the_checks_agree_with_websockets(headers: list[tuple[bytes, bytes]]) -> None:
    ours = handshake_key(headers)
    accepted, accept = _websockets_accepts(headers)
    assert (ours is not None) == accepted
    if ours is not None:
        assert ours[0] == accept


def test_the_accept_key_is_rfc_6455s() -> None:
    checked = handshake_key(BASE)
    assert checked == ("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=", [])
    key = base64.b64encode(bytes(range(16)))
    expected = base64.b64encode(
        hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
    ).decode()
    assert handshake_key(_with(b"sec-websocket-key", key)) == (expected, [])


def test_subprotocols_are_every_offered_token_in_order() -> None:
    checked = handshake_key(HEADER_SETS["subprotocols"])
    assert checked is not None and checked[1] == ["a", "b", "c"]


@pytest.mark.parametrize("name", [n for n in HEADER_SETS if handshake_key(HEADER_SETS[n]) is None])
def test_refusals_are_websockets_answers(name: str) -> None:
    out = refusal_for(b"/ws", HEADER_SETS[name])
    status = int(out.split(b" ", 2)[1])
    assert status in (400, 426)
    assert b"Failed to open a WebSocket connection" in out
    assert b"\r\nConnection: close\r\n" in out


def test_a_valid_handshake_to_a_bad_target_is_refused_400() -> None:
    out = refusal_for(b"http://example.com/ws", BASE)
    assert out.startswith(b"HTTP/1.1 400 Bad Request\r\n")


@pytest.mark.parametrize("target", [b"*", b"http://x/ws", "/café".encode(), b""])
def test_a_scope_needs_an_absolute_ascii_path(target: bytes) -> None:
    scope = build_scope(scheme="ws", server=None, client=None, root_path="", target=target,
                        headers=BASE, subprotocols=[], state={})  # fmt: skip
    assert scope is None


def test_an_http_response_is_whole_and_ends_the_connection() -> None:
    out = http_response(503, [(b"retry-after", b"3"), (b"Connection", b"keep-alive")], b"busy", 1e9)
    assert out.startswith(
        b"HTTP/1.1 503 Service Unavailable\r\ndate: Sun, 09 Sep 2001 01:46:40 GMT\r\n"
    )
    assert b"retry-after: 3\r\n" in out and b"keep-alive" not in out
    assert out.endswith(b"content-length: 4\r\nconnection: close\r\n\r\nbusy")
    own = http_response(200, [(b"Content-Length", b"4")], b"body", 1e9)
    assert own.lower().count(b"content-length") == 1
    later = http_response(299, [], b"", 1e9 + 1)
    assert later.startswith(b"HTTP/1.1 299 \r\ndate: Sun, 09 Sep 2001 01:46:41 GMT\r\n")
