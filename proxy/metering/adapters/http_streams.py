"""Streaming HTTP protocols: ``openai-speech-http`` and ``openai-transcription-sse``.

``openai-speech-http`` (POST ``/v1/audio/speech``, vLLM-Omni / OpenAI): the response's
content type decides how audio is found:

- ``text/event-stream``: SSE events ``speech.audio.delta {audio: b64}`` (the name from the
  ``event:`` line, else the data's ``type``; a typeless event with an ``audio`` string
  counts too) and ``speech.audio.done`` (response end). The base64 is measured, not
  decoded, at the request's ``sample_rate`` or the route default, 16-bit; if the format is
  wav, a delta whose payload starts with a RIFF header has just its head decoded to skip
  the header and learn the format.
- ``audio/wav`` (``audio/x-wav``, ``audio/wave``): RIFF header (split anywhere), then PCM.
- ``audio/pcm``, ``audio/L16``, ``audio/raw``: 16-bit PCM at the content type's
  ``rate``/``channels`` parameters, else the response's ``X-Sample-Rate`` header, else the
  request's ``sample_rate``, else the route default (the header and the request field
  also set the rate of SSE base64 audio).
- ``application/octet-stream`` or no content type: what the request asked for
  (``stream_format=sse``, ``response_format`` wav or pcm).
- other ``audio/*`` (mp3, opus, flac, aac): compressed; each chunk is a gap-only event.
- anything else, and any status >= 400: unmetered.

Metering is per body chunk, as relayed: SSE events completed by the same chunk arrived
together and are reported as one ``audio()`` (or one ``event()``) call.

``openai-transcription-sse`` (POST ``/v1/audio/transcriptions`` with ``stream=true``):
``data: {"object": "transcription.chunk", ...}`` and ``transcript.text.delta`` events are
gap-only events; ``data: [DONE]`` and ``transcript.text.done`` are the final transcript.
The commit is the end of the upload: the relay calls :meth:`request_complete` when the
request body's last byte has been sent upstream. A non-streaming (JSON) 2xx response
counts its first body chunk as the final transcript.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from urllib.parse import parse_qsl

from proxy.metering.adapters.b64json import scan_event
from proxy.metering.adapters.base import AudioFormat, MeterSink, header
from proxy.metering.adapters.sse import SseParser
from proxy.metering.adapters.wav import WavStream

__all__ = ["SpeechHttpAdapter", "TranscriptionSseAdapter", "media_type", "request_fields"]

_OFF, _SSE, _WAV, _PCM, _OPAQUE, _JSON = range(6)
_WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
_PCM_TYPES = frozenset({"audio/pcm", "audio/l16", "audio/raw", "audio/x-raw"})
_SPEECH_KEYS = ("audio", "delta")
_TEXT_KEYS: tuple[str, ...] = ()
_RIFF_B64 = "UklGR"  # base64 of b"RIFF" + 6 bits
_WAV_HEAD = 4096  # bytes decoded to read a RIFF header inside a base64 delta
_RESPONSE_END = -1.0
_OTHER_EVENT, _TEXT_EVENT, _FINAL_EVENT = range(3)


def media_type(value: str | None) -> tuple[str, dict[str, str]]:
    """``("audio/l16", {"rate": "24000"})`` from ``"audio/L16; rate=24000"``."""
    if not value:
        return "", {}
    mime, _, rest = value.partition(";")
    params: dict[str, str] = {}
    for part in rest.split(";"):
        key, eq, val = part.partition("=")
        if eq:
            params[key.strip().lower()] = val.strip().strip('"')
    return mime.strip().lower(), params


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        number = int(str(value))
    except ValueError:
        return None
    return number if number > 0 else None


def request_fields(
    query: Mapping[str, str], content_type: str | None, body: bytes
) -> dict[str, str]:
    """The request's parameters (query, then JSON or urlencoded body), values as text."""
    fields = {str(k).lower(): str(v) for k, v in query.items()}
    mime, _ = media_type(content_type)
    if not body:
        return fields
    if mime == "application/json" or mime.endswith("+json") or (not mime and body[:1] == b"{"):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return fields
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(value, bool):
                    fields[key.lower()] = "true" if value else "false"
                elif isinstance(value, str | int | float):
                    fields[key.lower()] = str(value)
    elif mime == "application/x-www-form-urlencoded":
        for key, value in parse_qsl(body.decode("latin-1"), keep_blank_values=True):
            fields[key.lower()] = value
    return fields


