"""The models of the operational sections: readiness, tracing and where ``/metrics`` is
served. Part of :class:`proxy.settings.schema.Settings`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MetricsSettings", "Readiness", "TracingSettings"]

#: What ``/readyz`` follows. ``upstream``: the replicas and the admission backend too (a
#: sidecar, where the pod is the engine; SageMaker's ``/ping``). ``self``: this process
#: only -- listening, configuration loaded, not draining -- so a gateway whose replicas
#: are all down stays in its Service and answers with refusals (503 with Retry-After).
Readiness = Literal["self", "upstream"]


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
    )


class TracingSettings(_Frozen):
    """OpenTelemetry traces (the ``[otel]`` extra; :mod:`proxy.tracing`): a span per
    session with children for auth, queue wait, upstream connect and the stream,
    exported over OTLP/HTTP. ``endpoint`` unset: the exporter's own default and
    ``OTEL_EXPORTER_OTLP_*`` variables apply."""

    enabled: bool = False
    endpoint: Annotated[str, Field(min_length=1, pattern=r"^https?://\S+$")] | None = None
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "headroom"
    #: The share of traces started here that are sampled (a client's sampled
    #: ``traceparent`` is followed whatever this says).
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0


class MetricsSettings(_Frozen):
    """Where ``GET /metrics`` is served: always on the admin listener; on the client
    port only with ``client_port: true`` (it names tenants and the topology)."""

    client_port: bool = False
