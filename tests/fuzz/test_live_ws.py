"""Malformed WebSocket traffic against a live proxy (real sockets, raw frames).

Every case must end with a clear answer -- an HTTP 4xx to a broken handshake, or a close
code (1002 protocol, 1007 bad UTF-8, 1008 policy, 1009 too big, 1014 upstream) -- or a
closed connection, never a 1011 or an HTTP 500, never a hang; afterwards the slot is
free and a normal session still works. The first half is a catalogue of named cases,
the second a hypothesis campaign over random frame sequences.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsraw import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    Closed,
    close_frame,
    frame,
    handshake_request,
    read_frames,
    read_head,
    reset,
)

from tests.fuzz.conftest import MAX_MESSAGE, ROUTES, Live, fuzz_settings, normal_session

#: Close codes a client may legitimately get for a malformed session.
ALLOWED_CLOSES = {1000, 1001, 1002, 1005, 1007, 1008, 1009, 1013, 1014}


pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Result:
    status: int | None  # HTTP status of the handshake (None: no answer)
    closed: Closed | None  # after a 101


async def exchange(
    live: Live,
    path: str,
    payload: bytes,
    *,
    before: bytes = b"",
    end: str = "wait",
    wait_s: float = 15.0,
) -> Result:
    """Handshake on ``path`` (after ``before`` bytes), send ``payload``, then ``end``:
    ``wait`` for the server to close, ``eof`` (FIN), ``rst``; returns what came back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(before + handshake_request(path))
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
        if head is None:
            return Result(None, None)
        if head.status != 101:
            return Result(head.status, None)
        writer.write(payload)
        await writer.drain()
        if end == "rst":
            reset(writer)
            return Result(101, None)
        if end == "eof":
            writer.write_eof()
        return Result(101, await read_frames(reader, head.rest, timeout=wait_s))
    except (ConnectionError, OSError):
        return Result(None, None)
    finally:
        writer.close()


async def after(live: Live) -> None:
    """The slot comes back and the proxy still serves a normal session."""
    await live.settled()
    await normal_session(live.port)
    await live.settled()


def text(payload: bytes, **kw: object) -> bytes:
    return frame(OP_TEXT, payload, **kw)  # type: ignore[arg-type]


CONFIG = json.dumps({"type": "session.config", "response_format": "pcm"}).encode()

#: name -> (route, frames sent after the handshake, acceptable close codes)
CASES: dict[str, tuple[str, bytes, set[int]]] = {
    "over Headroom's limit (1008)": ("speech", frame(OP_BINARY, bytes(MAX_MESSAGE + 1)), {1008}),
    # Headroom reads the declared length from the frame header: no payload is buffered
    "far over the limit (1008)": ("speech", frame(OP_BINARY, bytes(3 * MAX_MESSAGE)), {1008}),
    "declared 2**62 bytes (1008)": ("speech", frame(OP_BINARY, b"", length=1 << 62), {1008}),
    "text over the limit (1008)": ("realtime", text(b"a" * (MAX_MESSAGE + 1)), {1008}),
    "invalid UTF-8 (1007)": ("speech", text(b"\xff\xfe"), {1007}),
    "truncated UTF-8 (1007)": ("speech", text(b"caf\xc3"), {1007}),
    "UTF-16 surrogate (1007)": ("realtime", text(b"\xed\xa0\x80"), {1007}),
    "overlong encoding (1007)": ("realtime", text(b"\xc0\xaf"), {1007}),
    "invalid UTF-8 across fragments (1007)": (
        "speech",
        text(b"ok \xe2\x82", fin=False) + frame(OP_CONT, b"\x28"),
        {1007},
    ),
    "unmasked client frame (1002)": ("speech", text(CONFIG, mask=False), {1002}),
    "reserved opcode 0x3 (1002)": ("speech", frame(0x3, b"x"), {1002}),
    "reserved control opcode 0xB (1002)": ("speech", frame(0xB, b""), {1002}),
    "RSV1 without an extension (1002)": ("speech", text(CONFIG, rsv=4), {1002}),
    "ping over 125 bytes (1002)": ("speech", frame(OP_PING, bytes(126)), {1002}),
    "fragmented ping (1002)": ("speech", frame(OP_PING, b"x", fin=False), {1002}),
    "continuation without a start (1002)": ("speech", frame(OP_CONT, b"x"), {1002}),
    "new message inside a fragmented one (1002)": (
        "speech",
        text(b"{", fin=False) + text(b"{}"),
        {1002},
    ),
    "close code 999 (1002)": ("speech", close_frame(999), {1002}),
    "close code 1005 on the wire (1002)": ("speech", close_frame(1005), {1002}),
    "close code 5000 (1002)": ("speech", close_frame(5000), {1002}),
    "one-byte close payload (1002)": ("speech", frame(OP_CLOSE, b"\x03"), {1002}),
    "close reason not UTF-8 (1007)": ("speech", close_frame(1000, b"\xff"), {1007}),
    "close 4001 from the client": ("speech", close_frame(4001, b"bye"), {4001, 1000}),
    "data after the close frame": ("speech", close_frame(1000) + text(CONFIG), {1000}),
    "unsolicited pong": ("realtime", frame(OP_PONG, b"p") + close_frame(1000), {1000}),
}


