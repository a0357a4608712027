"""JSON events that carry base64 audio, read without decoding the audio.

Audio events (``response.output_audio.delta``, ``speech.audio.delta``, ...) are a few
hundred bytes of JSON around one large base64 string. :func:`scan_event` finds that
string's span by scanning (``str.find``, i.e. memchr speed), cuts it out, and parses only
the small remainder with :func:`json.loads`. The decoded audio length is then computed from
the span's length and padding (:func:`b64_decoded_len`); nothing is decoded.

The fast path accepts a text only when the result provably equals what a full
``json.loads`` would give (verified with hypothesis in ``tests/unit``): the key occurs
exactly once and neither the span nor the remainder holds a backslash. Anything else falls
back to a full ``json.loads``; that includes payloads whose ``/`` an encoder escaped as
``\\/`` (PHP, some Java libraries): counting those escapes with ``str.count`` costs more than
``json.loads``'s C scanner, which then unescapes them.

The base64 characters themselves are not validated (that would cost a pass over the
payload): a string of the wrong length counts as zero bytes.
"""

from __future__ import annotations

import binascii
import json
from collections.abc import Callable
from typing import Any

__all__ = ["FAST_PATH_MIN", "B64Span", "b64_decoded_len", "fast_scan", "scan_event"]

#: Texts shorter than this are parsed with json.loads directly (it is faster for them).
FAST_PATH_MIN = 512

_WS = " \t\r\n"

Event = dict[str, Any]

# json.loads minus its Python-level wrapper, a sizeable part of a small event's cost.
_scan_once: Callable[[str, int], tuple[Any, int]]
_scan_once = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(text: str) -> Any:
    """``json.loads(text)``, or None where json.loads would raise."""
    n = len(text)
    i = 0
    while i < n and text[i] in _WS:
        i += 1
    try:
        value, end = _scan_once(text, i)
    except (StopIteration, ValueError, RecursionError):
        return None
    while end < n and text[end] in _WS:
        end += 1
    return value if end == n else None


def b64_decoded_len(nchars: int, padding: int) -> int:
    """Bytes that ``nchars`` base64 characters decode to, ``padding`` of them trailing ``=``.

    Handles padded and unpadded encodings; lengths no encoder produces (``nchars % 4 == 1``,
    more than two ``=``, padding in an incomplete group) give 0."""
    if padding > 2 or nchars < 0:
        return 0
    rest = nchars % 4
    if rest == 0:
        return nchars // 4 * 3 - padding if nchars else 0
    if padding or rest == 1:
        return 0
    return nchars // 4 * 3 + rest - 1


class B64Span:
    """An (unescaped) base64 string: ``source[start:end]``."""

    __slots__ = ("end", "source", "start")

    def __init__(self, source: str, start: int, end: int) -> None:
        self.source = source
        self.start = start
        self.end = end

    @property
    def nbytes(self) -> int:
        """Decoded length, computed arithmetically."""
        src, start, end = self.source, self.start, self.end
        pad = 0
        while pad < 3 and end - pad > start and src[end - pad - 1] == "=":
            pad += 1
        return b64_decoded_len(end - start, pad)

    def startswith(self, prefix: str) -> bool:
        """Whether the base64 text starts with ``prefix``."""
        return self.source.startswith(prefix, self.start, self.end)

    def head(self, nbytes: int) -> bytes:
        """Decode about the first ``nbytes`` bytes (a whole number of groups); b"" if invalid."""
        nchars = -(-nbytes // 3) * 4
        text = self.source[self.start : min(self.end, self.start + nchars)]
        text = text[: len(text) - len(text) % 4]
        try:
            return binascii.a2b_base64(text)
        except (binascii.Error, ValueError):
            return b""

    def __repr__(self) -> str:
        return f"<B64Span {self.end - self.start} chars, {self.nbytes} bytes>"


def fast_scan(text: str, key: str) -> tuple[Event, B64Span] | None:
    """The fast path for one ``key``: ``(event with that field emptied, span)`` or None.

    None means "not provably simple" (key absent, not a top-level string, escapes, ...):
    the caller must fall back to :func:`json.loads`."""
    token = f'"{key}"'
    i = text.find(token)
    return None if i < 0 else _fast_at(text, key, token, i)


def _fast_at(text: str, key: str, token: str, i: int) -> tuple[Event, B64Span] | None:
    n = len(text)
    j = i + len(token)
    while j < n and text[j] in _WS:
        j += 1
    if j >= n or text[j] != ":":
        return None
    j += 1
    while j < n and text[j] in _WS:
        j += 1
    if j >= n or text[j] != '"':
        return None
    start = j + 1
    end = text.find('"', start)
    if end < 0:
        return None
    if text.find("\\", start, end) >= 0:
        # Escapes ("\\/" from some encoders): counting them costs more than json.loads's
        # own C scanner, which the caller falls back to.
        return None
    rest = text[:start] + text[end:]
    # Without any backslash every quote in `rest` is a delimiter, so a single occurrence
    # of the token that json.loads reports as a top-level "" is the span we cut out.
    if "\\" in rest or rest.count(token) != 1:
        return None
    event = _loads(rest)
    if type(event) is not dict or event.get(key) != "":
        return None
    return event, B64Span(text, start, end)


def scan_event(text: str, audio_keys: tuple[str, ...]) -> tuple[Event, B64Span | None] | None:
    """Parse a JSON-object event whose audio is the first of ``audio_keys`` holding a string.

    Returns None if ``text`` is not a JSON object; else ``(event, span)`` where ``span``
    is that field's base64 (None if no key holds a string) and ``event`` is the object
    with that field replaced by ``""`` (callers read only the other fields). Never raises.
    """
    if len(text) >= FAST_PATH_MIN:
        for key in audio_keys:
            token = f'"{key}"'
            i = text.find(token)
            if i >= 0:
                hit = _fast_at(text, key, token, i)
                if hit is not None:
                    return hit
                break  # present but unusual: let json.loads decide
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if type(event) is not dict:
        return None
    for key in audio_keys:
        value = event.get(key)
        if isinstance(value, str):
            event[key] = ""
            return event, B64Span(value, 0, len(value))
    return event, None
