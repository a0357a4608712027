"""Pieces every simulated protocol shares: error bodies, a WebSocket channel, limits.

Error bodies follow vLLM's ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code``.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

__all__ = [
    "ChannelClosed",
    "WsChannel",
    "error_body",
    "error_response",
    "prompt_tokens_for_text",
    "unavailable_response",
]

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error JSON."""
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def unavailable_response() -> JSONResponse:
    """The ``handshake_503`` fault's answer (HTTP requests and WebSocket denials)."""
    return JSONResponse(
        error_body("The simulated GPU is unavailable (fault: handshake_503).", 503),
        status_code=503,
        headers={"Retry-After": "1"},
    )


def prompt_tokens_for_text(text: str, overhead: int) -> int:
    """Prefill tokens of a text prompt: ~4 UTF-8 bytes per token plus the preset's
    fixed system/voice prompt."""
    return overhead + math.ceil(len(text.encode()) / 4)


class ChannelClosed(Exception):
    """The WebSocket is gone (client closed, or a send failed)."""


class WsChannel:
    """A thin wrapper over a Starlette WebSocket that reports text or bytes frames
    uniformly and turns every "socket went away" error into :class:`ChannelClosed`.

    ``binary_as_text``: binary frames are decoded as UTF-8 text (the SageMaker bridge
    turns BINARY payload parts into text events for the inner protocol).
    """

    def __init__(self, websocket: WebSocket, *, binary_as_text: bool = False) -> None:
        self.websocket = websocket
        self.binary_as_text = binary_as_text
        self.closed = False

    async def receive(self, timeout: float | None = None) -> str | bytes:
        """The next frame. Raises ``TimeoutError`` after ``timeout`` seconds and
        :class:`ChannelClosed` when the client has gone."""
        if self.closed:
            raise ChannelClosed()
        try:
            if timeout is None:
                message = await self.websocket.receive()
            else:
                message = await asyncio.wait_for(self.websocket.receive(), timeout)
        except TimeoutError:  # an OSError subclass: must not read as "client gone"
            raise
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            self.closed = True
            raise ChannelClosed() from exc
        if message["type"] == "websocket.disconnect":
            self.closed = True
            raise ChannelClosed()
        text = message.get("text")
        if text is not None:
            return str(text)
        data = message.get("bytes") or b""
        if self.binary_as_text:
            return data.decode("utf-8", errors="replace")
        return bytes(data)

    async def send_json(self, payload: dict[str, Any]) -> None:
        await self.send_text(json.dumps(payload, separators=(",", ":"), ensure_ascii=False))

    async def send_text(self, text: str) -> None:
        if self.closed:
            raise ChannelClosed()
        try:
            await self.websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            self.closed = True
            raise ChannelClosed() from exc

    async def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ChannelClosed()
        try:
            await self.websocket.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            self.closed = True
            raise ChannelClosed() from exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.websocket.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
