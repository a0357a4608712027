"""Streaming WAV: a RIFF header split anywhere is parsed; then PCM is counted by length."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metering.adapters.base import AudioFormat
from proxy.metering.adapters.wav import WavStream

DEFAULT = AudioFormat(24000, 1, 2)


def wav_header(
    rate: int = 24000,
    channels: int = 1,
    bits: int = 16,
    tag: int = 1,
    extra_chunks: bytes = b"",
    data_size: int = 0xFFFFFFFF,
) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + extra_chunks
        + b"data" + struct.pack("<I", data_size)
    )  # fmt: skip


def feed(stream: WavStream, chunks: list[bytes]) -> float:
    return sum(stream.feed(c) for c in chunks)


HEADER = wav_header()
PCM = bytes(9600)  # 0.2 s at 24 kHz mono 16-bit


def test_header_then_pcm() -> None:
    stream = WavStream(DEFAULT)
    assert stream.feed(HEADER) == 0.0
    assert stream.feed(PCM) == pytest.approx(0.2)
    assert stream.in_data
    assert stream.format == AudioFormat(24000, 1, 2)


@pytest.mark.parametrize("cut", range(1, len(HEADER) + 10))
def test_header_split_anywhere(cut: int) -> None:
    whole = HEADER + PCM
    stream = WavStream(AudioFormat(8000, 1, 1))  # a wrong fallback must not be used
    assert feed(stream, [whole[:cut], whole[cut:]]) == pytest.approx(0.2)
    assert stream.format == AudioFormat(24000, 1, 2)


def test_header_one_byte_at_a_time() -> None:
    stream = WavStream(DEFAULT)
    whole = HEADER + bytes(4800)
    assert feed(stream, [whole[i : i + 1] for i in range(len(whole))]) == pytest.approx(0.1)


def test_format_from_the_header() -> None:
    stream = WavStream(DEFAULT)
    seconds = feed(stream, [wav_header(48000, 2, 16), bytes(48000 * 4)])
    assert seconds == pytest.approx(1.0)
    assert stream.format == AudioFormat(48000, 2, 2)
    assert stream.bytes_per_second == 192000


def test_float_and_extensible_formats() -> None:
    assert feed(WavStream(DEFAULT), [wav_header(16000, 1, 32, tag=3), bytes(64000)]) == 1.0
    extensible = wav_header(16000, 1, 16, tag=0xFFFE)
    assert feed(WavStream(DEFAULT), [extensible, bytes(32000)]) == 1.0


def test_other_chunks_before_data_are_skipped_including_the_pad_byte() -> None:
    odd = b"LIST" + struct.pack("<I", 5) + b"abcde" + b"\x00"
    fact = b"fact" + struct.pack("<I", 4) + b"\x00\x00\x00\x00"
    header = wav_header(extra_chunks=odd + fact)
    for cut in range(len(header)):
        stream = WavStream(DEFAULT)
        assert feed(stream, [header[:cut], header[cut:] + PCM]) == pytest.approx(0.2)


def test_data_size_placeholder_is_ignored() -> None:
    stream = WavStream(DEFAULT)
    assert feed(stream, [wav_header(data_size=0), PCM, PCM]) == pytest.approx(0.4)


def test_not_riff_is_raw_pcm_in_the_fallback_format() -> None:
    stream = WavStream(AudioFormat(16000, 1, 2))
    assert feed(stream, [b"\x01\x02", bytes(31998)]) == pytest.approx(1.0)
    assert stream.format == AudioFormat(16000, 1, 2)


@pytest.mark.parametrize(
    "header",
    [
        b"RIFF\x00\x00\x00\x00WAVX" + bytes(100),  # not WAVE
        b"RIFF\x00\x00\x00\x00WAVEdata\x00\x00\x00\x00" + bytes(100),  # data before fmt
        b"RIFF\x00\x00\x00\x00WAVEfmt \x04\x00\x00\x00" + bytes(100),  # fmt too short
        wav_header(rate=0),
        wav_header(tag=0x55, rate=0),
    ],
)
def test_malformed_header_counts_nothing(header: bytes) -> None:
    stream = WavStream(DEFAULT)
    assert feed(stream, [header, PCM, PCM]) == 0.0
    assert stream.broken


def test_header_larger_than_the_bound_counts_nothing() -> None:
    huge = b"LIST" + struct.pack("<I", 100_000) + bytes(100_000)
    stream = WavStream(DEFAULT, max_header=4096)
    assert feed(stream, [wav_header(extra_chunks=huge), PCM]) == 0.0
    assert stream.broken


def test_unterminated_header_is_bounded() -> None:
    stream = WavStream(DEFAULT, max_header=1024)
    stream.feed(b"RIFF\x00\x00\x00\x00WAVE" + b"LIST" + struct.pack("<I", 500))
    for _ in range(10):
        stream.feed(bytes(200))
    assert stream.broken


def test_reset_expects_a_new_header() -> None:
    stream = WavStream(DEFAULT)
    feed(stream, [HEADER, PCM])
    stream.reset()
    assert not stream.in_data
    assert feed(stream, [wav_header(16000), bytes(32000)]) == pytest.approx(1.0)


@given(st.lists(st.binary(max_size=64), max_size=20))
def test_garbage_never_raises(chunks: list[bytes]) -> None:
    assert feed(WavStream(DEFAULT, max_header=256), chunks) >= 0.0


@given(st.binary(max_size=200), st.data())
def test_riff_prefixed_garbage_never_raises(tail: bytes, data: st.DataObject) -> None:
    stream = b"RIFF\x00\x00\x00\x00WAVE" + tail
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=4)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert feed(WavStream(DEFAULT), chunks) >= 0.0
