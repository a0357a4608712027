"""The splice relay (proxy.relay.splice) on in-memory transports: byte-exact forwarding
however the stream is cut, metering of every message, limits, closing handshakes,
back-pressure and keepalive. Timing comes from a FakeClock; nothing sleeps."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.clock import FakeClock
from proxy.relay.session_record import SessionRecord
from proxy.relay.splice import Splice, _Keepalive, close_frame, frame
from proxy.settings import LimitsSettings
from tests.hypothesis_profiles import examples


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()
        self.reading = True
        self.closed = False
        self.aborted = False
        self.protocol: Any = None

    def write(self, data: Any) -> None:
        assert not self.closed, "write after close"
        self.data += bytes(data)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


@dataclass
class Recorder:
    """A WsAdapter that records what it is given."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    reads_binary: bool = True

    def client_text(self, now: float, text: str) -> None:
        self.events.append(("client_text", text))

    def client_binary(self, now: float, data: bytes) -> None:
        self.events.append(("client_binary", data))

    def upstream_text(self, now: float, text: str) -> None:
        self.events.append(("upstream_text", text))

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        if self.reads_binary:
            assert size == len(data)
            self.events.append(("upstream_binary", bytes(data)))
        else:
            assert data == b""
            self.events.append(("upstream_binary_size", size))


class SizesUntilWav(Recorder):
    """Meters binary messages by length until an upstream text message says "wav", as
    the ``vllm-omni-speech-ws`` adapter does for PCM and WAV."""

    def __init__(self) -> None:
        super().__init__(reads_binary=False)

    def upstream_text(self, now: float, text: str) -> None:
        super().upstream_text(now, text)
        self.reads_binary = "wav" in text


@dataclass
class Lease:
    pool: str = "main"
    replica: str = "gpu0"


class Runtime:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.errors: list[str] = []

    def upstream_error(self, pool: str, replica: str, kind: str) -> None:
        self.errors.append(kind)


class Harness:
    def __init__(self, adapter: Recorder | None = None, **limits: Any) -> None:
        self.clock = FakeClock()
        self.services = Runtime(self.clock)
        self.adapter = adapter or Recorder()
        self.record = SessionRecord("s-1", "/ws", "main", "ws", self.clock.now())
        options: dict[str, Any] = {"ping_interval_s": 0, **limits}
        self.splice = Splice(
            self.services, Lease(), self.adapter, self.record,  # type: ignore[arg-type]
            LimitsSettings(**options),
        )  # fmt: skip
        self.client = FakeTransport()  # what the client receives
        self.upstream = FakeTransport()  # what the upstream receives

    def start(self, client_early: bytes = b"", upstream_early: bytes = b"") -> None:
        self.splice.start(self.client, client_early, self.upstream, upstream_early, False)

    def from_upstream(self, data: bytes) -> None:
        self.splice.upstream.data_received(data)

    def from_client(self, data: bytes) -> None:
        self.splice.client.data_received(data)


def server_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    raw = frame(opcode, payload, masked=False)
    return raw if fin else bytes((raw[0] & 0x7F,)) + raw[1:]


def client_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    raw = frame(opcode, payload, masked=True)
    return raw if fin else bytes((raw[0] & 0x7F,)) + raw[1:]


def parse_frames(data: bytes) -> list[tuple[int, bool, bytes]]:
    """Decode a byte stream into (opcode, fin, unmasked payload)."""
    from proxy.relay.wsframes import mask_bytes

    out = []
    i = 0
    while i < len(data):
        b0, b1 = data[i], data[i + 1]
        length = b1 & 0x7F
        i += 2
        if length == 126:
            length = int.from_bytes(data[i : i + 2], "big")
            i += 2
        elif length == 127:
            length = int.from_bytes(data[i : i + 8], "big")
            i += 8
        payload = data[i + (4 if b1 & 0x80 else 0) : i + (4 if b1 & 0x80 else 0) + length]
        if b1 & 0x80:
            payload = mask_bytes(payload, data[i : i + 4])
            i += 4
        i += length
        out.append((b0 & 0x0F, bool(b0 & 0x80), payload))
    assert i == len(data), "stream does not end on a frame boundary"
    return out


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(data) + 1) for p in points})
    return [data[a:b] for a, b in zip([0, *marks], [*marks, len(data)], strict=True)]