#: Reads of a raw audio stream closer together than this belong to one chunk.
_SAME_CHUNK_S = 0.002


class SpeechHttpAdapter:
    """HTTP adapter for ``openai-speech-http``."""

    __slots__ = (
        "_bps",
        "_default",
        "_fields",
        "_fmt",
        "_last_read",
        "_mode",
        "_pending_at",
        "_pending_s",
        "_sink",
        "_sse",
        "_wav",
        "errors",
    )

    def __init__(self, sink: MeterSink, default_format: AudioFormat) -> None:
        self._sink = sink
        self._default = default_format
        self._fmt = default_format
        self._fields: dict[str, str] = {}
        self._mode = _OFF
        self._bps = float(default_format.bytes_per_second)
        self._sse = SseParser()
        self._wav = WavStream(default_format)
        self._last_read = -math.inf
        self._pending_at = 0.0
        self._pending_s = 0.0
        self.errors = 0

    def request(
        self, method: str, query: Mapping[str, str], content_type: str | None, body: bytes
    ) -> None:
        try:
            self._fields = request_fields(query, content_type, body)
            rate = _positive_int(self._fields.get("sample_rate"))
            if rate is not None:
                self._fmt = AudioFormat.plausible(rate, self._default.channels, 2, self._default)
        except Exception:
            self.errors += 1

    def request_complete(self, now: float) -> None:
        """Not a metered moment for speech synthesis."""

    def response_start(self, status: int, headers: Mapping[str, str]) -> None:
        try:
            self._mode = _OFF
            if status >= 400:
                return
            mime, params = media_type(header(headers, "content-type"))
            fmt = self._fmt
            rate = _positive_int(header(headers, "x-sample-rate"))
            if rate is not None:
                fmt = AudioFormat.plausible(rate, fmt.channels, 2, fmt)
            requested = self._fields.get("response_format", "").lower()
            if mime in ("", "application/octet-stream"):
                if self._fields.get("stream_format", "").lower() == "sse":
                    mime = "text/event-stream"
                elif requested in ("wav", "pcm"):
                    mime = "audio/" + requested
            if mime == "text/event-stream":
                self._mode = _SSE
                self._sse = SseParser()
                self._bps = float(fmt.bytes_per_second)
            elif mime in _WAV_TYPES:
                self._mode = _WAV
                self._wav = WavStream(fmt)
            elif mime in _PCM_TYPES:
                rate = _positive_int(params.get("rate")) or fmt.sample_rate
                channels = _positive_int(params.get("channels")) or fmt.channels
                self._mode = _PCM
                self._bps = float(AudioFormat.plausible(rate, channels, 2, fmt).bytes_per_second)
            elif mime.startswith("audio/"):
                self._mode = _OPAQUE
        except Exception:
            self.errors += 1

    def response_chunk(self, now: float, chunk: bytes) -> None:
        try:
            mode = self._mode
            if mode == _PCM:
                if chunk:
                    self._raw_audio(now, len(chunk) / self._bps)
            elif mode == _SSE:
                self._sse_chunk(now, chunk)
            elif mode == _WAV:
                seconds = self._wav.feed(chunk)
                if seconds > 0:
                    self._raw_audio(now, seconds)
            elif mode == _OPAQUE:
                self._sink.event(now)
        except Exception:
            self.errors += 1

    def _raw_audio(self, now: float, seconds: float) -> None:
        # A raw byte stream has no message boundaries: TCP may split one upstream write
        # into several reads. Reads within _SAME_CHUNK_S of the previous one are the rest
        # of the same chunk (one arrival, one delivery ratio over all of its audio), so a
        # chunk is reported when the next one starts, at its first read's time.
        if self._pending_s > 0.0 and now - self._last_read < _SAME_CHUNK_S:
            self._pending_s += seconds
        else:
            self._flush()
            self._pending_at = now
            self._pending_s = seconds
        self._last_read = now

    def _flush(self) -> None:
        if self._pending_s > 0.0:
            seconds, self._pending_s = self._pending_s, 0.0
            self._sink.audio(self._pending_at, seconds)

    def response_complete(self, now: float) -> None:
        try:
            self._flush()
        except Exception:
            self.errors += 1

    def _sse_chunk(self, now: float, chunk: bytes) -> None:
        # Events completed by one body chunk arrived together: one audio() call for them.
        seconds = 0.0
        for name, data in self._sse.feed(chunk):
            found = self._sse_audio(name, data)
            if found < 0.0:  # _RESPONSE_END
                if seconds > 0:
                    self._sink.audio(now, seconds)
                    seconds = 0.0
                self._sink.response_end(now)
            else:
                seconds += found
        if seconds > 0:
            self._sink.audio(now, seconds)

    def _sse_audio(self, name: str, data: str) -> float:
        """Seconds of audio in one SSE event, or ``_RESPONSE_END``."""
        scanned = scan_event(data, _SPEECH_KEYS)
        if scanned is None:
            return 0.0
        event, span = scanned
        kind = event.get("type") if name == "message" else name
        if kind == "speech.audio.delta" or (kind is None and span is not None):
            if span is None:
                return 0.0
            if span.startswith(_RIFF_B64):
                return self._riff_delta(span.head(_WAV_HEAD), span.nbytes)
            return span.nbytes / self._bps
        if kind == "speech.audio.done":
            return _RESPONSE_END
        return 0.0

    def _riff_delta(self, head: bytes, nbytes: int) -> float:
        """Seconds in a delta that starts with a WAV header; later deltas use its format."""
        wav = WavStream(self._fmt, max_header=len(head))
        seconds = wav.feed(head)
        if not wav.in_data:
            return 0.0
        self._bps = float(wav.bytes_per_second)
        return seconds + max(nbytes - len(head), 0) / self._bps

    def __repr__(self) -> str:
        mode = ("off", "sse", "wav", "pcm", "opaque", "json")[self._mode]
        return f"<SpeechHttpAdapter {mode} errors={self.errors}>"


