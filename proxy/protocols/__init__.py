"""Audio extraction per upstream protocol: one small adapter per protocol family.

The relay builds one adapter per session with :func:`ws_adapter` or :func:`http_adapter`
and calls it for every relayed message or chunk, with the arrival time; the adapter turns
what it reads into :class:`MeterSink` calls (usually a :class:`proxy.meter.SessionMeter`).
Adapters only read: they never modify, delay or buffer the bytes relayed, and they never
raise (malformed data counts nothing; an internal failure increments ``adapter.errors``).

=============================  =========  ==================================================
protocol                       transport  module
=============================  =========  ==================================================
``vllm-realtime``              WS         :mod:`.realtime` (ASR text events, omni audio)
``openai-realtime``            WS         :mod:`.realtime` (``response.output_audio.delta``)
``vllm-omni-speech-ws``        WS         :mod:`.speech_ws` (JSON control + binary PCM/WAV)
``sagemaker-bidi``             WS         the inner protocol's adapter (default passthrough)
``passthrough-ws``             WS         :mod:`.passthrough` (frame gaps only)
``openai-speech-http``         HTTP       :mod:`.http` (SSE base64, raw PCM, WAV)
``openai-transcription-sse``   HTTP       :mod:`.http` (text events, ``[DONE]``)
``passthrough-http``           HTTP       :mod:`.passthrough` (chunk gaps only)
=============================  =========  ==================================================

Building blocks: :mod:`.b64json` (base64 length from JSON without decoding), :mod:`.sse`
(incremental event-stream parser), :mod:`.wav` (streaming RIFF header).
"""

from __future__ import annotations

from proxy.protocols.base import AudioFormat, HttpAdapter, MeterSink, WsAdapter
from proxy.protocols.http import SpeechHttpAdapter, TranscriptionSseAdapter
from proxy.protocols.passthrough import PassthroughHttpAdapter, PassthroughWsAdapter
from proxy.protocols.realtime import RealtimeAdapter
from proxy.protocols.speech_ws import OmniSpeechWsAdapter

__all__ = [
    "HTTP_PROTOCOLS",
    "PROTOCOLS",
    "WS_PROTOCOLS",
    "AudioFormat",
    "HttpAdapter",
    "MeterSink",
    "WsAdapter",
    "http_adapter",
    "ws_adapter",
]

#: Route protocols relayed over WebSocket.
WS_PROTOCOLS = frozenset(
    {
        "vllm-realtime",
        "openai-realtime",
        "vllm-omni-speech-ws",
        "sagemaker-bidi",
        "passthrough-ws",
    }
)
#: Route protocols relayed over HTTP.
HTTP_PROTOCOLS = frozenset({"openai-speech-http", "openai-transcription-sse", "passthrough-http"})
#: Every route protocol.
PROTOCOLS = WS_PROTOCOLS | HTTP_PROTOCOLS


def ws_adapter(
    protocol: str,
    sink: MeterSink,
    default_format: AudioFormat,
    inner_protocol: str | None = None,
) -> WsAdapter:
    """The adapter metering one WebSocket session of ``protocol``.

    ``default_format`` is the route's audio format, used where the stream does not say.
    ``sagemaker-bidi`` relays one WebSocket frame per SageMaker payload part, so it is
    metered as its ``inner_protocol`` (a WS protocol other than itself); without one, as
    ``passthrough-ws``. Raises ValueError for a protocol that is not a WS protocol (a
    configuration error, caught when settings are validated)."""
    if protocol == "sagemaker-bidi":
        inner = inner_protocol or "passthrough-ws"
        if inner == "sagemaker-bidi" or inner not in WS_PROTOCOLS:
            raise ValueError(f"sagemaker-bidi cannot carry inner protocol {inner!r}")
        return ws_adapter(inner, sink, default_format)
    if protocol == "vllm-realtime":
        return RealtimeAdapter(sink, default_format, openai=False)
    if protocol == "openai-realtime":
        return RealtimeAdapter(sink, default_format, openai=True)
    if protocol == "vllm-omni-speech-ws":
        return OmniSpeechWsAdapter(sink, default_format)
    if protocol == "passthrough-ws":
        return PassthroughWsAdapter(sink)
    expected = ", ".join(sorted(WS_PROTOCOLS))
    raise ValueError(f"{protocol!r} is not a WebSocket protocol; expected one of: {expected}")


def http_adapter(protocol: str, sink: MeterSink, default_format: AudioFormat) -> HttpAdapter:
    """The adapter metering one streaming HTTP exchange of ``protocol``.

    Raises ValueError for a protocol that is not an HTTP protocol."""
    if protocol == "openai-speech-http":
        return SpeechHttpAdapter(sink, default_format)
    if protocol == "openai-transcription-sse":
        return TranscriptionSseAdapter(sink, default_format)
    if protocol == "passthrough-http":
        return PassthroughHttpAdapter(sink)
    expected = ", ".join(sorted(HTTP_PROTOCOLS))
    raise ValueError(f"{protocol!r} is not an HTTP protocol; expected one of: {expected}")