# -- forwarding and metering ---------------------------------------------------------

DOWNSTREAM = b"".join(
    [
        server_frame(1, b'{"type":"audio.start"}'),
        server_frame(2, bytes(range(256)) * 40),  # 10 KiB: a 16-bit length
        server_frame(9, b"ping"),  # interleaved control frame
        server_frame(1, "héllo ".encode(), fin=False),  # fragmented text
        server_frame(10, b""),
        server_frame(0, "wörld".encode()),
        server_frame(2, b"x" * 70000),  # a 64-bit length
        server_frame(2, b""),
    ]
)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=st.lists(st.integers(0, 90000), max_size=12))
async def test_upstream_stream_is_forwarded_byte_for_byte_however_it_is_cut(
    points: list[int],
) -> None:
    h = Harness()
    h.start()
    for part in cuts(DOWNSTREAM, points):
        h.from_upstream(part)
    assert h.client.take() == DOWNSTREAM
    assert h.adapter.events == [
        ("upstream_text", '{"type":"audio.start"}'),
        ("upstream_binary", bytes(range(256)) * 40),
        ("upstream_text", "héllo wörld"),
        ("upstream_binary", b"x" * 70000),
        ("upstream_binary", b""),
    ]
    assert h.record.frames_down == 5
    assert h.record.bytes_down == 22 + 10240 + len("héllo wörld".encode()) + 70000


UPSTREAM = b"".join(
    [
        client_frame(1, b'{"type":"input.text","text":"hi"}'),
        client_frame(2, b"\x01\x02" * 3000),
        client_frame(9, b"p"),
        client_frame(1, b'{"type":', fin=False),
        client_frame(0, b'"input.done"}'),
    ]
)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(points=st.lists(st.integers(0, 7000), max_size=10))
async def test_client_frames_are_forwarded_masked_and_text_is_metered_unmasked(
    points: list[int],
) -> None:
    h = Harness()
    h.start()
    for part in cuts(UPSTREAM, points):
        h.from_client(part)
    assert h.upstream.take() == UPSTREAM  # verbatim: masks and all
    assert h.adapter.events == [
        ("client_text", '{"type":"input.text","text":"hi"}'),
        ("client_text", '{"type":"input.done"}'),
    ]
    assert h.record.frames_up == 3
    assert h.record.bytes_up == 33 + 6000 + 21


async def test_early_bytes_of_both_legs_are_read_first() -> None:
    h = Harness()
    first = server_frame(1, b'{"type":"audio.start"}')
    h.start(client_early=client_frame(1, b"early"), upstream_early=first)
    assert h.client.take() == first
    assert parse_frames(h.upstream.take()) == [(1, True, b"early")]
    assert h.upstream.reading


# -- limits --------------------------------------------------------------------------


async def test_an_oversized_client_message_is_not_forwarded_and_closes_with_1008() -> None:
    h = Harness(max_message_bytes=4096)
    h.start()
    big = client_frame(2, b"a" * 5000)
    h.from_client(client_frame(2, b"a" * 4096) + big[:100])
    h.from_client(big[100:])
    sent_up = parse_frames(h.upstream.take())
    assert sent_up[0] == (2, True, b"a" * 4096)
    assert sent_up[1][0] == 8 and sent_up[1][2][:2] == (1000).to_bytes(2, "big")
    assert len(sent_up) == 2
    to_client = parse_frames(h.client.take())
    assert to_client == [(8, True, (1008).to_bytes(2, "big") + b"message over 4096 bytes")]
    assert h.record.client_close == 1008


