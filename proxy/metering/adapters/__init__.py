"""Audio extraction per upstream protocol: one small adapter per protocol family.

The relay builds one adapter per session with :func:`ws_adapter` or :func:`http_adapter`
and calls it for every relayed message or chunk, with the arrival time; the adapter turns
what it reads into :class:`MeterSink` calls (usually a
:class:`proxy.metering.session_meter.SessionMeter`).
Both factories look the protocol up in :data:`PROTOCOL_TABLE` (:mod:`.registry`), which also
holds each protocol's transport and error-event shape, and is what the settings check.
Adapters only read: they never modify, delay or buffer the bytes relayed, and they never
raise (malformed data counts nothing; an internal failure increments ``adapter.errors``).

=============================  =========  ==================================================
protocol                       transport  module
=============================  =========  ==================================================
``vllm-realtime``              WS         :mod:`.realtime_events` (ASR text, omni audio)
``openai-realtime``            WS         :mod:`.realtime_events` (``response.output_audio.delta``)
``vllm-omni-speech-ws``        WS         :mod:`.speech_ws_audio` (JSON control + binary PCM/WAV)
``sagemaker-bidi``             WS         the inner protocol's adapter (default passthrough)
``passthrough-ws``             WS         :mod:`.passthrough` (frame gaps only)
``openai-speech-http``         HTTP       :mod:`.http_streams` (SSE base64, raw PCM, WAV)
``openai-transcription-sse``   HTTP       :mod:`.http_streams` (text events, ``[DONE]``)
``openai-completions-tokens``  HTTP       :mod:`.tokens` (completion tokens as audio)
``passthrough-http``           HTTP       :mod:`.passthrough` (chunk gaps only)
=============================  =========  ==================================================

Building blocks: :mod:`.base` (what every adapter shares: audio formats, the
:class:`MeterSink` calls, the adapter protocols), :mod:`.b64json` (base64 length from JSON
without decoding), :mod:`.sse` (incremental event-stream parser), :mod:`.wav` (streaming
RIFF header).
"""

from __future__ import annotations

from proxy.metering.adapters.base import AudioFormat, HttpAdapter, MeterSink, WsAdapter
from proxy.metering.adapters.registry import (
    HTTP_ROUTE_PROTOCOLS,
    PROTOCOL_TABLE,
    PROTOCOLS,
    WS_ROUTE_PROTOCOLS,
    Protocol,
    ProtocolSpec,
    spec,
)

__all__ = [
    "HTTP_ROUTE_PROTOCOLS",
    "PROTOCOLS",
    "PROTOCOL_TABLE",
    "WS_ROUTE_PROTOCOLS",
    "AudioFormat",
    "HttpAdapter",
    "MeterSink",
    "Protocol",
    "ProtocolSpec",
    "WsAdapter",
    "http_adapter",
    "spec",
    "ws_adapter",
]


def ws_adapter(
    protocol: str,
    sink: MeterSink,
    default_format: AudioFormat,
    inner_protocol: str | None = None,
) -> WsAdapter:
    """The adapter metering one WebSocket session of ``protocol``.

    ``default_format`` is the route's audio format, used where the stream does not say.
    A protocol that carries another (``sagemaker-bidi`` relays one WebSocket frame per
    SageMaker payload part) is metered as its ``inner_protocol`` (a WS protocol that
    carries none); without one, as its ``default_inner`` (``passthrough-ws``). Raises
    ValueError for a protocol that is not a WS protocol (a configuration error, caught
    when settings are validated)."""
    entry = spec(protocol)
    if entry is not None and entry.carries_inner:
        inner = inner_protocol or entry.default_inner
        carried = spec(inner) if inner is not None else None
        if carried is None or not carried.carriable:
            raise ValueError(f"{protocol} cannot carry inner protocol {inner!r}")
        return ws_adapter(carried.name, sink, default_format)
    if entry is None or entry.ws_adapter is None:
        expected = ", ".join(sorted(WS_ROUTE_PROTOCOLS))
        raise ValueError(f"{protocol!r} is not a WebSocket protocol; expected one of: {expected}")
    return entry.ws_adapter(sink, default_format)


def http_adapter(protocol: str, sink: MeterSink, default_format: AudioFormat) -> HttpAdapter:
    """The adapter metering one streaming HTTP exchange of ``protocol``.

    Raises ValueError for a protocol that is not an HTTP protocol."""
    entry = spec(protocol)
    if entry is None or entry.http_adapter is None:
        expected = ", ".join(sorted(HTTP_ROUTE_PROTOCOLS))
        raise ValueError(f"{protocol!r} is not an HTTP protocol; expected one of: {expected}")
    return entry.http_adapter(sink, default_format)
