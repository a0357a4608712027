"""Incremental ``text/event-stream`` parsing across arbitrary chunk boundaries.

Follows the WHATWG event-stream rules that matter for metering: lines end in CRLF, LF or
CR (a CRLF split between two chunks is one line end); ``event:`` names the event,
``data:`` lines are joined with ``\\n``; one optional space after the colon is dropped;
lines starting with ``:`` are comments; a blank line dispatches the event (only if it has
data); an incomplete event at the end of the stream is never dispatched. A leading UTF-8
BOM is ignored.

Memory is bounded: a line or an event larger than ``max_event_bytes`` is dropped whole
(and its event with it). Scanning is incremental: each byte is searched once for line ends
(memchr speed), so a large ``data:`` line arriving in many small chunks costs linear time.
"""

from __future__ import annotations

__all__ = ["SseEvent", "SseParser"]

#: ``(event name, data)``; the name is ``"message"`` when the event had no ``event:`` line.
SseEvent = tuple[str, str]


class SseParser:
    """Feed response-body chunks; get complete events back. Never raises on bad input."""

    __slots__ = (
        "_bom",
        "_buf",
        "_data",
        "_data_size",
        "_discard",
        "_dropped",
        "_event",
        "_max",
        "_skip_lf",
    )

    def __init__(self, max_event_bytes: int = 4 * 1024 * 1024) -> None:
        self._max = max_event_bytes
        self._buf = bytearray()
        self._event = ""
        self._data: list[str] = []
        self._data_size = 0
        self._dropped = False  # current event exceeded the bound
        self._discard = False  # inside an over-long line: drop bytes up to its end
        self._skip_lf = False  # previous chunk ended in CR: a leading LF belongs to it
        self._bom = True  # a BOM may still come

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Parse ``chunk``; return the events it completed, in order."""
        events: list[SseEvent] = []
        if self._bom:
            if len(self._buf) + len(chunk) < 3 and b"\xef\xbb\xbf".startswith(
                bytes(self._buf) + chunk
            ):
                self._buf += chunk
                return events
            self._bom = False
            chunk = bytes(self._buf) + chunk
            self._buf.clear()
            if chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]
        if self._discard:
            chunk = self._skip_long_line(chunk)
        buf = self._buf
        scan = len(buf)
        buf += chunk
        n = len(buf)
        lf = buf.find(b"\n", scan)
        cr = buf.find(b"\r", scan)
        line = 0
        while lf >= 0 or cr >= 0:
            if cr < 0 or 0 <= lf < cr:
                eol = nxt = lf
                nxt += 1
            else:
                eol = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1] == 0x0A else cr + 1
                else:
                    nxt = cr + 1
                    self._skip_lf = True
            if eol - line > self._max:  # as if it had arrived in pieces: dropped whole
                self._drop_event()
            else:
                self._line(buf, line, eol, events)
            line = nxt
            if 0 <= lf < nxt:
                lf = buf.find(b"\n", nxt)
            if 0 <= cr < nxt:
                cr = buf.find(b"\r", nxt)
        if line:
            del buf[:line]
        if len(buf) > self._max:
            buf.clear()
            self._discard = True
            self._drop_event()
        return events

    def _skip_long_line(self, chunk: bytes) -> bytes:
        lf, cr = chunk.find(b"\n"), chunk.find(b"\r")
        if lf < 0 and cr < 0:
            return b""
        self._discard = False
        if cr < 0 or 0 <= lf < cr:
            return chunk[lf + 1 :]
        if cr + 1 == len(chunk):
            self._skip_lf = True
            return b""
        return chunk[cr + 2 :] if chunk[cr + 1] == 0x0A else chunk[cr + 1 :]

    def _drop_event(self) -> None:
        self._data = []
        self._data_size = 0
        self._dropped = True

    def _line(self, buf: bytearray, start: int, end: int, events: list[SseEvent]) -> None:
        if start == end:  # blank line: dispatch
            if self._data and not self._dropped:
                events.append((self._event or "message", "\n".join(self._data)))
            self._event = ""
            self._data = []
            self._data_size = 0
            self._dropped = False
            return
        if buf.startswith(b"data", start):
            value_at = start + 4
            if value_at == end:
                value = ""
            elif buf[value_at] == 0x3A:  # ":"
                value_at += 2 if value_at + 1 < end and buf[value_at + 1] == 0x20 else 1
                value = buf[value_at:end].decode("utf-8", "replace")
            else:
                return  # a field named e.g. "datum"
            if self._dropped:
                return
            self._data_size += end - value_at
            if self._data_size > self._max:
                self._drop_event()
                return
            self._data.append(value)
            return
        if buf[start] == 0x3A:  # comment
            return
        colon = buf.find(b":", start, end)
        field = bytes(buf[start : colon if colon >= 0 else end])
        if field == b"event":
            value_at = colon + 1
            if value_at < end and buf[value_at] == 0x20:
                value_at += 1
            self._event = buf[value_at:end].decode("utf-8", "replace") if colon >= 0 else ""
        # id, retry and unknown fields do not matter for metering.

    def __repr__(self) -> str:
        return f"<SseParser buffered={len(self._buf)} data_lines={len(self._data)}>"
