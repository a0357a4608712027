"""Helpers shared by the simulator tests (SSE parsing, reference audio)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as str)."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def speech_file(url: str, text: str, fmt: str = "pcm", **extra: Any) -> bytes:
    """The non-streaming speech for ``text`` (the reference the streams must match)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(
            "/v1/audio/speech", json={"input": text, "response_format": fmt, **extra}
        )
        assert response.status_code == 200, response.text
        return response.content
