"""The shapes every protocol adapter shares: audio formats, the meter sink, adapter protocols.

An adapter watches one session's frames as the relay forwards them and tells a
:class:`MeterSink` what it saw: seconds of audio, metered non-audio events (gaps only),
utterance and response ends, and the two ASR finalize markers. Adapters never modify,
hold back or re-send the bytes relayed: they only read them as the relay sends them.

Contract of every adapter method: it never raises. Malformed or unexpected data counts
nothing and is otherwise ignored; an internal failure increments the adapter's ``errors``
attribute instead of escaping into the relay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "MAX_TOKENS_PER_SECOND",
    "AudioFormat",
    "HttpAdapter",
    "MeterSink",
    "WsAdapter",
    "header",
]


#: Plausible PCM formats. A format a client declares (request ``sample_rate``, a realtime
#: ``session.update``) outside these is ignored, so no client can make the meter report
#: impossible audio and trip the guard for every session on its replica.
_BOUNDS = (("sample_rate", 8000, 384000), ("channels", 1, 8), ("sample_width", 1, 4))
#: The most tokens a token stream may count for one second of audio.
MAX_TOKENS_PER_SECOND = 10000.0


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """Uncompressed interleaved PCM: ``sample_rate`` Hz, ``channels``, ``sample_width`` bytes.

    ``tokens_per_second`` is for a token stream (``openai-completions-tokens``): how many
    generated tokens make one second of audio; None for every other protocol."""

    sample_rate: int = 24000
    channels: int = 1
    sample_width: int = 2
    tokens_per_second: float | None = None

    def __post_init__(self) -> None:
        for name, low, high in _BOUNDS:
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"AudioFormat.{name} must be an int in [{low}, {high}], got {value!r}"
                )
        rate = self.tokens_per_second
        if rate is not None and (
            type(rate) not in (int, float) or not 0 < rate <= MAX_TOKENS_PER_SECOND
        ):
            raise ValueError(
                f"AudioFormat.tokens_per_second must be a number in (0, "
                f"{MAX_TOKENS_PER_SECOND}], got {rate!r}"
            )

    @classmethod
    def plausible(
        cls, sample_rate: object, channels: object, sample_width: int, fallback: AudioFormat
    ) -> AudioFormat:
        """The declared format if it is a plausible PCM format, else ``fallback``'s values
        for whatever was not plausible (a declaration never raises)."""
        rate = sample_rate if type(sample_rate) is int else 0
        chans = channels if type(channels) is int else 0
        rate = rate if _BOUNDS[0][1] <= rate <= _BOUNDS[0][2] else fallback.sample_rate
        chans = chans if _BOUNDS[1][1] <= chans <= _BOUNDS[1][2] else fallback.channels
        return cls(rate, chans, sample_width)

    @property
    def bytes_per_second(self) -> int:
        """Bytes of this PCM format that play for one second."""
        return self.sample_rate * self.channels * self.sample_width

    def seconds(self, nbytes: int) -> float:
        """Play time of ``nbytes`` bytes (a trailing partial frame counts pro rata)."""
        return nbytes / self.bytes_per_second


class MeterSink(Protocol):
    """Where adapters report what they saw. ``now`` is the arrival time (monotonic seconds)."""

    def audio(self, now: float, seconds: float) -> None:
        """An upstream chunk carrying ``seconds`` of audio arrived."""

    def event(self, now: float) -> None:
        """A metered non-audio upstream event arrived (ASR text delta, passthrough frame)."""

    def utterance_end(self, now: float) -> None:
        """The upstream finished one unit of audio (a sentence) and more follows.

        The next unit's first chunk measures first-chunk latency, not delivery speed: it
        gets no gap or ratio. The listener keeps playing: running dry before it arrives is
        a stall."""

    def response_end(self, now: float) -> None:
        """The upstream delivered everything asked of it and now waits for the client
        (``session.done``, ``response.done``, ``speech.audio.done``). Implies
        :meth:`utterance_end`; silence until the client's next request is not a stall."""

    def commit_final(self, now: float) -> None:
        """The client finished its input (ASR): finalize latency starts."""

    def transcript_final(self, now: float) -> None:
        """The upstream sent the final transcript: finalize latency ends."""


class WsAdapter(Protocol):
    """Meters one WebSocket session. The relay calls one method per relayed message."""

    errors: int
    #: Whether :meth:`upstream_binary` reads its message's content. When it does not (it
    #: meters by length, or not at all), the relay passes ``b""`` and the length as
    #: ``size`` and copies nothing out of the stream. Read again after every upstream
    #: text message (an event there may change how binary messages are metered).
    reads_binary: bool

    def client_text(self, now: float, text: str) -> None: ...

    def client_binary(self, now: float, data: bytes) -> None: ...

    def upstream_text(self, now: float, text: str) -> None: ...

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        """A complete binary message from the upstream: ``data`` (``b""`` unless
        :attr:`reads_binary`), ``size`` bytes long (``-1``: ``len(data)``)."""


class HttpAdapter(Protocol):
    """Meters one streaming HTTP exchange.

    Call order: :meth:`request` once (before or while the body is sent),
    :meth:`request_complete` when the request body has been fully sent upstream (the
    "commit" of an ASR upload), :meth:`response_start` once the status line and headers
    arrive, then :meth:`response_chunk` for every body chunk relayed to the client."""

    errors: int

    def request(
        self, method: str, query: Mapping[str, str], content_type: str | None, body: bytes
    ) -> None:
        """The client's request. ``body`` may be empty or only its first bytes when the
        relay streams it; fields it cannot see fall back to the route's defaults."""

    def request_complete(self, now: float) -> None:
        """The last request-body byte was sent upstream."""

    def response_start(self, status: int, headers: Mapping[str, str]) -> None:
        """Status and headers of the upstream response."""

    def response_chunk(self, now: float, chunk: bytes) -> None:
        """One response-body chunk, as relayed (any split)."""

    def response_complete(self, now: float) -> None:
        """The response body ended (or the exchange was cut): report anything held back.
        Call before ``meter.finish``."""


def header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive lookup of ``name`` (given in lower case) in any header mapping."""
    value = headers.get(name)
    if value is not None:
        return value
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None
