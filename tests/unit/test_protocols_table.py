"""The protocol table (proxy/metering/adapters/registry.py): every route protocol the settings
accept
has one complete entry, and every place that varies by protocol reads it."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest

from proxy.admission.refusal import error_event
from proxy.errors import CapacityRefused, ConfigError, FallbackHint
from proxy.metering.adapters import (
    HTTP_ROUTE_PROTOCOLS,
    PROTOCOL_TABLE,
    PROTOCOLS,
    WS_ROUTE_PROTOCOLS,
    AudioFormat,
    http_adapter,
    ws_adapter,
)
from proxy.metering.adapters.registry import inner_protocols
from proxy.settings import Protocol, RouteSettings, settings_from_mapping
from tests.unit.test_protocols_ws import Recorder

FORMAT = AudioFormat(24000, 1, 2)


def config(**route: Any) -> dict[str, Any]:
    return {
        "pools": [
            {"name": "p", "replicas": [{"name": "r", "url": "http://h:1", "max_sessions": 1}]}
        ],
        "routes": [{"path": "/x", "pool": "p", **route}],
    }


def route_problems(**route: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        settings_from_mapping(config(**route), env={})
    return info.value.problems


def test_the_settings_accept_exactly_the_tables_names_in_its_order() -> None:
    assert list(get_args(Protocol)) == list(PROTOCOL_TABLE)
    assert set(PROTOCOL_TABLE) == PROTOCOLS == WS_ROUTE_PROTOCOLS | HTTP_ROUTE_PROTOCOLS
    assert not WS_ROUTE_PROTOCOLS & HTTP_ROUTE_PROTOCOLS


@pytest.mark.parametrize("name", list(get_args(Protocol)))
def test_every_configured_protocol_has_a_complete_entry(name: str) -> None:
    spec = PROTOCOL_TABLE[name]
    assert spec.name == name
    assert spec.transport in ("ws", "http")
    assert callable(spec.error_shape)
    if spec.carries_inner:
        assert spec.transport == "ws"
        assert spec.ws_adapter is None and spec.http_adapter is None
        assert spec.default_inner in inner_protocols()
        # metered as whatever it carries
        for inner in inner_protocols():
            built = ws_adapter(name, Recorder(), FORMAT, inner)
            assert type(built) is type(ws_adapter(inner, Recorder(), FORMAT))
    elif spec.transport == "ws":
        assert spec.ws_adapter is not None and spec.http_adapter is None
        assert spec.default_inner is None
        assert hasattr(ws_adapter(name, Recorder(), FORMAT), "upstream_binary")
    else:
        assert spec.http_adapter is not None and spec.ws_adapter is None
        assert spec.default_inner is None
        assert hasattr(http_adapter(name, Recorder(), FORMAT), "response_chunk")


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_a_route_follows_its_entry(name: str) -> None:
    spec = PROTOCOL_TABLE[name]
    inner: dict[str, Any] = {"inner_protocol": spec.default_inner} if spec.carries_inner else {}
    if spec.counts_tokens:
        inner["tokens_per_audio_second"] = 84
    route = RouteSettings(path="/x", pool="p", protocol=name, **inner)
    assert route.is_websocket == (spec.transport == "ws")
    if spec.transport == "http":
        problems = dict(
            route_problems(protocol=name, refusal="close", queue_feedback=True, **inner)
        )
        assert problems["routes[0].refusal"].startswith("'close' needs a WebSocket protocol")
        assert problems["routes[0].queue_feedback"].startswith("needs a WebSocket protocol")


def test_an_unknown_protocol_is_refused_listing_the_tables_names() -> None:
    [(where, why)] = route_problems(protocol="vllm-realtme")
    assert where == "routes[0].protocol"
    assert why.startswith("must be one of: " + ", ".join(PROTOCOL_TABLE))
    assert "did you mean 'vllm-realtime'?" in why


def test_inner_protocol_rules_come_from_the_table() -> None:
    carriers = [n for n, s in PROTOCOL_TABLE.items() if s.carries_inner]
    assert carriers == ["sagemaker-bidi"]
    listed = ", ".join(inner_protocols())
    assert inner_protocols() == sorted(WS_ROUTE_PROTOCOLS - set(carriers))
    assert route_problems(protocol="sagemaker-bidi") == [
        (
            "routes[0].inner_protocol",
            f"required for sagemaker-bidi (the protocol inside the stream): {listed}",
        )
    ]
    for bad in ("sagemaker-bidi", "openai-speech-http"):
        assert route_problems(protocol="sagemaker-bidi", inner_protocol=bad) == [
            ("routes[0].inner_protocol", f"must be one of: {listed} (got {bad!r})")
        ]
    assert route_problems(protocol="vllm-realtime", inner_protocol="passthrough-ws") == [
        ("routes[0].inner_protocol", "only valid with protocol sagemaker-bidi")
    ]


def test_tokens_per_audio_second_is_required_for_and_only_for_token_protocols() -> None:
    counters = [n for n, s in PROTOCOL_TABLE.items() if s.counts_tokens]
    assert counters == ["openai-completions-tokens"]
    assert route_problems(protocol="openai-completions-tokens") == [
        (
            "routes[0].tokens_per_audio_second",
            "required for openai-completions-tokens: how many generated tokens make one "
            "second of audio (Orpheus's: docs/protocols.md)",
        )
    ]
    assert route_problems(protocol="openai-speech-http", tokens_per_audio_second=84) == [
        ("routes[0].tokens_per_audio_second", "only valid with protocol openai-completions-tokens")
    ]
    for bad in (0, -1, 10001, "many", float("nan"), float("inf")):
        [(where, _why)] = route_problems(
            protocol="openai-completions-tokens", tokens_per_audio_second=bad
        )
        assert where == "routes[0].tokens_per_audio_second"
    route = RouteSettings(
        path="/x", pool="p", protocol="openai-completions-tokens", tokens_per_audio_second=12.5
    )
    assert route.tokens_per_audio_second == 12.5


def refused() -> CapacityRefused:
    return CapacityRefused(
        "queue_full", retry_after_s=3, pool="p", queue_position=2, fallback=FallbackHint(voice="v")
    )


#: The in-band error event of each WS protocol, as a ``refusal: close`` client reads it.
EVENTS: dict[str, Any] = {
    "vllm-realtime": lambda e, x: {"type": "error", "error": e["message"], "code": e["code"], **x},
    "openai-realtime": lambda e, x: {
        "type": "error",
        "error": {
            "type": e["type"],
            "code": e["code"],
            "message": e["message"],
            "param": None,
            "event_id": None,
            **x,
        },
    },
    "vllm-omni-speech-ws": lambda e, x: {
        "type": "error",
        "message": e["message"],
        "code": e["code"],
        **x,
    },
    "passthrough-ws": lambda e, x: {"type": "error", "error": e},
    "sagemaker-bidi": lambda e, x: {"type": "error", "error": e},
}


@pytest.mark.parametrize("name", sorted(WS_ROUTE_PROTOCOLS))
def test_each_ws_protocols_error_event_has_its_own_shape_and_the_contract_fields(
    name: str,
) -> None:
    err = refused()
    body = err.body()["error"]
    extra = {k: body[k] for k in ("retry_after_s", "fallback", "queue_position")}
    text = error_event(name, err)
    assert json.loads(text) == EVENTS[name](body, extra)
    for field in ('"retry_after_s":3.0', '"queue_position":2', '"fallback":{"voice":"v"'):
        assert field in text