async def test_a_fragmented_message_counts_its_whole_size() -> None:
    h = Harness(max_message_bytes=4096)
    h.start()
    h.from_client(client_frame(1, b"a" * 3000, fin=False))
    h.from_client(client_frame(0, b"a" * 3000))
    assert parse_frames(h.upstream.take())[-1][0] == 8
    assert h.record.client_close == 1008


async def test_an_oversized_upstream_message_is_an_upstream_protocol_error() -> None:
    h = Harness(max_message_bytes=4096)
    h.start()
    h.from_upstream(server_frame(2, b"z" * 5000))
    assert parse_frames(h.client.take()) == [
        (8, True, (1014).to_bytes(2, "big") + b"upstream message too large")
    ]
    assert parse_frames(h.upstream.take())[0][2][:2] == (1009).to_bytes(2, "big")
    assert h.services.errors == ["protocol"]


async def test_idle_and_session_length_timeouts_close_with_1008() -> None:
    h = Harness(idle_timeout_s=10, max_session_s=100)
    h.start()
    for _ in range(20):  # activity every 5 s keeps the idle timer away...
        h.clock.advance(5)
        h.from_upstream(server_frame(2, b"\0\0"))
    h.client.take()
    assert h.splice.closing == (1008, "maximum session duration reached")
    h2 = Harness(idle_timeout_s=10)
    h2.start()
    h2.clock.advance(9.5)
    assert h2.splice.closing is None
    h2.clock.advance(0.5)
    assert h2.splice.closing == (1008, "idle timeout")


async def test_invalid_utf8_text_from_the_client_closes_with_1007() -> None:
    h = Harness()
    h.start()
    h.from_client(client_frame(1, b"\xff\xfe"))
    assert parse_frames(h.client.take())[0][2][:2] == (1007).to_bytes(2, "big")


# -- closing handshakes --------------------------------------------------------------


async def test_a_frame_still_arriving_is_held_until_complete() -> None:
    h = Harness()
    h.start()
    chunk = server_frame(2, b"p" * 9600)
    h.from_upstream(chunk[:5000])
    assert h.client.take() == b""  # nothing of it yet: the client's stream stays whole
    h.from_upstream(chunk[5000:9000])
    assert h.client.take() == b""
    h.from_upstream(chunk[9000:] + server_frame(1, b"next"))
    assert h.client.take() == chunk + server_frame(1, b"next")
    assert h.adapter.events == [("upstream_binary", b"p" * 9600), ("upstream_text", "next")]


async def test_an_adapter_that_meters_by_length_gets_lengths_until_it_reads_content() -> None:
    """No payload is copied out of the stream for an adapter that meters binary messages
    by length: it gets each message's length (a fragmented message's whole length, a
    frame held across reads too). After an upstream text message that makes it read
    content, it gets the content."""
    adapter = SizesUntilWav()
    h = Harness(adapter)
    h.start()
    stream = (
        server_frame(2, b"p" * 9600)
        + server_frame(2, b"ab", fin=False)
        + server_frame(9, b"")
        + server_frame(0, b"cde")
        + server_frame(1, b'{"format":"wav"}')
        + server_frame(2, b"RIFF" + bytes(300))
    )
    for piece in cuts(stream, [5000, 9605, 9700]):
        h.from_upstream(piece)
    assert h.client.take() == stream
    assert adapter.events == [
        ("upstream_binary_size", 9600),
        ("upstream_binary_size", 5),
        ("upstream_text", '{"format":"wav"}'),
        ("upstream_binary", b"RIFF" + bytes(300)),
    ]


