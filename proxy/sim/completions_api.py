"""OpenAI-compatible completions on a simulated TTS GPU: the preset's codec tokens as text.

How Orpheus is served by vLLM or llama.cpp's server: the model's audio-codec tokens are
text tokens (``<custom_token_N>``) and the server streams each one as it is generated;
a codec decoder beside the server makes the audio. So here every generated token is one
event, emitted at the end of the engine step that made it (a chunk schedule of one
token), and the stream says nothing about audio: the client counts tokens.

- ``POST /v1/completions {prompt, max_tokens?, stream?, stream_options?, ignore_eos?}``:
  ``data: {"object": "text_completion", "choices": [{"text": "<custom_token_N>", ...}]}``
  per token, a last event with ``finish_reason`` (and, as llama.cpp's server sends it, the
  ``usage``), a usage-only event when ``stream_options.include_usage`` (vLLM), then
  ``data: [DONE]``. Without ``stream`` the whole completion is one JSON response.
- ``POST /v1/chat/completions {messages, ...}``: the same tokens as
  ``chat.completion.chunk`` deltas; the prompt is the last message's text content.

The utterance's length is the speech the prompt's text makes on the preset
(:func:`proxy.sim.tts.plan_speech`; the model's end of speech), capped by ``max_tokens``;
``ignore_eos`` makes it exactly ``max_tokens``. Faults apply as to speech: slow start,
then drop or error before a token.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from proxy.sim.chunks import ChunkSchedule
from proxy.sim.common import error_body, error_response, unavailable_response
from proxy.sim.engine_runner import EngineStopped
from proxy.sim.tts import plan_speech

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["CompletionRequest", "create_completion", "parse_completion_request", "token_text"]

MAX_BODY_BYTES = 1024 * 1024
#: Orpheus's audio tokens start here in its vocabulary's custom tokens.
_TOKEN_BASE = 10
_CODEBOOK = 4096
_PER_TOKEN = ChunkSchedule(steady=1)


class CompletionRequest:
    """A parsed completions request."""

    __slots__ = ("chat", "ignore_eos", "include_usage", "max_tokens", "stream", "text")

    def __init__(
        self,
        text: str,
        *,
        chat: bool,
        stream: bool,
        max_tokens: int | None,
        ignore_eos: bool,
        include_usage: bool,
    ) -> None:
        self.text = text
        self.chat = chat
        self.stream = stream
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.include_usage = include_usage


def _chat_text(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    last = messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, list):  # content parts: the text ones
        content = " ".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    if not isinstance(content, str) or not content.strip():
        raise ValueError("the last message must have text content")
    return content


def parse_completion_request(body: Any, served_model: str, *, chat: bool) -> CompletionRequest:
    """Validate a body; ``ValueError`` (400) or ``LookupError`` (404)."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    prompt = _chat_text(body.get("messages")) if chat else body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("'prompt' must be a non-empty string")
    model = body.get("model")
    if model is not None and model != served_model:
        raise LookupError(f"The model `{model}` does not exist.")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError("'max_tokens' must be an integer >= 1")
    stream, ignore_eos = body.get("stream", False), body.get("ignore_eos", False)
    if not isinstance(stream, bool) or not isinstance(ignore_eos, bool):
        raise ValueError("'stream' and 'ignore_eos' must be booleans")
    if ignore_eos and max_tokens is None:
        raise ValueError("'ignore_eos' needs 'max_tokens'")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValueError("'stream_options' must be an object")
    return CompletionRequest(
        prompt,
        chat=chat,
        stream=stream,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        include_usage=options.get("include_usage") is True,
    )


