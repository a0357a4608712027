"""The raw WebSocket helpers of the live fuzz tests (``bench/wsraw.py``) build the bytes
they claim to, so the named cases in ``test_live_ws.py`` say what they mean."""

from __future__ import annotations

import asyncio
import struct

from wsraw import OP_BINARY, OP_TEXT, Head, close_frame, frame, read_frames, read_http_body


def test_frame_builder_encodes_lengths_and_masks() -> None:
    assert frame(OP_TEXT, b"hi", mask=False) == b"\x81\x02hi"
    assert frame(OP_BINARY, b"", length=126, mask=False)[:4] == b"\x82\x7e\x00\x7e"
    assert frame(OP_BINARY, b"", length=1 << 16, mask=False)[:2] == b"\x82\x7f"
    assert frame(OP_TEXT, b"x", fin=False, rsv=4, mask=False)[0] == 0x41
    masked = frame(OP_TEXT, b"abcd")
    key = masked[2:6]
    assert bytes(b ^ key[i % 4] for i, b in enumerate(masked[6:])) == b"abcd"
    assert close_frame(1000, mask=False) == b"\x88\x02" + struct.pack("!H", 1000)


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_frame_reader_stops_at_close_and_keeps_the_rest() -> None:
    data = frame(OP_TEXT, b"one", mask=False) + close_frame(1008, b"bye", mask=False) + b"xx"
    closed = await read_frames(_reader(data))
    assert closed.frames == [(OP_TEXT, b"one")]
    assert (closed.code, closed.reason, closed.how) == (1008, b"bye", "close_1008")
    eof = await read_frames(_reader(frame(OP_TEXT, b"one", mask=False)[:3]))
    assert eof.eof and eof.how == "eof"


async def test_http_body_reader_handles_chunked_and_truncated_bodies() -> None:
    chunked = Head(200, {"transfer-encoding": "chunked"})
    assert await read_http_body(_reader(b"3\r\nabc\r\n0\r\n\r\n"), chunked) == (b"abc", True)
    assert await read_http_body(_reader(b"3\r\nabc\r\n"), chunked) == (b"abc", False)
    sized = Head(200, {"content-length": "5"}, rest=b"ab")
    assert await read_http_body(_reader(b"cde"), sized) == (b"abcde", True)
    assert await read_http_body(_reader(b"c"), sized) == (b"", False)