async def test_headroom_close_drops_the_frame_in_progress() -> None:
    h = Harness()
    h.start()
    h.from_upstream(server_frame(2, b"whole"))
    chunk = server_frame(2, b"p" * 9600)
    h.from_upstream(chunk[:5000])
    h.splice.stop(1012, "draining")  # the client's stream is between frames: close now
    assert parse_frames(h.client.take()) == [
        (2, True, b"whole"),
        (8, True, (1012).to_bytes(2, "big") + b"draining"),
    ]
    h.from_upstream(chunk[5000:] + server_frame(2, b"after"))
    assert h.client.take() == b""  # the held frame and what follows are dropped
    assert h.adapter.events == [("upstream_binary", b"whole")]  # and not metered
    # the upstream got 1001 (going away), the client's echo completes its side
    assert parse_frames(h.upstream.take())[0][2][:2] == (1001).to_bytes(2, "big")
    h.from_client(client_frame(8, (1012).to_bytes(2, "big")))
    assert h.client.closed
    h.from_upstream(server_frame(8, (1001).to_bytes(2, "big")))
    h.splice.upstream.connection_lost(None)
    assert h.splice.done.done()
    assert h.record.client_close == 1012


async def test_client_initiated_close_travels_both_ways() -> None:
    h = Harness()
    h.start()
    close = client_frame(8, (4000).to_bytes(2, "big") + b"bye")
    h.from_client(close)
    assert h.upstream.take() == close
    echo = server_frame(8, (4000).to_bytes(2, "big"))
    h.from_upstream(echo)
    assert h.client.take() == echo
    assert h.client.closed  # close frames crossed both ways: the server side closes TCP
    h.splice.upstream.connection_lost(None)
    assert h.splice.done.done()
    assert (h.record.client_close, h.record.upstream_close) == (4000, 4000)
    assert h.services.errors == []


@pytest.mark.parametrize(
    ("code", "client_code", "errors"),
    [
        (4001, 4001, []),
        (1000, 1000, []),
        (None, 1000, []),  # no status code
        (1011, 1011, ["upstream_internal_error"]),
        (1015, 1011, ["upstream_internal_error"]),  # a code no peer may send
    ],
)
async def test_upstream_close_codes_are_mapped_for_the_client(
    code: int | None, client_code: int, errors: list[str]
) -> None:
    h = Harness()
    h.start()
    payload = b"" if code is None else code.to_bytes(2, "big") + b"done"
    h.from_upstream(server_frame(8, payload))
    got = parse_frames(h.client.take())
    assert got[0][2][:2] == client_code.to_bytes(2, "big")
    assert h.record.client_close == client_code
    assert h.services.errors == errors
    h.from_client(client_frame(8, client_code.to_bytes(2, "big")))
    assert h.upstream.take()  # the client's echo completes the upstream's handshake
    assert h.client.closed


async def test_upstream_vanishing_gives_the_client_1014() -> None:
    h = Harness()
    h.start()
    h.splice.upstream.connection_lost(None)
    assert parse_frames(h.client.take()) == [
        (8, True, (1014).to_bytes(2, "big") + b"upstream connection lost")
    ]
    assert h.services.errors == ["midstream"]
    h.from_client(client_frame(8, (1014).to_bytes(2, "big")))
    assert h.client.closed and h.splice.done.done()


async def test_upstream_vanishing_mid_frame_still_gives_the_client_1014() -> None:
    h = Harness()
    h.start()
    h.from_upstream(server_frame(2, b"q" * 9600)[:100])
    h.splice.upstream.connection_lost(None)
    assert parse_frames(h.client.take()) == [
        (8, True, (1014).to_bytes(2, "big") + b"upstream connection lost")
    ]
    assert h.record.client_close == 1014 and not h.client.aborted


async def test_client_vanishing_closes_the_upstream_with_1001() -> None:
    h = Harness()
    h.start()
    h.splice.client.connection_lost(None)
    assert parse_frames(h.upstream.take())[0][2] == (1001).to_bytes(2, "big") + b"client went away"
    assert h.record.client_close == 1006
    h.splice.upstream.connection_lost(None)
    assert h.splice.done.done()


