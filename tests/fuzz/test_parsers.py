"""The byte-level parsers under arbitrary input and arbitrary chunking: the SSE parser,
the streaming WAV header reader, and base64 length arithmetic.

The chunking properties state what a proxy needs: TCP may cut a stream anywhere, so what
the parser makes of a stream must not depend on where it was cut -- including when a
line is over the parser's size bound.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct

from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters.b64json import B64Span, b64_decoded_len, scan_event
from proxy.metering.adapters.base import AudioFormat
from proxy.metering.adapters.sse import SseParser
from proxy.metering.adapters.wav import WavStream
from tests.fuzz.conftest import fuzz_settings


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


# -- SSE --------------------------------------------------------------------------------------

sse_lines = st.one_of(
    st.sampled_from([b"", b"data", b"data:", b"data: x", b"event: e", b"event", b": comment",
                     b"id: 1", b"retry: 5", b"datum: no", b"\xef\xbb\xbfdata: bom",
                     b"data:\xff\xfe", b"event:\xc3"]),
    st.builds(lambda k, v: k + v, st.sampled_from([b"data: ", b"event: ", b": ", b"x: "]),
              st.binary(max_size=80).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))),
)  # fmt: skip
eols = st.sampled_from([b"\n", b"\r\n", b"\r"])
sse_streams = st.one_of(
    st.lists(st.tuples(sse_lines, eols), max_size=30).map(
        lambda items: b"".join(line + eol for line, eol in items)
    ),
    st.binary(max_size=400),
)


def parse(chunks: list[bytes], bound: int) -> list[tuple[str, str]]:
    parser = SseParser(max_event_bytes=bound)
    events: list[tuple[str, str]] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events


@fuzz_settings(800)
@given(
    stream=sse_streams,
    bom=st.booleans(),
    cuts=st.lists(st.integers(0, 10**6), max_size=20),
    bound=st.sampled_from([4 * 1024 * 1024, 4096]),
)
def test_sse_events_do_not_depend_on_chunking(
    stream: bytes, bom: bool, cuts: list[int], bound: int
) -> None:
    data = (b"\xef\xbb\xbf" if bom else b"") + stream
    assert parse(split(data, cuts), bound) == parse([data], bound)


@fuzz_settings(800)
@given(stream=sse_streams, cuts=st.lists(st.integers(0, 10**6), max_size=20),
       bound=st.integers(1, 64))  # fmt: skip
def test_sse_events_do_not_depend_on_chunking_with_a_small_bound(
    stream: bytes, cuts: list[int], bound: int
) -> None:
    """The same with lines and events over the bound: "a line or an event larger than
    max_event_bytes is dropped whole (and its event with it)" must hold however the
    stream arrived."""
    assert parse(split(stream, cuts), bound) == parse([stream], bound)


def test_an_over_long_comment_line_drops_its_event_however_it_arrives() -> None:
    """The smallest case of the property above, as hypothesis shrinks it."""
    stream = b": " + b"x" * 40 + b"\ndata: hi\n\n"
    whole = parse([stream], 16)
    cut = parse([stream[:30], stream[30:]], 16)
    assert whole == cut, (whole, cut)


@fuzz_settings(500)
@given(chunks=st.lists(st.binary(max_size=200), max_size=30), bound=st.integers(1, 10**6))
def test_sse_memory_stays_bounded(chunks: list[bytes], bound: int) -> None:
    parser = SseParser(max_event_bytes=bound)
    for chunk in chunks:
        for name, data in parser.feed(chunk):
            assert isinstance(name, str) and isinstance(data, str)
        assert len(parser._buf) <= max(bound, 0) + 200  # a partial line within the bound


# -- WAV --------------------------------------------------------------------------------------

FALLBACK = AudioFormat(24000, 1, 2)


def wav_header(rate: int, channels: int, bits: int, tag: int = 1, extra: bytes = b"") -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    return (b"RIFF\xff\xff\xff\xffWAVE" + extra + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data\xff\xff\xff\xff")  # fmt: skip


def meter(chunks: list[bytes], max_header: int = 64 * 1024) -> float:
    stream = WavStream(FALLBACK, max_header=max_header)
    total = 0.0
    for chunk in chunks:
        seconds = stream.feed(chunk)
        assert math.isfinite(seconds) and seconds >= 0, seconds
        total += seconds
    return total


headers = st.builds(
    wav_header,
    st.sampled_from([8000, 16000, 24000, 44100, 48000]),
    st.integers(1, 8),
    st.sampled_from([8, 16, 24, 32]),
    st.sampled_from([1, 3, 0xFFFE]),
    st.sampled_from([b"", b"LIST\x04\x00\x00\x00abcd", b"fact\x03\x00\x00\x00xyz\x00"]),
)


@fuzz_settings(600)
@given(header=headers, pcm=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 10**6),
                                                                      max_size=12))  # fmt: skip
def test_wav_seconds_do_not_depend_on_chunking(header: bytes, pcm: bytes, cuts: list[int]) -> None:
    data = header + pcm
    whole = meter([data])
    assert math.isclose(whole, meter(split(data, cuts)), rel_tol=1e-9, abs_tol=1e-12)
    at = header.index(b"fmt ") + 8
    _, _, rate, _, block, _ = struct.unpack_from("<HHIIHH", header, at)
    assert math.isclose(whole, len(pcm) / (rate * block), rel_tol=1e-9, abs_tol=1e-12)


@fuzz_settings(800)
@given(
    header=headers,
    flips=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), min_size=1, max_size=6),
    pcm=st.binary(max_size=2000),
    cuts=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_corrupt_wav_headers_never_raise_and_do_not_depend_on_chunking(
    header: bytes, flips: list[tuple[int, int]], pcm: bytes, cuts: list[int]
) -> None:
    damaged = bytearray(header)
    for at, value in flips:
        damaged[at % len(damaged)] = value
    data = bytes(damaged) + pcm
    whole = meter([data])
    assert math.isclose(whole, meter(split(data, cuts)), rel_tol=1e-9, abs_tol=1e-12)


@fuzz_settings(600)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 10**6), max_size=10),
       max_header=st.integers(12, 400))  # fmt: skip
def test_random_bytes_as_wav(data: bytes, cuts: list[int], max_header: int) -> None:
    whole = meter([data], max_header)
    assert math.isclose(whole, meter(split(data, cuts), max_header), rel_tol=1e-9, abs_tol=1e-12)


# -- base64 -------------------------------------------------------------------------------------

b64_alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


_RFC4648 = re.compile(
    r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=|[A-Za-z0-9+/]{2,3})?"
)


def strict_b64decode(text: str) -> bytes:
    """RFC 4648 base64 (padding only completes the last group; unpadded accepted)."""
    if not _RFC4648.fullmatch(text):
        raise ValueError("not RFC 4648 base64")
    return base64.b64decode(text + "=" * (-len(text) % 4))


@fuzz_settings(1000)
@given(text=st.text(alphabet=b64_alphabet + '-_ \\"\x00é', max_size=80))
def test_b64_length_never_exceeds_what_the_text_could_decode_to(text: str) -> None:
    span = B64Span(text, 0, len(text))
    n = span.nbytes
    assert 0 <= n <= len(text) * 3 // 4
    try:
        decoded = strict_b64decode(text)
    except (binascii.Error, ValueError):
        return
    assert n == len(decoded)  # when the text is valid base64, the arithmetic is exact
    head = span.head(n)
    assert head == decoded[: len(head)]


@fuzz_settings(1000)
@given(nchars=st.integers(-5, 10**7), padding=st.integers(-3, 6))
def test_b64_decoded_len_is_never_negative(nchars: int, padding: int) -> None:
    assert b64_decoded_len(nchars, padding) >= 0


@fuzz_settings(600)
@given(
    audio=st.binary(max_size=3000),
    padded=st.booleans(),
    extra=st.dictionaries(st.text(max_size=8), st.text(max_size=8) | st.integers(), max_size=3),
    key=st.sampled_from(["delta", "audio"]),
)
def test_scan_event_length_equals_the_decoded_audio(
    audio: bytes, padded: bool, extra: dict[str, object], key: str
) -> None:
    import json

    encoded = base64.b64encode(audio).decode()
    if not padded:
        encoded = encoded.rstrip("=")
    event = {k: v for k, v in extra.items() if k not in ("delta", "audio")}
    event[key] = encoded
    scanned = scan_event(json.dumps(event), ("delta", "audio"))
    assert scanned is not None and scanned[1] is not None
    assert scanned[1].nbytes == len(audio)
