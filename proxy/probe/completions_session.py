"""The probe's ``openai-completions-tokens`` session: a streaming completion whose tokens
are audio (Orpheus served by vLLM or llama.cpp's server).

``POST /v1/completions {prompt, max_tokens, stream: true, stream_options: {include_usage:
true}}``; the body is read to ``data: [DONE]`` and metered by Headroom's token-stream
adapter at the probe's ``tokens_per_audio_second``. The prompt is ``"{voice}: {text}"``
(Orpheus's form) or the text alone. ``max_tokens`` is the speech the text would make at
:data:`CHARACTERS_PER_SECOND` times the token rate (a request that ends earlier, at the
model's end of speech, is a shorter utterance); a workload's ``extra`` fields (for
instance ``max_tokens`` or llama.cpp's ``ignore_eos``) are merged into the body last.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import httpx

from proxy.metering.adapters import AudioFormat, http_adapter
from proxy.metering.adapters.sse import SseParser
from proxy.probe.probe_session import ClientOptions, Refusal, SessionFailed, SessionRecorder
from proxy.probe.workload import SpeechRequest

__all__ = ["CHARACTERS_PER_SECOND", "completion_body", "run_completion"]

#: Speech rate used to size ``max_tokens`` from a text: characters of text per second of
#: the speech it makes (a rate for the bundled workload's English texts).
CHARACTERS_PER_SECOND = 14.0
_MAX_ERROR_BODY = 4096
_STALE_RESENDS = 2


def completion_body(opts: ClientOptions, req: SpeechRequest) -> dict[str, Any]:
    """The request body for ``req``."""
    rate = opts.tokens_per_audio_second
    if rate is None:
        raise ValueError("openai-completions-tokens needs tokens_per_audio_second")
    voice = opts.voice or req.voice
    seconds = len(req.text) / CHARACTERS_PER_SECOND
    body: dict[str, Any] = {
        "prompt": f"{voice}: {req.text}" if voice else req.text,
        "max_tokens": max(1, math.ceil(seconds * rate)),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    model = opts.model or req.model
    if model:
        body["model"] = model
    body.update(req.extra)
    return body


def _error_text(data: bytes) -> str:
    try:
        event = json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")[:300]
    err = event.get("error", event.get("message")) if isinstance(event, dict) else event
    if isinstance(err, dict):
        err = err.get("message") or err.get("code")
    return str(err or event)[:300]


def _is_error(data: str) -> bool:
    try:
        event = json.loads(data)
    except ValueError:
        return False
    return isinstance(event, dict) and "error" in event


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
        try:
            retry: float | None = float(response.headers.get("retry-after", ""))
        except ValueError:
            retry = None
        raise Refusal(reason, retry)
    message = _error_text(body) if body else ""
    raise SessionFailed(f"HTTP {response.status_code} {message}".strip())


async def _send(http: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """Send ``request``, again (at most twice) when the server closes a kept-alive
    connection without answering it: llama.cpp's server closes some as the next request
    arrives, and the request was never answered."""
    for _ in range(_STALE_RESENDS):
        try:
            return await http.send(request, stream=True)
        except httpx.RemoteProtocolError as exc:
            if "without sending a response" not in str(exc):
                raise
    return await http.send(request, stream=True)


async def run_completion(
    opts: ClientOptions, http: httpx.AsyncClient, req: SpeechRequest, rec: SessionRecorder
) -> None:
    """One streamed completion, metered as audio; raises :class:`Refusal` or
    :class:`SessionFailed`."""
    content = json.dumps(completion_body(opts, req)).encode()
    fmt = AudioFormat(opts.sample_rate, tokens_per_second=opts.tokens_per_audio_second)
    adapter = http_adapter(opts.protocol, rec.meter, fmt)
    rec.before_finish(adapter.response_complete)
    adapter.request("POST", {}, "application/json", content)
    parser = SseParser(256 * 1024)
    done = False
    errors: list[str] = []
    headers = {"content-type": "application/json", **dict(opts.headers)}
    request = http.build_request("POST", opts.url, content=content, headers=headers)
    try:
        response = await _send(http, request)
    except httpx.HTTPError as exc:
        raise SessionFailed(f"{type(exc).__name__}: {exc}") from None
    rec.opened(rec.clock())
    try:
        async with contextlib.aclosing(response):
            await _check_status(response)
            adapter.response_start(response.status_code, response.headers)
            async for part in response.aiter_raw():
                adapter.response_chunk(rec.clock(), part)
                for _name, data in parser.feed(part):
                    if data.strip() == "[DONE]":
                        done = True
                    elif '"error"' in data and _is_error(data):
                        errors.append(_error_text(data.encode()))
    except httpx.HTTPError as exc:
        raise SessionFailed(f"{type(exc).__name__}: {exc}") from None
    if errors:
        raise SessionFailed(f"error event: {errors[0]}")
    if not done:
        raise SessionFailed("the completion stream ended without [DONE]")