class TranscriptionSseAdapter:
    """HTTP adapter for ``openai-transcription-sse``."""

    __slots__ = ("_final", "_mode", "_sink", "_sse", "errors")

    def __init__(self, sink: MeterSink, default_format: AudioFormat) -> None:
        self._sink = sink
        self._mode = _OFF
        self._sse = SseParser()
        self._final = False
        self.errors = 0

    def request(
        self, method: str, query: Mapping[str, str], content_type: str | None, body: bytes
    ) -> None:
        """Nothing in the upload matters to metering."""

    def request_complete(self, now: float) -> None:
        """The upload is complete: that is the commit finalize latency counts from."""
        try:
            self._sink.commit_final(now)
        except Exception:
            self.errors += 1

    def response_start(self, status: int, headers: Mapping[str, str]) -> None:
        try:
            self._mode = _OFF
            if status >= 400:
                return
            mime, _ = media_type(header(headers, "content-type"))
            if mime == "text/event-stream":
                self._mode = _SSE
            elif mime == "application/json" or mime.startswith("text/"):
                self._mode = _JSON
        except Exception:
            self.errors += 1

    def response_chunk(self, now: float, chunk: bytes) -> None:
        try:
            if self._mode == _SSE:
                # Events completed by one body chunk arrived together: one event() for them.
                text = False
                for _name, data in self._sse.feed(chunk):
                    kind = self._classify(data)
                    if kind == _TEXT_EVENT:
                        text = True
                    elif kind == _FINAL_EVENT:
                        if text:
                            self._sink.event(now)
                            text = False
                        self._sink.transcript_final(now)
                if text:
                    self._sink.event(now)
            elif self._mode == _JSON and chunk and not self._final:
                self._final = True
                self._sink.transcript_final(now)
        except Exception:
            self.errors += 1

    def response_complete(self, now: float) -> None:
        return None

    @staticmethod
    def _classify(data: str) -> int:
        if data.strip() == "[DONE]":
            return _FINAL_EVENT
        scanned = scan_event(data, _TEXT_KEYS)
        if scanned is None:
            return _OTHER_EVENT
        event = scanned[0]
        kind = event.get("type") or event.get("object")
        if kind in ("transcription.chunk", "transcript.text.delta"):
            return _TEXT_EVENT
        if kind == "transcript.text.done":
            return _FINAL_EVENT
        return _OTHER_EVENT

    def __repr__(self) -> str:
        return f"<TranscriptionSseAdapter errors={self.errors}>"
