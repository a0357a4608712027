"""WebSocket frames Headroom writes itself (RFC 6455 5): close frames and pings, masked
on the upstream leg (Headroom is the client there), and the fields of a close frame."""

from __future__ import annotations

import os
from typing import Final

try:  # websockets ships its C speedups optionally (a pure wheel or source build lacks them)
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - exercised by tests/unit/test_wsframes_speedups.py
    from websockets.utils import apply_mask

from proxy.admission.refusal import truncate_reason

__all__ = [
    "apply_mask", "BINARY", "CLOSE", "CONT", "PING", "TEXT", "client_code_for_upstream_close",
    "close_fields", "close_frame", "frame", "sendable_code",
]  # fmt: skip

CONT: Final = 0
TEXT: Final = 1
BINARY: Final = 2
CLOSE: Final = 8
PING: Final = 9

#: Codes a peer may put in a close frame (RFC 6455 7.4); others are mapped.
_SENDABLE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


def sendable_code(code: int | None, default: int = 1000) -> int:
    if code is None:
        return default
    if code in _SENDABLE or 3000 <= code <= 4999:
        return code
    return default


def client_code_for_upstream_close(code: int) -> int:
    """The code the client gets when the upstream closed cleanly with ``code``: its own
    when a peer may send it, 1000 for none (1005), 1011 otherwise. Both relays use this;
    a 1011 is also counted as an ``upstream_internal_error``."""
    return 1000 if code == 1005 else sendable_code(code, 1011)


def frame(opcode: int, payload: bytes, *, masked: bool) -> bytes:
    """One final frame; client-to-server frames are masked (RFC 6455 5.3)."""
    n = len(payload)
    bit = 0x80 if masked else 0
    if n < 126:
        head = bytes((0x80 | opcode, bit | n))
    elif n < 65536:
        head = bytes((0x80 | opcode, bit | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, bit | 127)) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + apply_mask(payload, key)


def close_frame(code: int, reason: str, *, masked: bool) -> bytes:
    return frame(CLOSE, code.to_bytes(2, "big") + truncate_reason(reason).encode(), masked=masked)


def close_fields(payload: bytes) -> tuple[int, str]:
    if len(payload) < 2:
        return 1005, ""
    return int.from_bytes(payload[:2], "big"), payload[2:].decode(errors="replace")
