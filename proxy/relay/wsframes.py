"""WebSocket framing (RFC 6455 5), pure: no sockets, no event loop.

Every rule Headroom applies to a frame lives here, and the I/O shells call it:

- the header: FIN, the three reserved bits (no extension is ever negotiated, so any set
  bit is refused), the opcode (0x3-0x7 and 0xB-0xF are reserved), the mask bit (5.1:
  frames from a client are masked, frames from a server are not), the payload length in
  7, 7+16 or 7+64 bits (5.2; a length in a longer encoding than it needs is accepted, as
  websockets accepts it, and a 64-bit length must leave its top bit clear);
- control frames (5.5): at most 125 payload bytes and never fragmented;
- fragmentation (5.4): a continuation frame only inside a message, no new data message
  inside one;
- close frames (5.5.1, 7.4): no payload or a code of two bytes, a code a peer may send,
  a reason in UTF-8;
- text messages: UTF-8 (checked on the whole message: a fragment may end inside a
  character).

:func:`parse_frame` decodes one whole frame with all of these checks and raises
:class:`FrameError` with the close code a peer that broke one is answered with (1002,
1007, 1009). The splice's frame walk (:mod:`proxy.relay.splice_leg`) reads frames in
place, across reads, without copying payloads; it tests a header against
:data:`INVALID_FIRST_BYTE`, names what it refused with :func:`violation`, and reads the
lengths in place with the arithmetic of :func:`header_size` and :func:`payload_length`
(calling them for every frame slows the compiled walk: docs/performance.md);
tests/unit/test_wsframes.py holds its refusals equal to :func:`parse_frame`'s on
arbitrary streams. The client WebSocket server
(:mod:`proxy.relay.ws_server`) finds frame boundaries with :func:`whole_frames`.

Frames Headroom writes itself (close frames, pings, the frames of a take-over) are built
by :func:`frame`; frames toward a server are masked with a fresh random key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from proxy.admission.refusal import truncate_reason
from proxy.relay.library_contract import fast_mask

__all__ = [
    "BINARY", "CLOSE", "CONT", "INVALID_FIRST_BYTE", "INVALID_TEXT", "PING", "PONG",
    "RESERVED_OPCODES", "TEXT", "Frame", "FrameError", "apply_mask",
    "client_code_for_upstream_close", "client_frame", "close_error", "close_fields",
    "close_frame", "decode_text", "encode", "fragment", "frame", "header_size", "mask_bytes",
    "parse_frame", "payload_length", "sendable_code", "violation", "whole_frames",
]  # fmt: skip

CONT: Final = 0x0
TEXT: Final = 0x1
BINARY: Final = 0x2
CLOSE: Final = 0x8
PING: Final = 0x9
PONG: Final = 0xA

#: Opcodes 0x3-0x7 and 0xB-0xF are reserved (RFC 6455 5.2): bit n set for opcode n.
RESERVED_OPCODES: Final = 0b1111_1000_1111_1000

#: Indexed by a frame's first byte: 1 if it sets a reserved bit or a reserved opcode
#: (one lookup on the splice's hot path instead of three tests).
INVALID_FIRST_BYTE: Final = bytes(
    [1 if b & 0x70 or RESERVED_OPCODES >> (b & 0x0F) & 1 else 0 for b in range(256)]
)

#: The largest control frame payload (RFC 6455 5.5).
MAX_CONTROL_PAYLOAD: Final = 125

#: Codes a peer may put in a close frame (RFC 6455 7.4); others are mapped.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


class FrameError(ValueError):
    """A frame or message that breaks RFC 6455. ``code`` is the close code its sender is
    answered with: 1002 (protocol error), 1007 (invalid UTF-8) or 1009 (too big)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its opcode, its payload (unmasked) and its FIN bit."""

    opcode: int
    payload: bytes
    fin: bool = True


# -- masking ------------------------------------------------------------------------------


def mask_bytes(data: bytes, key: bytes) -> bytes:
    """``data`` XOR the 4-byte ``key`` repeated (RFC 6455 5.3), in pure Python."""
    n = len(data)
    if not n:
        return b""
    repeated = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(repeated, "little")).to_bytes(
        n, "little"
    )


#: Masking (and unmasking: the same XOR): websockets' C implementation where it is
#: installed, :func:`mask_bytes` otherwise (see :mod:`proxy.relay.library_contract`).
apply_mask = fast_mask() or mask_bytes


# -- the header -----------------------------------------------------------------------------


def violation(b0: int, b1: int, from_client: bool, in_message: bool) -> str | None:
    """What is wrong with a frame header whose first two bytes are ``b0``, ``b1`` (read
    from a client if ``from_client``; ``in_message``: a fragmented message is in
    progress), or None."""
    opcode = b0 & 0x0F
    if b0 & 0x70:
        return "reserved bits set without an extension"
    if RESERVED_OPCODES >> opcode & 1:
        return f"reserved opcode {opcode:#x}"
    if bool(b1 & 0x80) != from_client:
        return "unmasked client frame" if from_client else "masked server frame"
    if opcode >= 8:
        if not b0 & 0x80 or (b1 & 0x7F) > MAX_CONTROL_PAYLOAD:
            return "invalid control frame"
        return None
    if opcode and in_message:
        return "new message inside a fragmented one"
    if not opcode and not in_message:
        return "continuation frame outside a message"
    return None


def header_size(b1: int) -> int:
    """The length of a frame header whose second byte is ``b1``: 2, 4 or 10 bytes, and
    4 more for a masking key."""
    length = b1 & 0x7F
    size = 2 if length < 126 else 4 if length == 126 else 10
    return size + 4 if b1 & 0x80 else size


def payload_length(data: bytes | bytearray, i: int) -> int:
    """The payload length of the frame whose header starts at ``data[i]`` (the header
    must be whole: :func:`header_size`)."""
    length = data[i + 1] & 0x7F
    if length == 126:
        return data[i + 2] << 8 | data[i + 3]
    if length == 127:
        return int.from_bytes(data[i + 2 : i + 10], "big")
    return length


def parse_frame(
    data: bytes | bytearray,
    pos: int = 0,
    *,
    from_client: bool,
    in_message: bool = False,
    max_size: int | None = None,
) -> tuple[Frame, int] | None:
    """The frame at ``data[pos]`` and the offset just past it, or None while it is not
    whole. Raises :class:`FrameError`: 1002 for a header :func:`violation`, a 64-bit
    length with its top bit set or a close frame :func:`close_error` refuses (1007 for a
    close reason not in UTF-8), 1009 for a payload over ``max_size``."""
    end = len(data)
    if end - pos < 2:
        return None
    b0, b1 = data[pos], data[pos + 1]
    wrong = violation(b0, b1, from_client, in_message)
    if wrong is not None:
        raise FrameError(1002, wrong)
    h = header_size(b1)
    if end - pos < h:
        return None
    length = payload_length(data, pos)
    if length >> 63:
        raise FrameError(1002, "payload length with its most significant bit set")
    if max_size is not None and length > max_size:
        raise FrameError(1009, f"frame over {max_size} bytes")
    start = pos + h
    if end - start < length:
        return None
    payload = bytes(data[start : start + length])
    if b1 & 0x80:
        payload = apply_mask(payload, bytes(data[start - 4 : start]))
    opcode = b0 & 0x0F
    if opcode == CLOSE:
        error = close_error(payload)
        if error is not None:
            raise FrameError(*error)
    return Frame(opcode, payload, bool(b0 & 0x80)), start + length


def whole_frames(data: bytes | bytearray, max_size: int | None) -> int:
    """How many leading bytes of ``data`` (frames from a frame boundary) are whole
    frames. A frame still arriving that declares more than ``max_size`` bytes counts as
    whole, so that a parser sees (and refuses) it at once."""
    pos, end = 0, len(data)
    while end - pos >= 2:
        h = header_size(data[pos + 1])
        if end - pos < h:
            break
        length = payload_length(data, pos)
        if pos + h + length > end:
            if max_size is not None and length > max_size:
                return end
            break
        pos += h + length
    return pos


# -- messages and close frames ----------------------------------------------------------------


#: The answer to a text message that is not UTF-8.
INVALID_TEXT: Final = (1007, "invalid UTF-8 in a text message")


def decode_text(payload: bytes) -> str | None:
    """A whole text message's payload as text; None if it is not UTF-8 (answered with
    :data:`INVALID_TEXT`)."""
    try:
        return payload.decode()
    except UnicodeDecodeError:
        return None


def sendable_code(code: int | None, default: int = 1000) -> int:
    """``code`` if a peer may send it in a close frame (RFC 6455 7.4), else ``default``."""
    if code is None:
        return default
    if code in _SENDABLE or 3000 <= code <= 4999:
        return code
    return default


def client_code_for_upstream_close(code: int) -> int:
    """The code the client gets when the upstream closed cleanly with ``code``: its own
    when a peer may send it, 1000 for none (1005), 1011 otherwise (also counted as an
    ``upstream_internal_error``)."""
    return 1000 if code == 1005 else sendable_code(code, 1011)


def close_fields(payload: bytes) -> tuple[int, str]:
    """A close frame's code (1005: none) and reason, read leniently (see
    :func:`close_error` for the checks)."""
    if len(payload) < 2:
        return 1005, ""
    return int.from_bytes(payload[:2], "big"), payload[2:].decode(errors="replace")


def close_error(payload: bytes) -> tuple[int, str] | None:
    """Why a close frame's payload is invalid (RFC 6455 5.5.1, 7.4), as the close code and
    reason its sender is answered with; None if it is valid."""
    if not payload:
        return None
    if len(payload) == 1:
        return 1002, "invalid close frame"
    code = int.from_bytes(payload[:2], "big")
    if sendable_code(code, -1) != code:
        return 1002, "invalid close frame"
    try:
        payload[2:].decode()
    except UnicodeDecodeError:
        return 1007, "invalid UTF-8 in the close reason"
    return None


# -- frames Headroom writes -------------------------------------------------------------------


def encode(opcode: int, payload: bytes, *, fin: bool = True, key: bytes | None = None) -> bytes:
    """One frame in the shortest length encoding; masked with ``key`` (4 bytes) if given."""
    n = len(payload)
    first = (0x80 if fin else 0) | opcode
    bit = 0x80 if key is not None else 0
    if n < 126:
        head = bytes((first, bit | n))
    elif n < 65536:
        head = bytes((first, bit | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((first, bit | 127)) + n.to_bytes(8, "big")
    if key is None:
        return head + payload
    return head + key + apply_mask(payload, key)


def frame(opcode: int, payload: bytes, *, masked: bool) -> bytes:
    """One final frame; frames toward a server are masked with a random key (5.3)."""
    return encode(opcode, payload, key=os.urandom(4) if masked else None)


def close_frame(code: int, reason: str, *, masked: bool) -> bytes:
    """A close frame with ``code`` and ``reason`` (cut to fit a control frame)."""
    return frame(CLOSE, code.to_bytes(2, "big") + truncate_reason(reason).encode(), masked=masked)


def client_frame(message: Mapping[str, Any]) -> bytes:
    """An ASGI ``websocket.receive`` message as the masked frame a client would send."""
    text = message.get("text")
    if text is not None:
        return frame(TEXT, text.encode(), masked=True)
    return frame(BINARY, message.get("bytes") or b"", masked=True)


def fragment(opcode: int, payload: bytes) -> bytes:
    """A frame of a message still being assembled, as a client sends it (masked, no FIN)."""
    return encode(opcode, payload, fin=False, key=os.urandom(4))
