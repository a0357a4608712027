"""An upstream that streams known audio in each protocol's own format, for metering tests.

Every stream is ten chunks of 0.2 s of 24 kHz mono PCM16 (9,600 bytes each), i.e. exactly
2.0 s of audio, optionally with a pause of ``pause_s`` after the fifth chunk and
``spacing_s`` between chunks. Paths select the format:

  WS  /v1/audio/speech/stream     vllm-omni: audio.start + 10 binary frames + audio.done
  WS  /v1/realtime                vLLM-Omni: 10 x response.audio.delta (base64)
  WS  /openai/realtime            OpenAI: 10 x response.output_audio.delta (base64)
  WS  /v1/asr                     ASR: 10 x transcription.delta then transcription.done
  HTTP /v1/audio/speech           body stream_format "sse" -> 10 SSE speech.audio.delta,
                                  "audio" + response_format pcm|wav -> raw bytes
  HTTP /v1/audio/transcriptions   SSE transcription.chunk x 10 + [DONE]
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Any

CHUNK = bytes(9600)  # 0.2 s of 24 kHz mono 16-bit silence
RATE = 24000


def wav_header(data_bytes: int = 0xFFFFFFFF - 36) -> bytes:
    return (
        b"RIFF" + struct.pack("<I", data_bytes + 36) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
        + b"data" + struct.pack("<I", data_bytes)
    )  # fmt: skip


class AudioEngine:
    """The upstream app; see the module docstring."""

    def __init__(self, spacing_s: float = 0.0, pause_s: float = 0.0) -> None:
        self.spacing_s = spacing_s
        self.pause_s = pause_s

    async def _pace(self, i: int) -> None:
        if i == 5 and self.pause_s:
            await asyncio.sleep(self.pause_s)
        elif i and self.spacing_s:
            await asyncio.sleep(self.spacing_s)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                done = "startup" if message["type"] == "lifespan.startup" else "shutdown"
                await send({"type": f"lifespan.{done}.complete"})
                if done == "shutdown":
                    return
        elif scope["type"] == "websocket":
            await self._ws(scope, receive, send)
        else:
            await self._http(scope, receive, send)

    async def _ws(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        path = scope["path"]

        async def text(event: dict[str, Any]) -> None:
            await send({"type": "websocket.send", "text": json.dumps(event)})

        if path == "/v1/asr":
            # wait for the client's final commit, then transcribe
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                event = json.loads(message.get("text") or "{}")
                if event.get("type") == "input_audio_buffer.commit" and event.get("final"):
                    break
        elif path == "/v1/audio/speech/stream":
            while True:  # session.config, input.text..., input.done
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if json.loads(message["text"]).get("type") == "input.done":
                    break
            await text({"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                        "sentence_text": "hi", "format": "pcm", "sample_rate": RATE})  # fmt: skip
        b64 = base64.b64encode(CHUNK).decode()
        for i in range(10):
            await self._pace(i)
            if path == "/v1/audio/speech/stream":
                await send({"type": "websocket.send", "bytes": CHUNK})
            elif path == "/v1/realtime":
                await text({"type": "response.audio.delta", "audio": b64, "sample_rate_hz": RATE})
            elif path == "/openai/realtime":
                await text({"type": "response.output_audio.delta", "delta": b64})
            else:
                await text({"type": "transcription.delta", "delta": f"word{i} "})
        if path == "/v1/audio/speech/stream":
            await text({"type": "audio.done"})
            await text({"type": "session.done"})
        elif path == "/v1/asr":
            await text({"type": "transcription.done", "text": "...", "usage": {}})
        await send({"type": "websocket.close", "code": 1000})

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        request = json.loads(body) if path == "/v1/audio/speech" else {}
        sse = path == "/v1/audio/transcriptions" or request.get("stream_format") == "sse"
        wav = request.get("response_format") == "wav"
        ctype = b"text/event-stream" if sse else (b"audio/wav" if wav else b"audio/pcm")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype)]})  # fmt: skip
        b64 = base64.b64encode(CHUNK).decode()
        for i in range(10):
            await self._pace(i)
            if path == "/v1/audio/transcriptions":
                event = {
                    "object": "transcription.chunk",
                    "choices": [{"delta": {"content": f"w{i} "}, "finish_reason": None}],
                }
                chunk = f"data: {json.dumps(event)}\n\n".encode()  # fmt: skip
            elif sse:
                event = {"audio": b64, "response_format": "pcm"}
                chunk = f"event: speech.audio.delta\ndata: {json.dumps(event)}\n\n".encode()
            elif wav and i == 0:
                chunk = wav_header() + CHUNK
            else:
                chunk = CHUNK
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = b"data: [DONE]\n\n" if path == "/v1/audio/transcriptions" else b""
        if sse and path == "/v1/audio/speech":
            tail = b'event: speech.audio.done\ndata: {"usage": {}}\n\n'
        await send({"type": "http.response.body", "body": tail})
