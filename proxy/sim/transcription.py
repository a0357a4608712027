"""vLLM ``POST /v1/audio/transcriptions`` (multipart upload), streaming SSE or not.

The upload is a WAV file (PCM16, any rate and channel count) or raw PCM16 mono at
16 kHz. The whole clip is available at once, so the engine runs the sequence free:
one transcript token per ``1/token_rate`` s of audio, a ``transcription.chunk`` SSE
event per emitted segment, the last with ``finish_reason: "stop"``, an optional usage
chunk (``stream_include_usage``), then ``data: [DONE]``. Errors mid-stream are an SSE
``data: {"error": {...}}`` event followed by ``[DONE]``, as vLLM streams them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from proxy.sim.audio import words_for_tokens
from proxy.sim.common import error_body, error_response, unavailable_response
from proxy.sim.engine_runner import EngineStopped
from proxy.sim.multipart import MultipartError, parse_multipart

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["audio_duration_s", "create_transcription"]

MAX_UPLOAD_BYTES = 25 * 1024 * 1024
_TRUE = ("true", "1", "yes", "on")
_FAULT_MESSAGE = "simulated engine fault (headroom sim --fault-error-after)"


def audio_duration_s(data: bytes, filename: str, content_type: str) -> float:
    """Seconds of audio in an uploaded WAV (PCM16) or raw PCM16 16 kHz mono file;
    ``ValueError`` for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        pos, fmt, data_len = 12, None, None
        while pos + 8 <= len(data):
            cid, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
            body = data[pos + 8 : pos + 8 + size]
            if cid == b"fmt " and len(body) >= 16:
                fmt = body
            elif cid == b"data":
                # Streaming WAVs carry 0xFFFFFFFF: the data runs to the end of the file.
                data_len = min(size, len(data) - pos - 8)
                break
            pos += 8 + size + (size & 1)
        if fmt is None or data_len is None:
            raise ValueError("WAV file without fmt or data chunk")
        tag = int.from_bytes(fmt[0:2], "little")
        channels = int.from_bytes(fmt[2:4], "little")
        rate = int.from_bytes(fmt[4:8], "little")
        bits = int.from_bytes(fmt[14:16], "little")
        if tag not in (1, 0xFFFE) or bits != 16 or not channels or not rate:
            raise ValueError("only 16-bit PCM WAV files are supported by headroom sim")
        return data_len / (rate * channels * 2)
    if filename.lower().endswith((".pcm", ".raw")) or content_type in (
        "audio/pcm",
        "audio/l16",
        "application/octet-stream",
    ):
        if len(data) % 2:
            raise ValueError("raw PCM16 audio must have an even number of bytes")
        return len(data) / 32000
    raise ValueError("unsupported audio format: send a 16-bit PCM WAV file or raw PCM16 16 kHz")


def _chunk(rid: str, created: int, model: str, content: str, finish: str | None) -> bytes:
    event = {
        "id": rid,
        "object": "transcription.chunk",
        "created": created,
        "model": model,
        "choices": [{"delta": {"content": content}, "finish_reason": finish, "stop_reason": None}],
    }
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def create_transcription(gpu: SimGpu, request: Request) -> Response:
    """The endpoint."""
    if gpu.faults.handshake_503:
        return unavailable_response()
    preset = gpu.preset
    if preset.kind != "asr":
        return error_response(
            f"This simulated GPU serves the TTS model {preset.model}; "
            "/v1/audio/transcriptions needs an ASR preset.",
            404,
        )
    raw = await request.body()
    if len(raw) > MAX_UPLOAD_BYTES + 64 * 1024:
        return error_response("Maximum file size exceeded (25 MiB)", 413, "file")
    try:
        form = parse_multipart(raw, request.headers.get("content-type", ""))
    except MultipartError as exc:
        return error_response(str(exc), 400)
    upload = form.get("file")
    if upload is None or upload.filename is None:
        return error_response("'file' (the audio upload) is required", 400, "file")
    model = form.text("model")
    if model and model != preset.model:
        return error_response(f"The model `{model}` does not exist.", 404, "model")
    fmt = form.text("response_format") or "json"
    if fmt not in ("json", "text", "verbose_json"):
        return error_response(f"response_format '{fmt}' is not supported by headroom sim", 400)
    try:
        duration = audio_duration_s(upload.data, upload.filename, upload.content_type)
    except ValueError as exc:
        return error_response(str(exc), 400, "file")
    stream_mode = form.text("stream").lower() in _TRUE
    include_usage = form.text("stream_include_usage").lower() in _TRUE
    rate = preset.token_rate_hz
    tokens = max(1, math.ceil(duration * rate))
    faults = gpu.stream_faults()
    seed = gpu.next_session_seed()
    prompt = preset.prompt_overhead_tokens
    rid = f"trsc-{uuid.uuid4().hex}"
    created = int(time.time())

    async def segments() -> AsyncGenerator[tuple[str, bool], None]:
        await faults.slow_start()
        stream = gpu.open_stream(prompt_tokens=prompt, output_tokens=tokens)
        first = True
        try:
            while True:
                em = await stream.next()
                text = words_for_tokens(seed, em.start, em.end, rate)
                if first:
                    text, first = text.lstrip(), False
                yield text, em.final
                if em.final:
                    return
        finally:
            stream.cancel()

    if not stream_mode:
        try:
            async with aclosing(segments()) as parts:
                text = "".join([t async for t, _ in parts])
        except EngineStopped as exc:
            return error_response(str(exc), 503)
        action = await faults.before_chunk()
        if action == "drop":
            await gpu.drop(request.scope)
            return Response(b"")
        if action == "error":
            return error_response(_FAULT_MESSAGE, 500)
        if fmt == "text":
            return PlainTextResponse(text)
        body: dict[str, Any] = {"text": text, "usage": {"type": "duration", "seconds": duration}}
        if fmt == "verbose_json":
            body |= {"task": "transcribe", "language": form.text("language") or "en",
                     "duration": duration, "segments": []}  # fmt: skip
        return JSONResponse(body)

    async def sse() -> AsyncIterator[bytes]:
        completed = False
        try:
            async with aclosing(segments()) as parts:
                async for text, final in parts:
                    action = await faults.before_chunk()
                    if action == "drop":
                        await gpu.drop(request.scope)
                        return
                    if action == "error":
                        error = error_body(_FAULT_MESSAGE, 500)
                        yield f"data: {json.dumps(error)}\n\n".encode()
                        break
                    yield _chunk(rid, created, preset.model, text, "stop" if final else None)
                    completed = final
        except EngineStopped as exc:
            yield f"data: {json.dumps(error_body(str(exc), 503))}\n\n".encode()
        if completed and include_usage:
            usage = {
                "id": rid,
                "object": "transcription.chunk",
                "created": created,
                "model": preset.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": tokens,
                    "total_tokens": prompt + tokens,
                },
            }
            yield f"data: {json.dumps(usage, separators=(',', ':'))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")