async def test_a_stuck_closing_handshake_is_aborted_after_the_close_timeout() -> None:
    h = Harness()
    h.start()
    h.splice.stop(1008, "idle timeout")
    h.clock.advance(4.9)
    assert not h.splice.done.done()
    h.clock.advance(0.2)
    assert h.upstream.aborted and h.splice.done.done()
    # the client's socket is closed gracefully (a slow reader still gets the close
    # frame), and dropped only if it does not drain within client_write_timeout_s
    assert h.client.closed and not h.client.aborted
    h.clock.advance(h.splice.limits.client_write_timeout_s)
    assert h.client.aborted


@pytest.mark.parametrize(
    ("payload", "answer"),
    [
        ((999).to_bytes(2, "big"), 1002),
        ((5000).to_bytes(2, "big"), 1002),
        ((1005).to_bytes(2, "big"), 1002),  # reserved: never on the wire
        (b"\x03", 1002),  # a one-byte payload
        ((1000).to_bytes(2, "big") + b"\xff", 1007),
    ],
)
async def test_an_invalid_close_frame_from_the_client_is_answered_not_forwarded(
    payload: bytes, answer: int
) -> None:
    h = Harness()
    h.start()
    h.from_client(client_frame(8, payload))
    assert parse_frames(h.client.take())[0][2][:2] == answer.to_bytes(2, "big")
    assert h.client.closed  # its close was received and ours sent
    assert parse_frames(h.upstream.take())[0][2][:2] == (1000).to_bytes(2, "big")


async def test_a_refused_text_message_is_not_forwarded() -> None:
    h = Harness()
    h.start()
    ok = client_frame(1, b"fine")
    h.from_client(ok + client_frame(1, b"\xff\xfe") + client_frame(1, b"after"))
    up = parse_frames(h.upstream.take())
    assert up[0] == (1, True, b"fine")
    assert up[1][0] == 8 and len(up) == 2


def with_bits(raw: bytes, *, set0: int = 0, clear1: int = 0, set1: int = 0) -> bytes:
    """``raw`` with bits of its first two header bytes changed."""
    return bytes((raw[0] | set0, (raw[1] & ~clear1) | set1)) + raw[2:]


def unmasked(opcode: int, payload: bytes) -> bytes:
    return frame(opcode, payload, masked=False)


#: name -> (the offending frame, reason in Headroom's 1002); frames before it are valid
CLIENT_VIOLATIONS: dict[str, tuple[bytes, str]] = {
    "unmasked": (unmasked(2, b"secret"), "unmasked client frame"),
    "unmasked control": (unmasked(9, b"p"), "unmasked client frame"),
    "rsv1": (with_bits(client_frame(2, b"secret"), set0=0x40), "reserved bits set"),
    "rsv2": (with_bits(client_frame(1, b"{}"), set0=0x20), "reserved bits set"),
    "rsv3": (with_bits(client_frame(2, b"secret"), set0=0x10), "reserved bits set"),
    "opcode 0x3": (client_frame(3, b"secret"), "reserved opcode 0x3"),
    "opcode 0x7": (client_frame(7, b"secret"), "reserved opcode 0x7"),
    "opcode 0xb": (client_frame(0xB, b""), "reserved opcode 0xb"),
    "opcode 0xf": (client_frame(0xF, b"x"), "reserved opcode 0xf"),
    "continuation first": (client_frame(0, b"secret"), "continuation frame outside"),
    "new message mid-fragment": (client_frame(2, b"secret"), "new message inside a fragmented"),
    "fragmented ping": (client_frame(9, b"p", fin=False), "invalid control frame"),
    "ping over 125 bytes": (client_frame(9, bytes(126)), "invalid control frame"),
}


