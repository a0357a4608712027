"""proxy/relay/wsframes.py, tested the way python-websockets tests its frames
(tests/test_frames.py there): every frame round-trips through encode and parse, on both
sides and in every length encoding; every malformed frame is refused with the exact
close code and reason. The splice's frame walk (proxy/relay/splice_leg.py) reads frames
in place with the same tables; a property test holds its decisions equal to
:func:`parse_frame`'s on arbitrary streams."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.relay.wsframes import (
    BINARY,
    CLOSE,
    CONT,
    INVALID_TEXT,
    PING,
    PONG,
    TEXT,
    Frame,
    FrameError,
    apply_mask,
    client_frame,
    close_error,
    close_fields,
    close_frame,
    decode_text,
    encode,
    fragment,
    frame,
    mask_bytes,
    parse_frame,
    whole_frames,
)
from tests.hypothesis_profiles import examples
from tests.unit.test_splice import Harness, parse_frames
from tests.unit.test_splice import client_frame as raw_client_frame

KEY = b"\x37\xfa\x21\x3d"


def parsed(data: bytes, *, from_client: bool, in_message: bool = False) -> Frame:
    out = parse_frame(data, from_client=from_client, in_message=in_message)
    assert out is not None and out[1] == len(data), out
    return out[0]


def refused(data: bytes, *, from_client: bool, in_message: bool = False, **kw: int) -> FrameError:
    with pytest.raises(FrameError) as caught:
        parse_frame(data, from_client=from_client, in_message=in_message, **kw)  # type: ignore[arg-type]
    return caught.value


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("encoded", "opcode", "payload", "fin"),
    [
        (b"\x81\x04Spam", TEXT, b"Spam", True),
        (b"\x01\x04Spam", TEXT, b"Spam", False),
        (b"\x80\x04Spam", CONT, b"Spam", True),
        (b"\x82\x04Eggs", BINARY, b"Eggs", True),
        (b"\x82\x00", BINARY, b"", True),
        (b"\x89\x04ping", PING, b"ping", True),
        (b"\x8a\x00", PONG, b"", True),
        (b"\x88\x00", CLOSE, b"", True),
        (b"\x88\x02\x03\xe8", CLOSE, b"\x03\xe8", True),
        (b"\x88\x05\x03\xe8bye", CLOSE, b"\x03\xe8bye", True),
    ],
)
def test_server_frames_round_trip(encoded: bytes, opcode: int, payload: bytes, fin: bool) -> None:
    assert parsed(encoded, from_client=False, in_message=opcode == CONT) == Frame(
        opcode, payload, fin
    )
    assert encode(opcode, payload, fin=fin) == encoded


def test_a_client_frame_is_masked_and_round_trips() -> None:
    encoded = encode(TEXT, b"Spam", key=KEY)
    assert encoded == b"\x81\x84" + KEY + bytes(a ^ b for a, b in zip(b"Spam", KEY, strict=True))
    assert parsed(encoded, from_client=True) == Frame(TEXT, b"Spam")


@pytest.mark.parametrize(
    ("size", "head"), [(0, 2), (125, 2), (126, 4), (65535, 4), (65536, 10), (70_000, 10)]
)
@pytest.mark.parametrize("from_client", [True, False])
def test_every_length_encoding_round_trips(size: int, head: int, from_client: bool) -> None:
    payload = os.urandom(size)
    encoded = frame(BINARY, payload, masked=from_client)
    assert len(encoded) == head + (4 if from_client else 0) + size
    assert parsed(encoded, from_client=from_client) == Frame(BINARY, payload)
    for cut in (0, 1, head - 1, len(encoded) - 1):  # not whole yet: no frame, no error
        assert parse_frame(encoded[:cut], from_client=from_client) is None


def test_a_longer_length_encoding_than_needed_is_accepted() -> None:
    """As websockets does: RFC 6455 asks senders for the minimal encoding; readers are
    not told to refuse others."""
    assert parsed(b"\x82\x7e\x00\x04Eggs", from_client=False) == Frame(BINARY, b"Eggs")
    assert parsed(b"\x82\x7f" + (4).to_bytes(8, "big") + b"Eggs", from_client=False) == Frame(
        BINARY, b"Eggs"
    )


def test_frames_parse_from_an_offset_in_a_stream() -> None:
    stream = encode(TEXT, b"one") + encode(BINARY, b"two", fin=False) + encode(CONT, b"!")
    first = parse_frame(stream, from_client=False)
    assert first is not None
    second = parse_frame(stream, first[1], from_client=False)
    assert second is not None
    third = parse_frame(stream, second[1], from_client=False, in_message=True)
    assert third is not None and third[1] == len(stream)
    assert [first[0], second[0], third[0]] == [
        Frame(TEXT, b"one"), Frame(BINARY, b"two", False), Frame(CONT, b"!"),
    ]  # fmt: skip


@given(st.binary(max_size=300), st.binary(min_size=4, max_size=4))
@settings(max_examples=examples(200), deadline=None)
def test_masking_is_its_own_inverse_and_both_implementations_agree(data: bytes, key: bytes) -> None:
    assert apply_mask(data, key) == mask_bytes(data, key)
    assert mask_bytes(mask_bytes(data, key), key) == data


# -- malformed frames: the exact code and reason -----------------------------------------------


@pytest.mark.parametrize(
    ("data", "from_client", "in_message", "code", "reason"),
    [
        (b"\xc1\x04Spam", False, False, 1002, "reserved bits set without an extension"),
        (b"\xa1\x04Spam", False, False, 1002, "reserved bits set without an extension"),
        (b"\x91\x04Spam", False, False, 1002, "reserved bits set without an extension"),
        (b"\x83\x00", False, False, 1002, "reserved opcode 0x3"),
        (b"\x87\x00", False, False, 1002, "reserved opcode 0x7"),
        (b"\x8b\x00", False, False, 1002, "reserved opcode 0xb"),
        (b"\x8f\x00", False, False, 1002, "reserved opcode 0xf"),
        (b"\x81\x04Spam", True, False, 1002, "unmasked client frame"),
        (b"\x81\x84" + KEY + b"Spam", False, False, 1002, "masked server frame"),
        (b"\x09\x00", False, False, 1002, "invalid control frame"),  # fragmented ping
        (b"\x08\x00", False, False, 1002, "invalid control frame"),
        (b"\x89\x7e\x00\x7e" + b"x" * 126, False, False, 1002, "invalid control frame"),
        (b"\x8a\x7e" + b"x" * 2, False, False, 1002, "invalid control frame"),
        (b"\x80\x00", False, False, 1002, "continuation frame outside a message"),
        (b"\x81\x00", False, True, 1002, "new message inside a fragmented one"),
        (b"\x02\x00", False, True, 1002, "new message inside a fragmented one"),
        (b"\x88\x01\x03", False, False, 1002, "invalid close frame"),
        (b"\x88\x02\x03\xe7", False, False, 1002, "invalid close frame"),  # 999
        (b"\x88\x02\x03\xed", False, False, 1002, "invalid close frame"),  # 1005
        (b"\x88\x02\x03\xee", False, False, 1002, "invalid close frame"),  # 1006
        (b"\x88\x02\x03\xf7", False, False, 1002, "invalid close frame"),  # 1015
        (b"\x88\x02\x13\x88", False, False, 1002, "invalid close frame"),  # 5000
        (b"\x88\x04\x03\xe8\xff\xfe", False, False, 1007, "invalid UTF-8 in the close reason"),
        (b"\x82\x7f\x80" + bytes(7), False, False, 1002,
         "payload length with its most significant bit set"),
    ],
)  # fmt: skip
def test_a_malformed_frame_is_refused_with_its_code(
    data: bytes, from_client: bool, in_message: bool, code: int, reason: str
) -> None:
    error = refused(data, from_client=from_client, in_message=in_message)
    assert (error.code, error.reason) == (code, reason)


def test_a_header_is_refused_before_its_payload_arrives() -> None:
    """Two bytes are enough to refuse: a peer is not waited on to finish a bad frame."""
    assert refused(b"\xc1\x7e", from_client=False).code == 1002


def test_a_frame_over_max_size_is_refused_with_1009_from_its_header() -> None:
    head = b"\x82\x7e\x01\x00"  # 256 bytes declared, none sent
    error = refused(head, from_client=False, max_size=255)
    assert (error.code, error.reason) == (1009, "frame over 255 bytes")
    assert parse_frame(head, from_client=False, max_size=256) is None


@pytest.mark.parametrize(
    ("payload", "answer"),
    [
        (b"", None),
        ((1000).to_bytes(2, "big"), None),
        ((1000).to_bytes(2, "big") + "déjà".encode(), None),
        ((3000).to_bytes(2, "big"), None),
        ((4999).to_bytes(2, "big"), None),
        ((1014).to_bytes(2, "big"), None),
        ((1004).to_bytes(2, "big"), (1002, "invalid close frame")),
        ((2999).to_bytes(2, "big"), (1002, "invalid close frame")),
        (b"\x03", (1002, "invalid close frame")),
        ((1000).to_bytes(2, "big") + b"\xc3", (1007, "invalid UTF-8 in the close reason")),
    ],
)
def test_close_payloads(payload: bytes, answer: tuple[int, str] | None) -> None:
    assert close_error(payload) == answer


def test_close_fields_are_read_leniently() -> None:
    assert close_fields(b"") == (1005, "")
    assert close_fields(b"\x03") == (1005, "")
    assert close_fields(b"\x0f\xa1bye") == (4001, "bye")
    assert close_fields(b"\x03\xe8\xff") == (1000, "\ufffd")


def test_a_close_frame_cuts_its_reason_to_fit_a_control_frame() -> None:
    out = parsed(close_frame(1008, "x" * 300, masked=False), from_client=False)
    assert out.opcode == CLOSE and len(out.payload) <= 125
    assert close_fields(out.payload)[0] == 1008
    masked = parsed(close_frame(1000, "bye", masked=True), from_client=True)
    assert masked.payload == b"\x03\xe8bye"


def test_text_must_be_utf8_as_a_whole_message() -> None:
    assert decode_text("é".encode()) == "é"
    assert decode_text("é".encode()[:1]) is None
    assert INVALID_TEXT == (1007, "invalid UTF-8 in a text message")


# -- frame boundaries and frames Headroom writes for a client ---------------------------------


def test_whole_frames_counts_complete_frames_only() -> None:
    small = raw_client_frame(1, b"hi")
    medium = raw_client_frame(2, b"m" * 300)  # 16-bit length
    large = raw_client_frame(2, b"l" * 70_000)  # 64-bit length
    stream = small + medium + large
    assert whole_frames(stream, None) == len(stream)
    for cut in range(len(small) + len(medium) + 20):
        expected = max(n for n in (0, len(small), len(small) + len(medium)) if n <= cut)
        assert whole_frames(stream[:cut], None) == expected, cut
    assert whole_frames(stream[:-1], None) == len(small) + len(medium)
    # a frame still arriving that declares more than max_size goes to the parser at once
    assert whole_frames(small + large[:20], 65_536) == len(small) + 20
    assert whole_frames(small + large[:20], 70_000) == len(small)
    assert whole_frames(small + large[:5], 65_536) == len(small)  # its length not read yet


def test_client_frames_and_fragments_are_what_a_client_sends() -> None:
    data = (client_frame({"type": "websocket.receive", "text": "hé"})
            + client_frame({"type": "websocket.receive", "bytes": b"\x00" * 200})
            + client_frame({"type": "websocket.receive", "bytes": None}))  # fmt: skip
    assert parse_frames(data) == [(1, True, "hé".encode()), (2, True, b"\x00" * 200),
                                  (2, True, b"")]  # fmt: skip
    for raw in data[:2], data[8:10]:
        assert raw[1] & 0x80  # masked


def test_a_fragment_keeps_its_opcode_without_fin() -> None:
    out = fragment(TEXT, b"part") + fragment(CONT, b"more")
    assert parse_frames(out) == [(1, False, b"part"), (0, False, b"more")]


# -- the splice's walk decides as parse_frame does ----------------------------------------------


def _reference(stream: bytes, from_client: bool) -> tuple[int, str | None]:
    """How many frames parse_frame accepts from ``stream`` and the reason it refuses the
    next (None: the stream ended)."""
    pos, count, in_message = 0, 0, False
    while True:
        try:
            out = parse_frame(stream, pos, from_client=from_client, in_message=in_message)
        except FrameError as exc:
            return count, exc.reason
        if out is None:
            return count, None
        got, pos = out
        count += 1
        if got.opcode < 8:
            in_message = not got.fin


_header = st.tuples(
    st.integers(0, 255).filter(lambda b0: b0 & 0x0F != CLOSE),  # FIN, RSV, opcode
    st.booleans(),  # masked
    st.sampled_from([0, 1, 5, 125, 126, 200]),  # payload length
)


@given(st.lists(_header, min_size=1, max_size=6), st.booleans())
@settings(max_examples=examples(300), deadline=None)
def test_the_splice_refuses_exactly_what_parse_frame_refuses(
    headers: list[tuple[int, bool, int]], from_client: bool
) -> None:
    """Close frames aside (the relay core reads those: tests/unit/test_splice.py)."""
    stream = b""
    for b0, masked, size in headers:
        payload = b"{}" * (size // 2) + b"}" * (size % 2)  # valid UTF-8
        raw = encode(b0 & 0x0F, payload, key=KEY if masked else None)
        stream += bytes((b0,)) + raw[1:]
    count, reason = _reference(stream, from_client)
    asyncio.run(_compare(stream, from_client, count, reason))


async def _compare(stream: bytes, from_client: bool, count: int, reason: str | None) -> None:
    h = Harness()
    h.start()
    if from_client:
        h.from_client(stream)
        forwarded = parse_frames(h.upstream.take())
        error = h.record.error
        expected = None if reason is None else f"client protocol error: {reason}"
    else:
        h.from_upstream(stream)
        forwarded = parse_frames(h.client.take())
        closes = [p for op, _, p in forwarded if op == CLOSE]
        error = closes[0][2:].decode() if closes else None
        expected = None if reason is None else f"upstream protocol error: {reason}"
    assert error == expected, (stream.hex(), reason)
    assert len([f for f in forwarded if f[0] != CLOSE]) == count
    if reason is not None:
        assert forwarded[-1][0] == CLOSE