def token_text(index: int) -> str:
    """Orpheus's text for the ``index``-th audio token of a stream (7 codebook slots per
    frame, each with its own offset into the custom tokens)."""
    slot = index % 7
    return f"<custom_token_{_TOKEN_BASE + slot * _CODEBOOK + (index * 37) % _CODEBOOK}>"


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class _Framing:
    """The JSON shapes of one response (completions or chat)."""

    def __init__(self, req: CompletionRequest, model: str, prompt_tokens: int) -> None:
        self.req = req
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-sim{time.monotonic_ns():x}"
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if req.chat else "text_completion"

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}  # fmt: skip

    def usage(self, tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                "total_tokens": self.prompt_tokens + tokens}  # fmt: skip

    def token(self, text: str) -> bytes:
        if self.req.chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return _sse(self._event([choice]))

    def end(self, tokens: int, reason: str) -> bytes:
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}
        out = _sse(self._event([choice], usage=self.usage(tokens)))
        if self.req.include_usage:
            out += _sse(self._event([], usage=self.usage(tokens)))
        return out + _sse("[DONE]")

    def whole(self, text: str, tokens: int, reason: str) -> dict[str, Any]:
        if self.req.chat:
            message = {"role": "assistant", "content": text}
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "message": message}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        event = self._event([choice], usage=self.usage(tokens))
        event["object"] = "chat.completion" if self.req.chat else "text_completion"
        return event


async def create_completion(gpu: SimGpu, request: Request, *, chat: bool) -> Response:
    """The endpoint (``chat``: ``/v1/chat/completions``)."""
    if gpu.faults.handshake_503:
        return unavailable_response()
    if gpu.preset.kind != "tts":
        return error_response(
            f"This simulated GPU serves the speech-recognition model {gpu.preset.model}; "
            "completions need a TTS preset.",
            404,
        )
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return error_response("request body too large", 413)
    try:
        req = parse_completion_request(json.loads(raw), gpu.preset.model, chat=chat)
        plan = plan_speech(gpu, req.text, max_new_tokens=req.max_tokens)
    except json.JSONDecodeError:
        return error_response("Invalid JSON body", 400)
    except LookupError as exc:
        return error_response(str(exc), 404, "model")
    except ValueError as exc:
        return error_response(str(exc), 400)
    output = req.max_tokens if req.ignore_eos and req.max_tokens else plan.output_tokens
    capped = req.max_tokens is not None and output >= req.max_tokens
    reason = "length" if capped else "stop"
    framing = _Framing(req, gpu.preset.model, plan.prompt_tokens)
    faults = gpu.stream_faults()
    try:
        stream = gpu.runner.open(
            prompt_tokens=plan.prompt_tokens, output_tokens=output, schedule=_PER_TOKEN
        )
    except (ValueError, EngineStopped) as exc:
        return error_response(str(exc), 400 if isinstance(exc, ValueError) else 503)

    async def tokens() -> AsyncIterator[str]:
        try:
            await faults.slow_start()
            while True:
                em = await stream.next()
                for index in range(em.start, em.end):
                    action = await faults.before_chunk()
                    if action != "send":
                        raise _Fault(action)
                    yield token_text(index)
                if em.final:
                    return
        finally:
            stream.cancel()

    if not req.stream:
        try:
            texts = [text async for text in tokens()]
        except _Fault as fault:
            return error_response(f"simulated engine fault ({fault.action})", 500)
        except EngineStopped as exc:
            return error_response(str(exc), 503)
        return JSONResponse(framing.whole("".join(texts), len(texts), reason))

    async def body() -> AsyncIterator[bytes]:
        made = 0
        try:
            async for text in tokens():
                made += 1
                yield framing.token(text)
        except _Fault as fault:
            if fault.action == "drop":
                await gpu.drop(request.scope)
                return
            yield _sse(error_body("simulated engine fault (headroom sim --fault-error-after)",
                                  500))  # fmt: skip
            return
        except EngineStopped as exc:
            yield _sse(error_body(str(exc), 500))
            return
        yield framing.end(made, reason)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


class _Fault(Exception):
    def __init__(self, action: str) -> None:
        super().__init__(action)
        self.action = action
