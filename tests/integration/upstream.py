"""A real upstream written for the relay tests: a raw ASGI app served by uvicorn.

WebSocket paths (any path works; behaviour by path):
  /ws/echo          echo text as text and binary as binary; accept the first offered
                    subprotocol; a text "close:<code>:<reason>" closes with that code;
                    on connect sends {"type": "hello", "headers": {...}, "query": "..."}
  /ws/stream        sends binary chunks on demand: the test sets ``controls.release``
HTTP paths:
  /sse              SSE: one event, then waits for ``controls.release`` before the rest
                    (or for the client to disconnect, and then ends)
  /echo-http        echoes method, headers, query and body as JSON
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Controls:
    release: asyncio.Event = field(default_factory=asyncio.Event)
    ws_connections: int = 0
    ws_active: int = 0
    client_close_codes: list[int] = field(default_factory=list)


class FakeEngine:
    """The upstream app; see the module docstring."""

    def __init__(self) -> None:
        self.controls = Controls()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self._http(scope, receive, send)

    async def _websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        c = self.controls
        await receive()
        c.ws_connections += 1
        c.ws_active += 1
        try:
            subprotocols = scope.get("subprotocols") or []
            chosen = subprotocols[0] if subprotocols else None
            await send({"type": "websocket.accept", "subprotocol": chosen})
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            await send({"type": "websocket.send", "text": json.dumps(
                {"type": "hello", "headers": headers,
                 "query": scope["query_string"].decode(), "path": scope["path"]})})  # fmt: skip
            if scope["path"].endswith("/stream"):
                await c.release.wait()
                for i in range(10):
                    await send({"type": "websocket.send", "bytes": bytes([i]) * 9600})
                await send({"type": "websocket.close", "code": 1000})
                return
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    c.client_close_codes.append(message.get("code", 0))
                    return
                text = message.get("text")
                if text is not None and text.startswith("close:"):
                    _, code, reason = text.split(":", 2)
                    await send({"type": "websocket.close", "code": int(code), "reason": reason})
                    return
                if text is not None:
                    await send({"type": "websocket.send", "text": text})
                else:
                    await send({"type": "websocket.send", "bytes": message["bytes"]})
        finally:
            c.ws_active -= 1

    async def _released_before_disconnect(self, receive: Any) -> bool:
        """Wait for ``controls.release``; False if the client disconnected first. (An
        engine that ignored the disconnect would hold the server's shutdown for its
        whole graceful timeout.)"""
        release = asyncio.ensure_future(self.controls.release.wait())
        gone = asyncio.ensure_future(receive())
        try:
            done, _ = await asyncio.wait({release, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (release, gone):
                task.cancel()
            await asyncio.gather(release, gone, return_exceptions=True)
        return release in done

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/sse":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'event: first\ndata: {"n": 1}\n\n'})  # fmt: skip
            if not await self._released_before_disconnect(receive):
                return  # the client left: a real engine stops generating too
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'event: second\ndata: {"n": 2}\n\n'})  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            return
        payload = json.dumps(
            {
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"].decode(),
                "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
                "body": body.decode(errors="replace"),
            }
        ).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"x-upstream", b"yes")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})
