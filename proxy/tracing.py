"""OpenTelemetry traces of sessions: the ``[otel]`` extra, off unless ``tracing:
{enabled: true}``.

One span per session (``headroom.session``, kind SERVER) with a child span for each
step that ran: ``headroom.auth`` (the key and its quota, the request body),
``headroom.queue_wait`` (only when the session queued), ``headroom.upstream_connect``
(the handshake or request, failover included) and ``headroom.stream`` (the relay). A
client's W3C ``traceparent`` (and ``tracestate``) is continued: the session span is its
child. The upstream request or handshake carries the session span's own context in
its place, so the engine's spans join the same trace. The trace id goes into the
``session_end`` log line.

Everything happens at session boundaries: a span is started or ended when a step
starts or ends, never per chunk or frame. With tracing off the relays hold no tracer
(``RelayServices.tracer`` is None) and do nothing more than test that.

Spans leave through a batch processor and the OTLP/HTTP exporter, to
``tracing.endpoint`` or, unset, where the standard ``OTEL_EXPORTER_OTLP_*`` variables
say. Sampling is parent-based: a client's sampled flag is followed, and a trace that
starts here is sampled at ``tracing.sample_ratio``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from proxy.relay.session_record import SessionRecord
    from proxy.settings.observability import TracingSettings

__all__ = ["NO_OTEL", "SessionTrace", "SessionTracer", "make_tracer", "otel_available"]

_TRACE_HEADERS = (b"traceparent", b"tracestate")
#: The refusal and failure decisions a session span is marked in error for.
_FAILED = ("rejected_", "upstream_")
#: Why tracing cannot start without the extra, and what to do.
NO_OTEL = (
    "tracing.enabled is true but OpenTelemetry is not installed: "
    "pip install 'headroom-proxy[otel]' (or set tracing.enabled: false)"
)


def otel_available() -> bool:
    """Whether the ``[otel]`` extra (the SDK and the OTLP exporter) is installed."""
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    )


class SessionTrace:
    """One session's spans: the session span and the step running now."""

    __slots__ = ("_context", "_step", "_tracer", "span")

    def __init__(self, tracer: Any, span: Span, context: Any) -> None:
        self._tracer = tracer
        self._context = context
        self._step: Span | None = None
        self.span = span

    def begin(self, step: str) -> None:
        """Start the child span ``headroom.<step>``, ending the step before it."""
        self.end_step()
        self._step = self._tracer.start_span(f"headroom.{step}", context=self._context)

    def end_step(self) -> None:
        """End the step span running now, if any (the session span stays open)."""
        if self._step is not None:
            self._step.end()
            self._step = None

    def finish(self, record: SessionRecord) -> None:
        """End the open step and the session span, with what the record says."""
        from opentelemetry.trace import Status, StatusCode

        failed = record.decision.startswith(_FAILED) or record.error is not None
        if self._step is not None:
            if failed:
                self._step.set_status(Status(StatusCode.ERROR, record.error or record.decision))
            self.end_step()
        span = self.span
        attributes = {
            "headroom.session": record.session,
            "headroom.route": record.route,
            "headroom.pool": record.pool,
            "headroom.transport": record.transport,
            "headroom.decision": record.decision,
            "headroom.replica": record.replica,
            "headroom.tenant": record.tenant,
            "headroom.queue_wait_s": record.queue_wait_s,
            "client.address": record.client,
            "http.response.status_code": record.status,
            "headroom.bytes_up": record.bytes_up,
            "headroom.bytes_down": record.bytes_down,
        }
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if failed:
            span.set_status(Status(StatusCode.ERROR, record.error or record.decision))
        span.end()


class SessionTracer:
    """Starts a :class:`SessionTrace` per session, from ``provider``'s tracer."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("headroom")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, scope: dict[str, Any], record: SessionRecord) -> SessionTrace:
        """The session's trace, continuing the client's ``traceparent``; ``scope``'s
        headers then carry the session span's context instead (for the upstream), and
        ``record.trace_id`` its trace id."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        headers: list[tuple[bytes, bytes]] = scope["headers"]
        given = {
            name.lower().decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name.lower() in _TRACE_HEADERS
        }
        parent = self._propagator.extract(given) if given else None
        span = self._tracer.start_span("headroom.session", context=parent, kind=SpanKind.SERVER)
        context = set_span_in_context(span, parent)
        onward: dict[str, str] = {}
        self._propagator.inject(onward, context=context)
        kept = [(n, v) for n, v in headers if n.lower() not in _TRACE_HEADERS]
        scope["headers"] = kept + [(n.encode(), v.encode("latin-1")) for n, v in onward.items()]
        span_context = span.get_span_context()
        if span_context.is_valid:
            record.trace_id = format(span_context.trace_id, "032x")
        return SessionTrace(self._tracer, span, context)

    def shutdown(self) -> None:
        """Export what is buffered and stop (the gateway's shutdown)."""
        self.provider.shutdown()


def make_tracer(settings: TracingSettings) -> SessionTracer:
    """The tracer ``tracing:`` describes, exporting over OTLP/HTTP in batches. Raises
    RuntimeError naming the extra when it is not installed."""
    if not otel_available():
        raise RuntimeError(NO_OTEL)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    exporter = OTLPSpanExporter(endpoint=settings.endpoint) if settings.endpoint else None
    provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter()))
    return SessionTracer(provider)
