"""The route protocols, in one table: name -> transport, metering adapter, error shape.

Every place that varies by protocol looks it up here: the settings (which names a route
may use, which need a WebSocket, which carry another protocol inside), the adapter
factories (:func:`proxy.metering.adapters.ws_adapter`,
:func:`proxy.metering.adapters.http_adapter`) and
the in-band error event a ``refusal: close`` route sends
(:func:`proxy.admission.refusal.error_event`).
Adding a protocol is one :class:`ProtocolSpec` here (plus its adapter module); the contract
each one follows is in docs/protocols.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

from proxy.metering.adapters.base import AudioFormat, HttpAdapter, MeterSink, WsAdapter
from proxy.metering.adapters.http_streams import SpeechHttpAdapter, TranscriptionSseAdapter
from proxy.metering.adapters.passthrough import PassthroughHttpAdapter, PassthroughWsAdapter
from proxy.metering.adapters.realtime_events import RealtimeAdapter
from proxy.metering.adapters.speech_ws_audio import OmniSpeechWsAdapter
from proxy.metering.adapters.tokens import TokenStreamAdapter

__all__ = [
    "HTTP_ROUTE_PROTOCOLS",
    "PROTOCOLS",
    "PROTOCOL_TABLE",
    "WS_ROUTE_PROTOCOLS",
    "ErrorShape",
    "Protocol",
    "ProtocolSpec",
    "Transport",
    "inner_protocols",
    "spec",
]

#: Every route protocol name (the settings' ``protocol`` and ``inner_protocol`` type).
Protocol = Literal[
    "vllm-realtime",
    "openai-realtime",
    "vllm-omni-speech-ws",
    "openai-speech-http",
    "openai-transcription-sse",
    "openai-completions-tokens",
    "sagemaker-bidi",
    "passthrough-ws",
    "passthrough-http",
]
Transport = Literal["ws", "http"]
WsFactory = Callable[[MeterSink, AudioFormat], WsAdapter]
HttpFactory = Callable[[MeterSink, AudioFormat], HttpAdapter]
#: ``(error, extra) -> event``: ``error`` is the ``error`` object of the refusal body
#: (type, code, message, ...); ``extra`` the contract fields every event carries
#: (retry_after_s, fallback, queue_position).
ErrorShape = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]


def generic_error(error: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``{"type": "error", "error": {...}}``: the refusal body's error object as is."""
    return {"type": "error", "error": dict(error)}


def vllm_realtime_error(error: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM realtime: ``{"type": "error", "error": str, "code": str | null}``."""
    return {"type": "error", "error": error["message"], "code": error["code"], **extra}


def openai_realtime_error(error: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI realtime: ``{"type": "error", "error": {type, code, message, param,
    event_id}}``."""
    return {
        "type": "error",
        "error": {
            "type": error["type"],
            "code": error["code"],
            "message": error["message"],
            "param": None,
            "event_id": None,
            **extra,
        },
    }


def omni_speech_error(error: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM-Omni speech stream: ``{"type": "error", "message": str}``."""
    return {"type": "error", "message": error["message"], "code": error["code"], **extra}


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    """What one route protocol is.

    * ``transport``: relayed as a WebSocket (``ws``: a replica's http(s) URL is used in
      its ws(s) form; ``refusal: close`` and ``queue_feedback`` are possible) or as a
      (streaming) HTTP request (``http``).
    * ``ws_adapter`` / ``http_adapter``: builds the session's metering adapter from the
      sink and the route's audio format; exactly the one of the transport is set, except
      for a protocol that ``carries_inner``.
    * ``carries_inner``: the stream carries another WS protocol's frames (named by the
      route's ``inner_protocol``, required) and is metered and shaped as that one;
      ``default_inner`` is metered without one (the adapter factory's fallback).
    * ``error_shape``: the JSON error event a ``refusal: close`` route sends.
    * ``counts_tokens``: the stream's audio is generated tokens, each a fixed share of a
      second: the route's ``tokens_per_audio_second`` (required for, and only for, such a
      protocol).
    """

    name: Protocol
    transport: Transport
    ws_adapter: WsFactory | None = None
    http_adapter: HttpFactory | None = None
    error_shape: ErrorShape = generic_error
    carries_inner: bool = False
    default_inner: Protocol | None = None
    counts_tokens: bool = False

    @property
    def carriable(self) -> bool:
        """Whether a ``carries_inner`` protocol may carry this one: a WS protocol that
        carries none itself."""
        return self.transport == "ws" and not self.carries_inner


def _realtime(openai: bool) -> WsFactory:
    def build(sink: MeterSink, fmt: AudioFormat) -> WsAdapter:
        return RealtimeAdapter(sink, fmt, openai=openai)

    return build


def _passthrough_ws(sink: MeterSink, fmt: AudioFormat) -> WsAdapter:
    return PassthroughWsAdapter(sink)


def _passthrough_http(sink: MeterSink, fmt: AudioFormat) -> HttpAdapter:
    return PassthroughHttpAdapter(sink)


_SPECS = (
    ProtocolSpec(
        "vllm-realtime", "ws", ws_adapter=_realtime(False), error_shape=vllm_realtime_error
    ),
    ProtocolSpec(
        "openai-realtime", "ws", ws_adapter=_realtime(True), error_shape=openai_realtime_error
    ),
    ProtocolSpec(
        "vllm-omni-speech-ws", "ws", ws_adapter=OmniSpeechWsAdapter, error_shape=omni_speech_error
    ),
    ProtocolSpec("openai-speech-http", "http", http_adapter=SpeechHttpAdapter),
    ProtocolSpec("openai-transcription-sse", "http", http_adapter=TranscriptionSseAdapter),
    ProtocolSpec(
        "openai-completions-tokens", "http", http_adapter=TokenStreamAdapter, counts_tokens=True
    ),
    ProtocolSpec("sagemaker-bidi", "ws", carries_inner=True, default_inner="passthrough-ws"),
    ProtocolSpec("passthrough-ws", "ws", ws_adapter=_passthrough_ws),
    ProtocolSpec("passthrough-http", "http", http_adapter=_passthrough_http),
)

#: name -> spec, in the order of :data:`Protocol` (the order error messages list them).
PROTOCOL_TABLE: Final[Mapping[str, ProtocolSpec]] = MappingProxyType({s.name: s for s in _SPECS})
if list(PROTOCOL_TABLE) != list(get_args(Protocol)):  # pragma: no cover -- caught at import
    raise RuntimeError("PROTOCOL_TABLE and Protocol must list the same names in the same order")

#: Every route protocol.
PROTOCOLS: Final = frozenset(PROTOCOL_TABLE)
#: Route protocols relayed over WebSocket.
WS_ROUTE_PROTOCOLS: Final = frozenset(n for n, s in PROTOCOL_TABLE.items() if s.transport == "ws")
#: Route protocols relayed over HTTP.
HTTP_ROUTE_PROTOCOLS: Final = frozenset(
    n for n, s in PROTOCOL_TABLE.items() if s.transport == "http"
)


def spec(protocol: str) -> ProtocolSpec | None:
    """The table's entry for ``protocol``, or None for a name it does not hold."""
    return PROTOCOL_TABLE.get(protocol)


def inner_protocols() -> list[str]:
    """The protocols a ``carries_inner`` protocol may carry: WS ones that carry none."""
    return sorted(n for n, s in PROTOCOL_TABLE.items() if s.carriable)
