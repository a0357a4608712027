"""WebSocket frames Headroom writes itself (RFC 6455 5): close frames and pings, masked
on the upstream leg (Headroom is the client there), and the fields of a close frame."""

from __future__ import annotations

import os

from websockets.speedups import apply_mask

from proxy.refusal import truncate_reason

__all__ = ["BINARY", "CLOSE", "CONT", "PING", "TEXT", "close_fields", "close_frame", "frame"]

CONT, TEXT, BINARY, CLOSE, PING = 0, 1, 2, 8, 9


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