@pytest.mark.parametrize("name", list(CLIENT_VIOLATIONS))
@pytest.mark.parametrize("split", [False, True], ids=["one-read", "byte-by-byte"])
async def test_a_client_frame_violation_closes_1002_and_is_not_forwarded(
    name: str, split: bool
) -> None:
    bad, reason = CLIENT_VIOLATIONS[name]
    h = Harness()
    h.start()
    good = client_frame(2, b"ok")
    if name == "new message mid-fragment":
        good = client_frame(1, b"ok", fin=False)
    stream = good + bad + client_frame(2, b"after")
    for part in [stream[i : i + 1] for i in range(len(stream))] if split else [stream]:
        if h.client.closed:
            break
        h.from_client(part)
    up = parse_frames(h.upstream.take())
    # the good frame and a close; nothing of the bad frame or what followed it
    assert up[0][2] == b"ok", up
    assert [op for op, _, _ in up[1:]] == [8], up
    assert b"secret" not in b"".join(p for _, _, p in up)
    (close,) = parse_frames(h.client.take())
    assert close[0] == 8 and close[2][:2] == (1002).to_bytes(2, "big"), close
    assert reason in close[2][2:].decode()
    assert h.client.closed and not h.client.aborted  # failed, our close frame flushed
    assert h.record.client_close == 1002
    assert h.record.error is not None and reason in h.record.error
    h.from_upstream(server_frame(8, (1000).to_bytes(2, "big")))
    h.splice.upstream.connection_lost(None)
    assert h.splice.done.done()


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (frame(2, b"secret", masked=True), "masked server frame"),
        (with_bits(server_frame(2, b"secret"), set0=0x40), "reserved bits set"),
        (server_frame(5, b"secret"), "reserved opcode 0x5"),
        (server_frame(0, b"secret"), "continuation frame outside"),
    ],
    ids=["masked", "rsv1", "opcode-0x5", "continuation-first"],
)
async def test_an_upstream_frame_violation_is_an_upstream_protocol_error(
    bad: bytes, reason: str
) -> None:
    h = Harness()
    h.start()
    h.from_upstream(server_frame(2, b"ok") + bad + server_frame(2, b"after"))
    down = parse_frames(h.client.take())
    assert down[0] == (2, True, b"ok")
    assert down[1][0] == 8 and down[1][2][:2] == (1014).to_bytes(2, "big")
    assert reason in down[1][2][2:].decode() and len(down) == 2
    (up_close,) = parse_frames(h.upstream.take())
    assert up_close[2][:2] == (1002).to_bytes(2, "big")
    assert h.upstream.closed and h.services.errors == ["protocol"]
    assert h.adapter.events == [("upstream_binary", b"ok")]


async def test_fragments_and_interleaved_control_frames_are_still_valid() -> None:
    h = Harness()
    h.start()
    stream = b"".join([
        client_frame(1, b'{"a":', fin=False), client_frame(9, b"p"),
        client_frame(0, b"1", fin=False), client_frame(10, b""), client_frame(0, b"}"),
        client_frame(2, b"next"),
    ])  # fmt: skip
    h.from_client(stream)
    assert h.upstream.take() == stream
    assert h.adapter.events == [("client_text", '{"a":1}')]
    assert not h.client.closed


# -- back-pressure and keepalive -----------------------------------------------------


async def test_a_full_client_buffer_pauses_the_upstream_and_a_stalled_client_is_dropped() -> None:
    h = Harness(client_write_timeout_s=20, idle_timeout_s=0)
    h.start()
    h.splice.client.pause_writing()
    assert not h.upstream.reading
    h.splice.client.resume_writing()
    assert h.upstream.reading
    h.splice.client.pause_writing()
    h.clock.advance(19)
    assert not h.client.aborted
    h.clock.advance(1)
    assert h.client.aborted
    assert h.record.error == "client stopped reading"
    assert h.record.client_close == 1008
    assert parse_frames(h.upstream.take())[0][2][:2] == (1000).to_bytes(2, "big")


