"""Token-stream speech: ``openai-completions-tokens``.

A speech model that emits audio-codec tokens as text tokens (Orpheus and its kin) is
served through an OpenAI-compatible streaming completions endpoint (vLLM's, llama.cpp's
``llama-server``, LM Studio's); a codec decoder beside it turns a fixed number of tokens
into one second of audio. So each generated token is a fixed duration of audio: the
route's ``tokens_per_audio_second`` (carried here as
:attr:`~proxy.metering.adapters.base.AudioFormat.tokens_per_second`), and the stream is metered
like any audio stream: gaps, delivery ratio, playback, time to first audio.

The response is ``text/event-stream``: ``data: {"choices": [{"text": ...}]}``
(``/v1/completions``) or ``{"choices": [{"delta": {"content": ...}}]}``
(``/v1/chat/completions``), ended by ``data: [DONE]`` (the response end). Tokens are
counted from the engine's own fields, never from the text's length:

- ``usage.completion_tokens`` is the running total when an event carries it (vLLM with
  ``stream_options.continuous_usage_stats``; the last event of llama.cpp's server; the
  usage-only event of vLLM's ``include_usage``), else ``timings.predicted_n`` or
  ``tokens_predicted`` (llama.cpp); the event counts the tokens beyond those already
  counted;
- without a total, a ``tokens`` list (llama.cpp's native ``/completion``) counts its
  length, and a choice with non-empty text counts one token: llama.cpp's server and vLLM
  send one event per generated token by default.

A running total below what was counted adds nothing. Events completed by one body chunk
arrived together and are reported as one ``audio()`` call. A status >= 400, or a body
that is not an event stream, is unmetered.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from proxy.metering.adapters.base import AudioFormat, MeterSink, header
from proxy.metering.adapters.http_streams import media_type
from proxy.metering.adapters.sse import SseParser

__all__ = ["TokenStreamAdapter", "event_tokens"]

#: A token event is a few hundred bytes; a larger one is dropped whole (counts nothing).
_MAX_EVENT_BYTES = 256 * 1024


def _count(value: object) -> int | None:
    """A non-negative integer count, or None (bools and floats are not counts)."""
    return value if type(value) is int and value >= 0 else None


def _running_total(event: Mapping[str, Any]) -> int | None:
    usage = event.get("usage")
    if isinstance(usage, dict):
        total = _count(usage.get("completion_tokens"))
        if total is not None:
            return total
    timings = event.get("timings")
    if isinstance(timings, dict):
        total = _count(timings.get("predicted_n"))
        if total is not None:
            return total
    return _count(event.get("tokens_predicted"))


def _choice_text(choice: object) -> str:
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        if isinstance(content, str):
            return content
    return ""


def event_tokens(event: Mapping[str, Any]) -> tuple[int | None, int]:
    """``(running total, tokens in this event)`` as the event states them: the total is
    None when the event carries none; the count is what its ``tokens`` list or its
    non-empty choices say."""
    total = _running_total(event)
    tokens = event.get("tokens")
    if isinstance(tokens, list):
        return total, len(tokens)
    if "content" in event and isinstance(event.get("content"), str):  # llama.cpp native
        return total, 1 if event["content"] else 0
    choices = event.get("choices")
    if not isinstance(choices, list):
        return total, 0
    return total, sum(1 for choice in choices if _choice_text(choice))


class TokenStreamAdapter:
    """HTTP adapter for ``openai-completions-tokens``."""

    __slots__ = ("_counted", "_on", "_seconds_per_token", "_sink", "_sse", "errors")

    def __init__(self, sink: MeterSink, default_format: AudioFormat) -> None:
        self._sink = sink
        rate = default_format.tokens_per_second
        # A route without a token rate is refused by the settings; here it meters gaps.
        self._seconds_per_token = 1.0 / rate if rate else 0.0
        self._sse = SseParser(_MAX_EVENT_BYTES)
        self._on = False
        self._counted = 0
        self.errors = 0

    @property
    def tokens(self) -> int:
        """Tokens counted so far."""
        return self._counted

    def request(
        self, method: str, query: Mapping[str, str], content_type: str | None, body: bytes
    ) -> None:
        """Nothing in the request changes how tokens are counted."""

    def request_complete(self, now: float) -> None:
        """Not a metered moment for a generated stream."""

    def response_start(self, status: int, headers: Mapping[str, str]) -> None:
        try:
            mime, _ = media_type(header(headers, "content-type"))
            self._on = status < 400 and mime == "text/event-stream"
        except Exception:
            self.errors += 1

    def response_chunk(self, now: float, chunk: bytes) -> None:
        if not self._on:
            return
        try:
            tokens = 0
            for _name, data in self._sse.feed(chunk):
                if data.strip() == "[DONE]":
                    self._report(now, tokens)
                    tokens = 0
                    self._sink.response_end(now)
                    continue
                tokens += self._event(data)
            self._report(now, tokens)
        except Exception:
            self.errors += 1

    def _event(self, data: str) -> int:
        """Tokens one event adds to the count."""
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):
            return 0
        if not isinstance(event, dict):
            return 0
        total, stated = event_tokens(event)
        if total is None:
            self._counted += stated
            return stated
        added = max(total - self._counted, 0)
        self._counted += added
        return added

    def _report(self, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        seconds = tokens * self._seconds_per_token
        if seconds > 0.0 and math.isfinite(seconds):
            self._sink.audio(now, seconds)
        else:
            self._sink.event(now)

    def response_complete(self, now: float) -> None:
        return None

    def __repr__(self) -> str:
        return f"<TokenStreamAdapter tokens={self._counted} errors={self.errors}>"
