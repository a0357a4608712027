"""One probe session per protocol, as a client: send a request, meter what comes back.

Every arrival goes through Headroom's own adapters (:func:`proxy.metering.adapters.ws_adapter`,
:func:`proxy.metering.adapters.http_adapter`) into a
:class:`proxy.metering.session_meter.SessionMeter`, so the
probe measures with exactly the definitions the gateway uses; a :class:`SessionRecorder`
turns the meter's observations into an :class:`~proxy.probe.analysis.SessionTrace`.

==============================  ==============================================================
``vllm-omni-speech-ws``         WS: ``session.config`` (pcm, ``stream_audio``), ``input.text``,
                                ``input.done``; reads to ``session.done``, ``session.close``
``openai-speech-http``          POST ``stream=true``, ``stream_format`` audio (raw PCM) or sse
``vllm-realtime`` (ASR)         WS: ``session.update``, ``input_audio_buffer.append`` (burst, or
                                ``asr_pace`` x realtime), ``commit``, ``commit final``; reads
                                to ``transcription.done``
``openai-transcription-sse``    POST multipart WAV upload with ``stream=true``; reads to ``[DONE]``
``openai-completions-tokens``   POST a streaming completion; reads to ``[DONE]``
                                (:mod:`proxy.probe.completions_session`)
==============================  ==============================================================

Outcomes: a 503/429 response or handshake, or a WebSocket closed with 1013, raises
:class:`Refusal`; anything else that stops a session early raises :class:`SessionFailed`
(websockets and httpx exceptions are translated here and go no further). HTTP body reads
go to the adapter as read: it joins the reads TCP split one chunk into, and holds the
last one until the body ends, so the adapter's ``response_complete`` runs before the
meter finishes (also when the level's end cuts the session).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import wave
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from proxy.metering.adapters import AudioFormat, http_adapter, ws_adapter
from proxy.metering.adapters.sse import SseParser
from proxy.probe.completions_session import run_completion
from proxy.probe.probe_session import ClientOptions, Refusal, SessionFailed, SessionRecorder
from proxy.probe.workload import ASR_SAMPLE_RATE, AudioRequest, Request, SpeechRequest

__all__ = ["run_session"]
_MAX_ERROR_BODY = 4096
#: Headroom's queue feedback: the event that ends a session's wait in its queue.
_ADMITTED = "headroom.admitted"


def _event(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers.get("retry-after", ""))
    except ValueError:
        return None


def _error_text(event: Mapping[str, Any]) -> str:
    err = event.get("error", event.get("message"))
    if isinstance(err, dict):
        err = err.get("message") or err.get("code")
    return str(err or event)[:300]


@contextlib.asynccontextmanager
async def _ws(opts: ClientOptions, rec: SessionRecorder) -> AsyncIterator[ClientConnection]:
    """A WebSocket to the endpoint, opened for ``rec`` when the handshake is answered;
    refusals and failures translated."""
    try:
        ws = await connect(
            opts.url,
            compression=None,
            additional_headers=list(opts.headers),
            open_timeout=opts.open_timeout_s,
            close_timeout=1.0,
            max_size=16 * 2**20,
        )
    except InvalidStatus as exc:
        status, headers = exc.response.status_code, exc.response.headers
        if status in (503, 429):
            reason = headers.get("x-headroom-reason") or f"HTTP {status}"
            raise Refusal(reason, _retry_after(headers)) from None
        raise SessionFailed(f"WebSocket handshake rejected: HTTP {status}") from None
    except (OSError, TimeoutError, WebSocketException) as exc:
        raise SessionFailed(f"cannot connect to {opts.url}: {exc or type(exc).__name__}") from None
    rec.opened(rec.clock())
    try:
        yield ws
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd is not None else None
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        if code == 1013:
            raise Refusal(reason or "closed 1013 (try again later)") from None
        closed = f"{code} {reason}".strip() if code else "no close frame"
        raise SessionFailed(f"connection closed early ({closed})") from None
    finally:
        with contextlib.suppress(Exception):
            await ws.close()


async def _after_error(ws: ClientConnection, error: str) -> None:
    """An error event: Headroom's ``refusal: close`` routes close with 1013 right after
    it (a refusal); anything else is a failed session. Waits at most 1 s for the close."""
    try:
        async with asyncio.timeout(1.0):
            while True:
                await ws.recv()
    except TimeoutError:
        pass
    except ConnectionClosed as exc:
        if exc.rcvd is not None and exc.rcvd.code == 1013:
            raise Refusal(exc.rcvd.reason or error) from None
    raise SessionFailed(f"error event: {error}")


async def _speech_ws(opts: ClientOptions, req: SpeechRequest, rec: SessionRecorder) -> None:
    adapter = ws_adapter(opts.protocol, rec.meter, AudioFormat(opts.sample_rate))
    config: dict[str, Any] = {"type": "session.config", "response_format": "pcm"}
    config["stream_audio"] = True
    config.update(_speech_fields(opts, req))
    async with _ws(opts, rec) as ws:
        for message in (config, {"type": "input.text", "text": req.text}, {"type": "input.done"}):
            text = json.dumps(message)
            adapter.client_text(rec.clock(), text)
            await ws.send(text)
        error = ""
        while True:
            try:
                data = await ws.recv()
            except ConnectionClosed as exc:
                refused = exc.rcvd is not None and exc.rcvd.code == 1013
                if error and not refused:  # vLLM-Omni: a fatal error, then no close frame
                    raise SessionFailed(f"error event: {error}") from None
                raise
            now = rec.clock()
            if isinstance(data, bytes):
                adapter.upstream_binary(now, data)
                continue
            adapter.upstream_text(now, data)
            event = _event(data)
            kind = event.get("type")
            if kind == "error":
                error = error or _error_text(event)
            elif kind == _ADMITTED:
                rec.opened(now)
            elif kind == "session.done":
                break
        text = json.dumps({"type": "session.close"})
        adapter.client_text(rec.clock(), text)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(text)
    if error:
        raise SessionFailed(f"error event: {error}")


def _speech_fields(opts: ClientOptions, req: SpeechRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in (
        ("model", opts.model or req.model),
        ("voice", opts.voice or req.voice),
        ("instructions", req.instructions),
        ("ref_audio", req.ref_audio),
        ("ref_text", req.ref_text),
    ):
        if value is not None:
            fields[key] = value
    fields.update(req.extra)
    return fields


async def _check_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    body = b""
    with contextlib.suppress(httpx.HTTPError):
        async for part in response.aiter_raw():
            body += part
            if len(body) > _MAX_ERROR_BODY:
                break
    if response.status_code in (503, 429):
        reason = response.headers.get("x-headroom-reason") or f"HTTP {response.status_code}"
        raise Refusal(reason, _retry_after(response.headers))
    message = _error_text(_event(body.decode("utf-8", "replace"))) if body else ""
    raise SessionFailed(f"HTTP {response.status_code} {message}".strip())


async def _body(
    response: httpx.Response, rec: SessionRecorder, feed: Callable[[float, bytes], None]
) -> None:
    async for part in response.aiter_raw():
        feed(rec.clock(), part)


def _sse_watch(parser: SseParser, done: list[str], errors: list[str]) -> Callable[[bytes], None]:
    def watch(chunk: bytes) -> None:
        for name, data in parser.feed(chunk):
            event = _event(data)
            kind = event.get("type") if name == "message" else name
            if data.strip() == "[DONE]" or kind == "speech.audio.done":
                done.append(kind or "[DONE]")
            elif kind == "speech.audio.error" or "error" in event:
                errors.append(_error_text(event))

    return watch


async def _speech_http(
    opts: ClientOptions, http: httpx.AsyncClient, req: SpeechRequest, rec: SessionRecorder
) -> None:
    sse = opts.stream_format == "sse"
    body = {
        "input": req.text,
        "response_format": "pcm",
        "stream": True,
        "stream_format": opts.stream_format,
    }
    body.update(_speech_fields(opts, req))
    content = json.dumps(body).encode()
    adapter = http_adapter(opts.protocol, rec.meter, AudioFormat(opts.sample_rate))
    rec.before_finish(adapter.response_complete)
    adapter.request("POST", {}, "application/json", content)
    done: list[str] = []
    errors: list[str] = []
    watch = _sse_watch(SseParser(), done, errors)

    def feed(now: float, chunk: bytes) -> None:
        adapter.response_chunk(now, chunk)
        if sse:
            watch(chunk)

    headers = {"content-type": "application/json", **dict(opts.headers)}
    try:
        async with http.stream("POST", opts.url, content=content, headers=headers) as response:
            rec.opened(rec.clock())
            await _check_status(response)
            adapter.response_start(response.status_code, response.headers)
            await _body(response, rec, feed)
    except httpx.HTTPError as exc:
        raise SessionFailed(f"{type(exc).__name__}: {exc}") from None
    if errors:
        raise SessionFailed(f"error event: {errors[0]}")
    if sse and not done:
        raise SessionFailed("the SSE stream ended without speech.audio.done")


async def _realtime(opts: ClientOptions, req: AudioRequest, rec: SessionRecorder) -> None:
    adapter = ws_adapter(opts.protocol, rec.meter, AudioFormat(ASR_SAMPLE_RATE))

    async with _ws(opts, rec) as ws:

        async def send(message: dict[str, Any]) -> None:
            text = json.dumps(message)
            adapter.client_text(rec.clock(), text)
            await ws.send(text)

        async def send_audio() -> None:
            piece = 2 * ASR_SAMPLE_RATE // 10 if opts.asr_pace > 0 else 2 * ASR_SAMPLE_RATE
            start = rec.clock()
            for i, offset in enumerate(range(0, len(req.pcm), piece)):
                if opts.asr_pace > 0:
                    delay = start + i * 0.1 / opts.asr_pace - rec.clock()
                    if delay > 0:
                        await asyncio.sleep(delay)
                pcm = req.pcm[offset : offset + piece]
                await send(
                    {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
                )
                rec.audio_sent_s += len(pcm) / (2 * ASR_SAMPLE_RATE)
                if i == 0:
                    await send({"type": "input_audio_buffer.commit"})  # starts generation
            await send({"type": "input_audio_buffer.commit", "final": True})

        update: dict[str, Any] = {"type": "session.update"}
        model = opts.model or req.model
        if model:
            update["model"] = model
        update.update(req.extra)
        await send(update)
        sender = asyncio.get_running_loop().create_task(send_audio())
        try:
            while True:
                data = await ws.recv()
                now = rec.clock()
                if isinstance(data, bytes):
                    continue
                adapter.upstream_text(now, data)
                event = _event(data)
                kind = event.get("type")
                if kind == "transcription.done":
                    break
                if kind == _ADMITTED:
                    rec.opened(now)
                if kind == "error":
                    await _after_error(ws, _error_text(event))
                if sender.done() and not sender.cancelled() and sender.exception():
                    raise SessionFailed(f"sending audio failed: {sender.exception()}")
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender


def _wav(pcm: bytes) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(ASR_SAMPLE_RATE)
        wav.writeframes(pcm)
    return out.getvalue()


async def _transcription(
    opts: ClientOptions, http: httpx.AsyncClient, req: AudioRequest, rec: SessionRecorder
) -> None:
    adapter = http_adapter(opts.protocol, rec.meter, AudioFormat(ASR_SAMPLE_RATE))
    rec.before_finish(adapter.response_complete)
    adapter.request("POST", {}, "multipart/form-data", b"")
    form = {"stream": "true", **{k: str(v) for k, v in req.extra.items()}}
    for key, value in (("model", opts.model or req.model), ("language", req.language)):
        if value:
            form[key] = value
    files = {"file": (f"{req.name}.wav", _wav(req.pcm), "audio/wav")}
    done: list[str] = []
    errors: list[str] = []
    watch = _sse_watch(SseParser(), done, errors)

    def feed(now: float, chunk: bytes) -> None:
        adapter.response_chunk(now, chunk)
        watch(chunk)

    try:
        async with http.stream(
            "POST", opts.url, data=form, files=files, headers=dict(opts.headers)
        ) as response:
            # The upload is sent before the response starts: that is the commit.
            adapter.request_complete(rec.clock())
            rec.opened(rec.clock())
            rec.audio_sent_s = req.seconds
            await _check_status(response)
            adapter.response_start(response.status_code, response.headers)
            await _body(response, rec, feed)
    except httpx.HTTPError as exc:
        raise SessionFailed(f"{type(exc).__name__}: {exc}") from None
    if errors:
        raise SessionFailed(f"error event: {errors[0]}")
    if not done:
        raise SessionFailed("the SSE stream ended without [DONE]")


async def run_session(
    opts: ClientOptions, http: httpx.AsyncClient, request: Request, rec: SessionRecorder
) -> None:
    """Run one session to its end; raises :class:`Refusal` or :class:`SessionFailed`."""
    if opts.protocol == "vllm-omni-speech-ws" and isinstance(request, SpeechRequest):
        await _speech_ws(opts, request, rec)
    elif opts.protocol == "openai-speech-http" and isinstance(request, SpeechRequest):
        await _speech_http(opts, http, request, rec)
    elif opts.protocol == "vllm-realtime" and isinstance(request, AudioRequest):
        await _realtime(opts, request, rec)
    elif opts.protocol == "openai-transcription-sse" and isinstance(request, AudioRequest):
        await _transcription(opts, http, request, rec)
    elif opts.protocol == "openai-completions-tokens" and isinstance(request, SpeechRequest):
        await run_completion(opts, http, request, rec)
    else:
        kind = "tts" if isinstance(request, SpeechRequest) else "asr"
        raise ValueError(f"a {kind} request cannot be sent over {opts.protocol}")