async def test_keepalive_pings_silent_legs_and_drops_dead_ones() -> None:
    h = Harness(ping_interval_s=20, ping_timeout_s=10)
    h.start()
    t0 = h.splice.client.silent_since
    h.splice.keepalive(t0 + 19)
    assert h.client.take() == b"" and h.upstream.take() == b""
    h.splice.keepalive(t0 + 20)
    assert parse_frames(h.client.take())[0][0] == 9  # a ping to the client
    assert parse_frames(h.upstream.take())[0][0] == 9  # and to the upstream (masked)
    h.from_upstream(server_frame(10, b"pong"))  # the upstream answers...
    h.splice.keepalive(t0 + 25)
    assert h.splice.upstream.ping_at is None
    h.splice.keepalive(t0 + 30)  # ...the client does not
    assert h.splice.closing is not None
    assert h.client.aborted
    assert h.record.client_close == 1006
    assert h.record.error == "client keepalive timeout"


async def test_one_keepalive_sweeper_serves_every_session_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    sweeper = _Keepalive(loop, period_s=0.001)
    seen: list[float] = []
    swept = asyncio.Event()

    class Session:
        def keepalive(self, now: float) -> None:
            seen.append(now)
            if len(seen) == 3:
                sweeper.discard(self)
                swept.set()

        def fail(self) -> None:
            raise AssertionError("the sweep failed a session")

    sweeper.add(Session())
    await asyncio.wait_for(swept.wait(), 10)
    assert seen == sorted(seen)
    await asyncio.sleep(0.01)
    assert len(seen) == 3 and sweeper._handle is None  # stops once no session is left


async def test_frame_builder_round_trips() -> None:
    for size in (0, 125, 126, 65535, 65536):
        payload = os.urandom(size)
        for masked in (False, True):
            assert parse_frames(frame(2, payload, masked=masked)) == [(2, True, payload)]
    assert parse_frames(close_frame(1000, "x" * 200, masked=False))[0][2] == (
        (1000).to_bytes(2, "big") + b"x" * 123
    )


async def test_nothing_but_close_frames_crosses_once_a_leg_is_closing() -> None:
    h = Harness()
    h.start()
    h.splice.stop(1008, "idle timeout")
    close = h.client.take()
    h.from_upstream(server_frame(2, b"late") + server_frame(9, b"p") + server_frame(1, b"x"))
    assert h.client.take() == b""
    assert parse_frames(close) == [(8, True, (1008).to_bytes(2, "big") + b"idle timeout")]
    assert h.adapter.events == []


async def test_a_client_gone_before_the_start_gets_the_upstream_a_1001_and_a_close() -> None:
    h = Harness()
    h.splice.client_left(h.upstream)
    expected = (1001).to_bytes(2, "big") + b"client went away"
    assert parse_frames(h.upstream.take()) == [(8, True, expected)]
    assert h.upstream.closed and not h.upstream.aborted  # the close frame is flushed
    assert h.record.client_close == 1006 and h.splice.done.done()
    assert h.splice._timer is None  # no close deadline left running


async def test_an_ended_session_is_freed_without_the_garbage_collector() -> None:
    """Once both transports are gone (connection_lost is the last call a transport
    makes) and the session is done, the legs are untied from the splice and from each
    other: the session's objects go with its last reference, not at the garbage
    collector's next pass."""
    gc.disable()
    try:
        h = Harness()
        h.start()
        h.from_client(client_frame(8, (1000).to_bytes(2, "big")))
        h.from_upstream(server_frame(8, (1000).to_bytes(2, "big")))
        for leg, transport in ((h.splice.client, h.client), (h.splice.upstream, h.upstream)):
            leg.connection_lost(None)
            transport.protocol = None  # uvloop lets go of a protocol once it is lost
        assert h.splice.done.done()
        await asyncio.sleep(0)  # the untie runs after the batch of actions that ended it
        h.clock.advance(3600)  # drops the timers it armed, as a loop drops cancelled ones
        # (the splice, its legs and core have no weak references: follow what only they
        # hold -- the done future, and each leg's transport)
        refs = [weakref.ref(o) for o in (h.splice.done, h.client, h.upstream)]
        assert h.record.client_close == 1000
        del h, leg, transport
        assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()
