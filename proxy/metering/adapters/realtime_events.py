"""Realtime-style JSON event protocols: ``vllm-realtime`` and ``openai-realtime``.

Both speak JSON text frames with a ``type``; audio travels as base64 PCM inside events.

Upstream (server) events metered:

==============================================================  ======================
``response.output_audio.delta`` / ``response.audio.delta``      audio (``delta`` or
                                                                ``audio`` field)
``response.output_audio.done``, beta ``response.audio.done``      utterance end
(a content part)
``response.done``; for vLLM-Omni also ``response.audio.done``    response end
(there it closes the response's audio)
``transcription.delta``, ``*_transcript.delta``,                event (gaps only)
``conversation.item.input_audio_transcription.delta``,
``response.output_text.delta`` / ``response.text.delta``
``transcription.done``,                                         transcript final
``conversation.item.input_audio_transcription.completed``
``input_audio_buffer.committed`` (openai-realtime only)          commit final
==============================================================  ======================

Client events: ``input_audio_buffer.commit`` is the commit-final for ``openai-realtime``
(each turn) and, with ``"final": true``, for ``vllm-realtime`` (a non-final commit only
starts generation there). ``session.update`` sets the output format for
``openai-realtime``.

Output format: an event's ``sample_rate_hz`` (vLLM-Omni) wins; else the session's format
(OpenAI GA ``session.audio.output.format {type, rate}``, beta ``output_audio_format``
``pcm16``/``g711_ulaw``/``g711_alaw``) from ``session.created``/``session.updated`` or
the client's ``session.update``; else the route's default. Binary frames are not part of
these protocols and are ignored. Every other event passes unmetered.
"""

from __future__ import annotations

from typing import Any

from proxy.metering.adapters.b64json import scan_event
from proxy.metering.adapters.base import AudioFormat, MeterSink

__all__ = ["RealtimeAdapter"]

_AUDIO = frozenset({"response.output_audio.delta", "response.audio.delta"})
_PART_DONE = frozenset({"response.output_audio.done", "response.audio.done"})
_RESPONSE_DONE = frozenset({"response.done"})
_TEXT = frozenset(
    {
        "transcription.delta",
        "conversation.item.input_audio_transcription.delta",
        "response.output_audio_transcript.delta",
        "response.audio_transcript.delta",
        "response.output_text.delta",
        "response.text.delta",
    }
)
_FINAL = frozenset({"transcription.done", "conversation.item.input_audio_transcription.completed"})
_SESSION = frozenset({"session.created", "session.updated", "session.update"})
_UPSTREAM_KEYS = ("delta", "audio")
_CLIENT_KEYS = ("audio",)
#: G.711 is 8 kHz, one byte per sample.
_G711 = AudioFormat(8000, 1, 1)
_BETA_FORMATS = {"g711_ulaw": _G711, "g711_alaw": _G711}
_GA_G711 = frozenset({"audio/pcmu", "audio/pcma"})


class RealtimeAdapter:
    """WebSocket adapter for ``vllm-realtime`` (``openai=False``) and ``openai-realtime``."""

    __slots__ = ("_bps", "_default", "_openai", "_sink", "errors", "reads_binary")

    def __init__(self, sink: MeterSink, default_format: AudioFormat, *, openai: bool) -> None:
        self._sink = sink
        self._default = default_format
        self._bps = float(default_format.bytes_per_second)
        self._openai = openai
        self.errors = 0
        self.reads_binary = False

    def upstream_text(self, now: float, text: str) -> None:
        try:
            scanned = scan_event(text, _UPSTREAM_KEYS)
            if scanned is None:
                return
            event, span = scanned
            kind = event.get("type")
            if kind in _AUDIO:
                if span is not None:
                    rate = event.get("sample_rate_hz")
                    if type(rate) is int and 8000 <= rate <= 384000:
                        bps = float(rate * self._default.channels * 2)  # PCM16 by protocol
                    else:
                        bps = self._bps
                    nbytes = span.nbytes
                    if nbytes:
                        self._sink.audio(now, nbytes / bps)
            elif kind in _TEXT:
                self._sink.event(now)
            elif kind in _RESPONSE_DONE or (kind in _PART_DONE and not self._openai):
                self._sink.response_end(now)
            elif kind in _PART_DONE:
                self._sink.utterance_end(now)
            elif kind in _FINAL:
                self._sink.transcript_final(now)
            elif kind in _SESSION:
                self._session(event)
            elif kind == "input_audio_buffer.committed" and self._openai:
                self._sink.commit_final(now)
        except Exception:
            self.errors += 1

    def client_text(self, now: float, text: str) -> None:
        try:
            scanned = scan_event(text, _CLIENT_KEYS)
            if scanned is None:
                return
            event = scanned[0]
            kind = event.get("type")
            if kind == "input_audio_buffer.commit" and (self._openai or event.get("final")):
                self._sink.commit_final(now)
            # A client's session.update is only a request: the format is taken from the
            # upstream's session.created / session.updated, so no client can skew the
            # meter (and through it the guard that protects everyone on the replica).
        except Exception:
            self.errors += 1

    def client_binary(self, now: float, data: bytes) -> None:
        """Not part of these protocols; the relay decides what to do with it."""

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        """Not part of these protocols: unmetered."""

    def _session(self, event: dict[str, Any]) -> None:
        if not self._openai:
            return
        session = event.get("session")
        if not isinstance(session, dict):
            return
        fmt = _session_format(session, self._default)
        if fmt is not None:
            self._bps = float(fmt.bytes_per_second)

    def __repr__(self) -> str:
        name = "openai-realtime" if self._openai else "vllm-realtime"
        return f"<RealtimeAdapter {name} bps={self._bps:.0f} errors={self.errors}>"


def _session_format(session: dict[str, Any], default: AudioFormat) -> AudioFormat | None:
    """The output format a session object declares, or None if it declares none."""
    audio = session.get("audio")
    if isinstance(audio, dict):
        output = audio.get("output")
        if isinstance(output, dict):
            fmt = output.get("format")
            if isinstance(fmt, dict):
                kind = fmt.get("type")
                if kind in _GA_G711:
                    return _G711
                rate = fmt.get("rate")
                if kind == "audio/pcm" or type(rate) is int:
                    if type(rate) is int and 8000 <= rate <= 384000:
                        return AudioFormat(rate, default.channels, 2)
                    return AudioFormat(default.sample_rate, default.channels, 2)
    beta = session.get("output_audio_format")
    if isinstance(beta, str):
        if beta in _BETA_FORMATS:
            return _BETA_FORMATS[beta]
        if beta == "pcm16":
            return AudioFormat(24000, 1, 2)
    return None
