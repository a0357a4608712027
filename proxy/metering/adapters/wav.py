"""Streaming WAV: the RIFF header, possibly split across chunks, then PCM counted by length.

A streamed WAV (vLLM-Omni ``response_format=wav``) is a RIFF/WAVE header followed by PCM
for as long as the stream lasts; the ``data`` chunk size is usually a placeholder (0 or
0xFFFFFFFF), so it is ignored and every byte after the ``data`` header counts as audio.
Chunks before ``data`` other than ``fmt `` (``LIST``, ``fact``, ...) are skipped.

States: the parser buffers at most ``max_header`` bytes while it reads the header, then
counts bytes without keeping any. A stream that does not start with ``RIFF``/``RF64`` is
taken as raw PCM in the fallback format (servers that send ``format: wav`` but no header);
a header that is malformed or larger than ``max_header`` counts nothing from then on.
"""

from __future__ import annotations

import struct

from proxy.metering.adapters.base import AudioFormat

__all__ = ["WavStream"]

_HEADER, _DATA, _BROKEN = 0, 1, 2
_PCM_LIKE = frozenset({1, 3, 0xFFFE})  # integer PCM, IEEE float, WAVE_FORMAT_EXTENSIBLE
_FMT = struct.Struct("<HHIIHH")
_U32 = struct.Struct("<I")


class WavStream:
    """Seconds of audio in each chunk of one WAV stream. Never raises on bad input."""

    __slots__ = ("_bps", "_buf", "_fallback", "_format", "_max_header", "_pos", "_state")

    def __init__(self, fallback: AudioFormat, max_header: int = 64 * 1024) -> None:
        self._fallback = fallback
        self._max_header = max_header
        self._buf = bytearray()
        self._state = _HEADER
        self._pos = 12  # next RIFF sub-chunk header to read
        self._bps = 0.0
        self._format: AudioFormat | None = None

    def reset(self) -> None:
        """Expect a new header (a new utterance's WAV)."""
        self._buf.clear()
        self._state = _HEADER
        self._pos = 12
        self._bps = 0.0
        self._format = None

    @property
    def format(self) -> AudioFormat | None:
        """The format of the audio being counted, once known."""
        return self._format

    @property
    def broken(self) -> bool:
        """The header was malformed or too large: nothing more is counted."""
        return self._state == _BROKEN

    @property
    def in_data(self) -> bool:
        """The header is behind us: every further byte is audio."""
        return self._state == _DATA

    @property
    def bytes_per_second(self) -> float:
        """Bytes per second of the audio being counted; 0.0 until the header is read."""
        return self._bps

    def feed(self, data: bytes) -> float:
        """Seconds of audio in ``data`` (0.0 for header bytes)."""
        if self._state == _DATA:
            return len(data) / self._bps
        if self._state == _BROKEN:
            return 0.0
        self._buf += data
        pcm = self._parse()
        return pcm / self._bps if pcm > 0 else 0.0

    def _parse(self) -> int:
        """Advance through the buffered header; return PCM bytes found after it."""
        buf = self._buf
        if len(buf) < 4:
            return 0
        if bytes(buf[:4]) not in (b"RIFF", b"RF64"):
            return self._start(0, self._fallback)
        if len(buf) < 12:
            return 0
        if buf[8:12] != b"WAVE":
            return self._break()
        while len(buf) >= self._pos + 8:
            cid = bytes(buf[self._pos : self._pos + 4])
            (size,) = _U32.unpack_from(buf, self._pos + 4)
            body = self._pos + 8
            if cid == b"data":
                if self._format is None:
                    return self._break()
                return self._start(body, self._format)
            if cid == b"fmt ":
                if size < _FMT.size:
                    return self._break()
                if len(buf) < body + _FMT.size:
                    break
                if not self._read_fmt(buf, body):
                    return self._break()
            self._pos = body + size + (size & 1)  # chunks are word-aligned
            if self._pos > self._max_header:
                return self._break()
        if len(buf) > self._max_header:
            return self._break()
        return 0

    def _read_fmt(self, buf: bytearray, at: int) -> bool:
        tag, channels, rate, byte_rate, block_align, bits = _FMT.unpack_from(buf, at)
        if channels <= 0 or rate <= 0:
            return False
        width = (bits + 7) // 8
        if tag in _PCM_LIKE and width > 0:
            bps = rate * (block_align if block_align > 0 else channels * width)
        else:
            bps = byte_rate  # compressed: the declared average rate
        if bps <= 0:
            return False
        try:
            self._format = AudioFormat(rate, channels, max(width, 1))
        except ValueError:
            return False  # not a plausible PCM format: treat the header as unreadable
        self._bps = float(bps)
        return True

    def _start(self, data_at: int, fmt: AudioFormat) -> int:
        if self._format is None:
            self._format = fmt
            self._bps = float(fmt.bytes_per_second)
        pcm = len(self._buf) - data_at
        self._buf = bytearray()
        self._state = _DATA
        return pcm

    def _break(self) -> int:
        self._buf = bytearray()
        self._state = _BROKEN
        return 0

    def __repr__(self) -> str:
        state = ("header", "data", "broken")[self._state]
        return f"<WavStream {state} format={self._format}>"
