"""``vllm-omni-speech-ws``: WS ``/v1/audio/speech/stream``, JSON control + binary audio.

Server text events: ``audio.start {format, sample_rate?, channels?}`` opens a sentence
and sets the format of the binary frames that follow; ``audio.done`` ends the sentence;
``session.done`` ends the response to a flush (``input.done``). Binary frames are the
audio:

- ``format: "pcm"`` (and before any ``audio.start``): 16-bit PCM counted by length at the
  announced rate/channels, else the route's default format;
- ``format: "wav"``: a RIFF header at the start of each utterance (possibly split across
  frames) is skipped, then PCM counted by length at the header's format;
- any other format (mp3, opus, flac, ...): compressed, so only frame gaps are metered.

Sentence boundaries: after the client's ``input.done`` the upstream has all the text, so
the next sentence is part of the same response: ``audio.done`` is an utterance end (the
listener keeps playing; a dry buffer before the next sentence is a stall) and
``session.done`` the response end. Before ``input.done`` the client may still be typing
(text streamed from an LLM), so ``audio.done`` is a response end: waiting for the client
is not the upstream's stall. Client frames are otherwise unmetered; other events pass.
"""

from __future__ import annotations

from typing import Final

from proxy.metering.adapters.b64json import scan_event
from proxy.metering.adapters.base import AudioFormat, MeterSink
from proxy.metering.adapters.wav import WavStream
from proxy.metering.session_meter import SessionMeter

__all__ = ["OmniSpeechWsAdapter"]

_PCM: Final = 0
_WAV: Final = 1
_OPAQUE: Final = 2
_NO_KEYS: Final[tuple[str, ...]] = ()


class OmniSpeechWsAdapter:
    """WebSocket adapter for ``vllm-omni-speech-ws``."""

    __slots__ = (
        "_bps", "_default", "_flushing", "_mode", "_sink", "_wav", "errors", "reads_binary",
    )  # fmt: skip

    def __init__(self, sink: MeterSink, default_format: AudioFormat) -> None:
        # The concrete class first: compiled, a call to it is native after a type check
        # (docs/performance.md).
        self._sink: SessionMeter | MeterSink = sink
        self._default = default_format
        self._mode = _PCM
        self._bps = float(default_format.bytes_per_second)
        self._wav = WavStream(default_format)
        self._flushing = False  # input.done sent, session.done not yet received
        self.errors = 0
        self.reads_binary = False  # PCM is metered by length; WAV headers are read

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        try:
            if self._mode == _PCM:
                if size < 0:
                    size = len(data)
                if size:
                    self._sink.audio(now, size / self._bps)
            elif self._mode == _WAV:
                seconds = self._wav.feed(data)
                if seconds > 0:
                    self._sink.audio(now, seconds)
            else:
                self._sink.event(now)
        except Exception:
            self.errors += 1

    def upstream_text(self, now: float, text: str) -> None:
        try:
            scanned = scan_event(text, _NO_KEYS)
            if scanned is None:
                return
            event = scanned[0]
            kind = event.get("type")
            if kind == "audio.start":
                self._start(event)
            elif kind == "audio.done":
                if self._flushing:
                    self._sink.utterance_end(now)
                else:
                    self._sink.response_end(now)
            elif kind == "session.done":
                self._flushing = False
                self._sink.response_end(now)
        except Exception:
            self.errors += 1

    def client_text(self, now: float, text: str) -> None:
        """Text to speak is not metered; ``input.done`` starts a flush."""
        try:
            if "input.done" not in text:  # cheap: input.text frames can be 128 KiB
                return
            scanned = scan_event(text, _NO_KEYS)
            if scanned is not None and scanned[0].get("type") == "input.done":
                self._flushing = True
        except Exception:
            self.errors += 1

    def client_binary(self, now: float, data: bytes) -> None:
        """Not part of the protocol: not metered."""

    def _start(self, event: dict[str, object]) -> None:
        rate, channels = event.get("sample_rate"), event.get("channels")
        fmt = AudioFormat.plausible(rate, channels, 2, self._default)
        kind = event.get("format")
        kind = kind.lower() if isinstance(kind, str) else "pcm"
        if kind == "pcm":
            self._mode = _PCM
            self._bps = float(fmt.bytes_per_second)
        elif kind == "wav":
            self._mode = _WAV
            self._wav = WavStream(fmt)
        else:
            self._mode = _OPAQUE
        self.reads_binary = self._mode == _WAV

    def __repr__(self) -> str:
        mode = ("pcm", "wav", "opaque")[self._mode]
        return f"<OmniSpeechWsAdapter {mode} errors={self.errors}>"
