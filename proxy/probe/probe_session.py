"""What a probe session is: where it goes, how it ends, and how it is metered.

:class:`ClientOptions` says how to reach the target (:func:`endpoint_url` builds the
endpoint from a base URL and a protocol); :class:`SessionRecorder` holds one session's
:class:`proxy.metering.session_meter.SessionMeter` (with a recording sink) and freezes it into an
:class:`~proxy.probe.analysis.SessionTrace`; :class:`Refusal` and :class:`SessionFailed`
are how a session ends early (:mod:`proxy.probe.clients` raises them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from proxy.metering.adapters.registry import PROTOCOL_TABLE
from proxy.metering.session_meter import RecordingReplicaSink, SessionMeter
from proxy.probe.analysis import Arrival, Outcome, SessionTrace

__all__ = [
    "PATHS",
    "PROTOCOL_KINDS",
    "ClientOptions",
    "Refusal",
    "SessionFailed",
    "SessionRecorder",
    "detect_model",
    "endpoint_url",
]

#: Default endpoint path per protocol.
PATHS = {
    "vllm-omni-speech-ws": "/v1/audio/speech/stream",
    "openai-speech-http": "/v1/audio/speech",
    "vllm-realtime": "/v1/realtime",
    "openai-transcription-sse": "/v1/audio/transcriptions",
    "openai-completions-tokens": "/v1/completions",
}
#: What each supported protocol carries: tts (audio out) or asr (transcript out).
PROTOCOL_KINDS = {
    "vllm-omni-speech-ws": "tts",
    "openai-speech-http": "tts",
    "vllm-realtime": "asr",
    "openai-transcription-sse": "asr",
    "openai-completions-tokens": "tts",
}


class Refusal(Exception):
    """The target refused the session (capacity): 503/429, or WebSocket close 1013."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class SessionFailed(Exception):
    """The session failed: connect error, error event, bad status, early close."""


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How sessions talk to the target. ``url`` is the endpoint (any scheme)."""

    url: str
    protocol: str
    headers: tuple[tuple[str, str], ...] = ()
    model: str | None = None
    voice: str | None = None
    sample_rate: int = 24000
    stream_format: str = "audio"
    asr_pace: float = 0.0
    prebuffer_s: float = 0.2
    #: ``openai-completions-tokens``: generated tokens per second of audio.
    tokens_per_audio_second: float | None = None
    open_timeout_s: float = 10.0
    read_timeout_s: float = 60.0


def endpoint_url(target: str, protocol: str) -> str:
    """``target`` with the protocol's scheme (ws/http) and, if it has no path, its path."""
    if protocol not in PATHS:
        raise ValueError(f"unsupported protocol {protocol!r}; use one of {', '.join(PATHS)}")
    parts = urlsplit(target if "://" in target else f"http://{target}")
    secure = parts.scheme in ("https", "wss")
    ws = PROTOCOL_TABLE[protocol].transport == "ws"
    scheme = ("wss" if secure else "ws") if ws else ("https" if secure else "http")
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
        raise ValueError(f"--target must be an http(s):// or ws(s):// URL, got {target!r}")
    path = parts.path if parts.path not in ("", "/") else PATHS[protocol]
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class SessionRecorder:
    """A session's meter (started now) and the trace it becomes on :meth:`close`."""

    def __init__(self, clock: Callable[[], float], prebuffer_s: float = 0.2) -> None:
        self.clock = clock
        self.started_at = clock()
        self.sink = RecordingReplicaSink()
        self.meter = SessionMeter(self.started_at, self.sink, prebuffer_s)
        self.audio_sent_s = 0.0
        #: When the target began serving the session (:meth:`opened`), None until then.
        self.opened_at: float | None = None
        self.trace: SessionTrace | None = None
        self._before_finish: list[Callable[[float], None]] = []

    def opened(self, at: float) -> None:
        """The target began serving the session at ``at``: it answered the WebSocket
        handshake or sent the HTTP response's headers. Headroom's queue feedback answers
        the handshake at once and sends ``headroom.admitted`` when the session leaves its
        queue: that later call wins. What came before is time the session waited."""
        self.opened_at = at

    def before_finish(self, hook: Callable[[float], None]) -> None:
        """Call ``hook(now)`` when the session closes, before the meter finishes (an HTTP
        adapter's ``response_complete`` reports the chunk it holds back)."""
        self._before_finish.append(hook)

    def close(self, outcome: Outcome, detail: str = "") -> SessionTrace:
        """Finish the meter and freeze the trace (idempotent: the first call wins)."""
        if self.trace is None:
            now = self.clock()
            for hook in self._before_finish:
                hook(now)
            summary = self.meter.finish(now)
            self.trace = SessionTrace(
                started_at=self.started_at,
                ended_at=now,
                outcome=outcome,
                arrivals=tuple(Arrival(*c) for c in self.sink.chunks),
                underruns=tuple(self.sink.underrun_at),
                audio_sent_s=self.audio_sent_s,
                opened_at=self.opened_at,
                finalize_s=summary.finalize_seconds,
                detail=detail,
            )
        return self.trace


async def detect_model(
    http: httpx.AsyncClient, url: str, headers: tuple[tuple[str, str], ...] = ()
) -> str | None:
    """The first model id the target's ``GET /v1/models`` lists, or None."""
    parts = urlsplit(url)
    scheme = "https" if parts.scheme in ("https", "wss") else "http"
    try:
        url = urlunsplit((scheme, parts.netloc, "/v1/models", "", ""))
        response = await http.get(url, headers=list(headers), timeout=5.0)
        data = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        model = data[0].get("id")
        return model if isinstance(model, str) else None
    return None
