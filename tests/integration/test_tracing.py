"""OpenTelemetry traces of sessions (the ``[otel]`` extra, :mod:`proxy.tracing`), over
real sockets, with the SDK's in-memory span exporter in place of OTLP."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from websockets.asyncio.client import connect

from proxy.settings.observability import TracingSettings
from proxy.tracing import SessionTracer, make_tracer, otel_available
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import hello, upstream, wait_until

__all__ = ["upstream"]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"

ROUTES = [
    {"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"},
    {"path": "/echo-http", "pool": "main", "protocol": "passthrough-http"},
]


def traced(proxy: Proxy) -> InMemorySpanExporter:
    """Give the gateway a tracer whose spans land in memory (before any session)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    proxy.runtime.tracer = SessionTracer(provider)
    return exporter


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def hex_ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def session_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event")]


async def test_a_websocket_session_continues_the_clients_trace_upstream(
    start_proxy: Any, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], ROUTES))
    exporter = traced(proxy)
    with caplog.at_level(logging.INFO, logger="headroom.session"):
        headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
        async with connect(
            proxy.ws_url + "/ws/echo", additional_headers=headers, compression=None
        ) as ws:
            seen = (await hello(ws))["headers"]
        await wait_until(lambda: "headroom.session" in by_name(exporter.get_finished_spans()))
    spans = by_name(exporter.get_finished_spans())
    session = spans["headroom.session"]
    trace_id, session_span = hex_ids(session)
    # the client's trace continues: the session span is the client span's child
    assert trace_id == TRACE_ID
    assert session.parent is not None and format(session.parent.span_id, "016x") == CLIENT_SPAN
    # and the engine is handed the session span's context, not the client's
    assert seen["traceparent"] == f"00-{TRACE_ID}-{session_span}-01"
    assert seen["tracestate"] == "vendor=1"
    assert {"headroom.auth", "headroom.upstream_connect", "headroom.stream"} <= set(spans)
    assert "headroom.queue_wait" not in spans  # it did not queue
    for step in ("headroom.auth", "headroom.upstream_connect", "headroom.stream"):
        parent = spans[step].parent
        assert parent is not None and format(parent.span_id, "016x") == session_span
        assert hex_ids(spans[step])[0] == TRACE_ID
    attributes = session.attributes or {}
    assert attributes["headroom.decision"] == "admitted"
    assert attributes["headroom.replica"] == "gpu0"
    assert attributes["client.address"] == "127.0.0.1"
    (line,) = session_lines(caplog)
    assert line["trace_id"] == TRACE_ID
    assert line["client"] == "127.0.0.1" and line["tenant"] is None


async def test_an_http_session_starts_a_trace_and_passes_it_upstream(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], ROUTES))
    exporter = traced(proxy)
    async with httpx.AsyncClient() as client:
        answer = await client.post(proxy.http_url + "/echo-http", content=b"{}")
    assert answer.status_code == 200
    seen = answer.json()["headers"]
    await wait_until(lambda: "headroom.session" in by_name(exporter.get_finished_spans()))
    session = by_name(exporter.get_finished_spans())["headroom.session"]
    trace_id, span_id = hex_ids(session)
    assert session.parent is None  # no traceparent from the client: a new trace
    # sampled (the flags' random-trace-id bit may be set too: a trace id made here)
    assert seen["traceparent"].startswith(f"00-{trace_id}-{span_id}-")


async def test_a_refused_session_ends_its_span_in_error(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 1)], ROUTES))
    exporter = traced(proxy)
    headers = {"traceparent": TRACEPARENT}
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as first:
        await hello(first)
        async with httpx.AsyncClient() as client:
            answer = await client.post(proxy.http_url + "/echo-http", headers=headers)
        assert answer.status_code == 503  # the one slot is taken, and there is no queue
    await wait_until(lambda: len(exporter.get_finished_spans()) >= 2)
    refused = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "headroom.session" and hex_ids(s)[0] == TRACE_ID
    ]
    (span,) = refused
    assert (span.attributes or {})["headroom.decision"] == "rejected_pool_full"
    assert span.status.status_code.name == "ERROR"