@pytest.mark.parametrize("name", list(CASES))
async def test_malformed_frames_get_a_clear_close(live: Live, name: str) -> None:
    route, payload, codes = CASES[name]
    result = await exchange(live, ROUTES[route], payload)
    assert result.status == 101, result
    assert result.closed is not None
    assert result.closed.code in codes, (name, result.closed)
    await after(live)


async def test_binary_on_a_text_only_protocol_is_relayed_and_the_upstream_decides(
    live: Live,
) -> None:
    """vLLM realtime is JSON text only; Headroom relays a binary frame anyway (it does not
    police the upstream's protocol) and the upstream answers with its own error."""
    result = await exchange(live, ROUTES["realtime"], frame(OP_BINARY, os.urandom(64)))
    assert result.closed is not None
    texts = [p for op, p in result.closed.frames if op == OP_TEXT]
    assert any(b"invalid_event" in t for t in texts), result.closed
    assert result.closed.code in ALLOWED_CLOSES, result.closed
    await after(live)


@pytest.mark.parametrize("end", ["eof", "rst"])
@pytest.mark.parametrize(
    "payload",
    [
        frame(OP_BINARY, bytes(100))[:30],  # header says 100 bytes, 28 of them arrive
        frame(OP_BINARY, b"", length=1 << 20)[:10],  # a long frame's header only
        b"\x81",  # one byte of a frame header
        text(b'{"type": "session.con', fin=False),  # a first fragment, then nothing
    ],
    ids=["mid-payload", "after-header", "mid-header", "after-first-fragment"],
)
async def test_abrupt_end_mid_frame_frees_the_slot(live: Live, payload: bytes, end: str) -> None:
    result = await exchange(live, ROUTES["speech"], payload, end=end)
    assert result.status == 101
    if result.closed is not None:
        assert result.closed.code in ALLOWED_CLOSES | {None}, result.closed
    await after(live)


async def test_fragment_then_silence_is_closed_by_the_proxy(live: Live) -> None:
    """The client starts a message and never finishes it: no message ever reaches the
    relay, so the idle timeout (1 s here) or the upstream's own config timeout ends it."""
    result = await exchange(live, ROUTES["speech"], text(b'{"type":', fin=False))
    assert result.closed is not None and not result.closed.timeout, result.closed
    assert result.closed.code in {1008, 1014}, result.closed
    await after(live)


@pytest.mark.parametrize(
    "before",
    [
        os.urandom(64),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello on plain HTTP
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",  # a pipelined request
        b"\r\n\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    ],
    ids=["random", "tls-hello", "pipelined-get", "blank-lines", "h2-preface"],
)
async def test_garbage_before_the_handshake_is_refused(live: Live, before: bytes) -> None:
    result = await exchange(live, ROUTES["speech"], CONFIG, before=before)
    if result.status is not None:
        assert result.status in (101, 200, 400, 404, 405, 426), result.status
    await after(live)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n",  # no key
        b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: short\r\nSec-WebSocket-Version: 13\r\n\r\n",  # bad key
        b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 8\r\n\r\n",
        b"GET /v1/realtime HTTP/1.0\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 70000 + b"\r\n\r\n",
        b"GET /v1/realtime HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(5000))
        + b"\r\n",
    ],
    ids=["not-http", "no-key", "bad-key", "version-8", "http-1.0", "huge-header",
         "many-headers"],
)  # fmt: skip
async def test_broken_handshakes_get_an_http_error(live: Live, request_bytes: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(request_bytes)
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
    except (ConnectionError, OSError):
        head = None
    finally:
        writer.close()
    if head is not None:
        assert 400 <= head.status < 500, head.status
    assert live.active == 0
    await after(live)


# -- a campaign over random frame sequences ----------------------------------------------------

_opcodes = st.sampled_from([OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, 0x3, 0xB])
_payloads = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=80).map(str.encode),
    st.sampled_from([CONFIG, b'{"type": "input.text", "text": "Hi."}', b'{"type": "input.done"}',
                     b'{"type": "session.update"}', b"\xff\xfe", b"\xed\xa0\x80", b"\x03\xe8"]),
)  # fmt: skip
_frames = st.builds(
    lambda op, payload, fin, rsv, mask: frame(op, payload, fin=fin, rsv=rsv, mask=mask),
    _opcodes,
    _payloads,
    st.booleans() | st.just(True),
    st.sampled_from([0, 0, 0, 1, 4]),
    st.booleans() | st.just(True) | st.just(True),
)
_chunks = st.one_of(
    _frames,
    _frames,
    _frames,
    st.binary(min_size=1, max_size=64),  # raw garbage
    st.builds(lambda n: frame(OP_BINARY, b"", length=n), st.integers(1 << 17, 1 << 63 - 1)),
    st.builds(lambda f, k: f[: max(1, len(f) - k)], _frames, st.integers(1, 8)),  # truncated
)


@fuzz_settings(60)
@given(
    route=st.sampled_from(["speech", "realtime", "passthrough"]),
    chunks=st.lists(_chunks, max_size=6),
    end=st.sampled_from(["wait", "wait", "eof", "rst"]),
)
async def test_random_frame_sequences(
    live: Live, route: str, chunks: list[bytes], end: str
) -> None:
    result = await exchange(live, ROUTES[route], b"".join(chunks), end=end)
    assert result.status in (101, None), result
    if result.closed is not None:
        assert not result.closed.timeout, result.closed
        if result.closed.code is not None:
            assert result.closed.code in ALLOWED_CLOSES, result.closed
    await live.settled()
    await normal_session(live.port)