async def test_without_a_tracer_the_clients_traceparent_passes_unchanged(
    start_proxy: Any, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], ROUTES))
    assert proxy.runtime.tracer is None  # tracing.enabled defaults to false
    with caplog.at_level(logging.INFO, logger="headroom.session"):
        async with connect(
            proxy.ws_url + "/ws/echo",
            additional_headers={"traceparent": TRACEPARENT},
            compression=None,
        ) as ws:
            assert (await hello(ws))["headers"]["traceparent"] == TRACEPARENT
        await wait_until(lambda: bool(session_lines(caplog)))
    (line,) = session_lines(caplog)
    assert "trace_id" not in line and line["client"] == "127.0.0.1"


def test_the_configured_tracer_exports_over_otlp_with_the_settings() -> None:
    assert otel_available()
    settings = TracingSettings(
        enabled=True, endpoint="http://127.0.0.1:9/v1/traces", service_name="gw", sample_ratio=0.25
    )
    tracer = make_tracer(settings)
    try:
        provider = tracer.provider
        assert provider.resource.attributes["service.name"] == "gw"
        assert "0.25" in provider.sampler.get_description()
    finally:
        tracer.shutdown()


def test_session_end_json_carries_tenant_client_and_trace() -> None:
    from proxy.relay.session_record import SessionRecord

    record = SessionRecord("s-1", "/ws", "main", "ws", 0.0)
    record.tenant, record.client, record.trace_id = "team-a", "10.0.0.9", TRACE_ID
    fields = json.loads(json.dumps(record.fields()))
    assert (fields["tenant"], fields["client"], fields["trace_id"]) == (
        "team-a",
        "10.0.0.9",
        TRACE_ID,
    )


def test_tracing_without_the_extra_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    import proxy.tracing
    from proxy.process import cli
    from tests.unit.test_settings import valid

    monkeypatch.setattr(proxy.tracing, "otel_available", lambda: False)
    monkeypatch.setenv("HEADROOM_SECRETS_DIR", "")
    path = tmp_path / "headroom.yaml"
    path.write_text(yaml.safe_dump({**valid(), "tracing": {"enabled": True}}))
    assert cli.main(["check", "--config", str(path)]) == 2
    assert "pip install 'headroom-proxy[otel]'" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"headroom-proxy\[otel\]"):
        make_tracer(TracingSettings(enabled=True))


async def test_a_queued_session_has_a_queue_wait_span(start_proxy: Any, upstream: Any) -> None:
    import asyncio

    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", server.http_url, 1)], ROUTES, queue={"max_depth": 2, "max_wait_s": 30}
        )
    )
    exporter = traced(proxy)
    headers = {"traceparent": TRACEPARENT}

    async def second() -> None:
        async with connect(
            proxy.ws_url + "/ws/echo", additional_headers=headers, compression=None
        ) as ws:
            await hello(ws)

    async with connect(proxy.ws_url + "/ws/echo", compression=None) as first:
        await hello(first)
        waiting = asyncio.ensure_future(second())
        await wait_until(lambda: proxy.gate.queued == 1)
    await waiting  # the first one's slot went to it
    await wait_until(
        lambda: sum(s.name == "headroom.session" for s in exporter.get_finished_spans()) == 2
    )
    mine = [s for s in exporter.get_finished_spans() if hex_ids(s)[0] == TRACE_ID]
    names = {s.name for s in mine}
    assert {"headroom.session", "headroom.auth", "headroom.queue_wait"} <= names
    assert {"headroom.upstream_connect", "headroom.stream"} <= names
    session = by_name(tuple(mine))["headroom.session"]
    assert (session.attributes or {})["headroom.decision"] == "admitted_after_queue"
