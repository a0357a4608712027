"""The validated configuration: one frozen :class:`Settings`, the only reader of files/env.

Sources, highest priority first: ``HEADROOM_*`` environment variables (rules in
:mod:`proxy.settings.environment`), then a mounted secret file, then a ``.env`` file
(:mod:`proxy.settings.sources`), then one YAML file (``headroom serve --config FILE`` or
``HEADROOM_CONFIG``), then the defaults declared in the models.

Every failure -- a missing or unreadable file, YAML syntax (with line and column), a
top level that is not a mapping, a bad environment variable, and every validation problem
-- is one :class:`~proxy.errors.ConfigError` listing all problems at once as
``(field path, reason)``, e.g. ``("pools[0].replicas[1].max_sessions", "must be >= 1
(got 0)")``. Unknown keys are errors, with a "did you mean" where a name is close; so
is a key repeated in one mapping (:mod:`proxy.settings.strict_yaml`), in the file or in a
variable's YAML value.

All models are frozen and hashable, so a reload can compare old and new settings.

The package, by concern:

* :mod:`~proxy.settings.schema` -- the root :class:`Settings` and its rules over the whole;
* :mod:`~proxy.settings.fields` -- the field types and checks the models share, and their
  frozen base;
* :mod:`~proxy.settings.gateway` -- the gateway's own behaviour: listeners, limits,
  forwarded headers, metering, the guard, health checks;
* :mod:`~proxy.settings.topology` -- pools, replicas, queues, fallbacks, reserves, routes
  and pipelines;
* :mod:`~proxy.settings.auth` -- client API keys;
* :mod:`~proxy.settings.admission` -- the admission store (memory or Redis, Sentinel) and
  gang reservations;
* :mod:`~proxy.settings.gpus` -- co-location: GPUs and the engines sharing them;
* :mod:`~proxy.settings.observability` -- readiness, tracing, where metrics are served;
* :mod:`~proxy.settings.references` -- checks across sections (unique names, references
  to pools, replicas and GPUs, ports, tenants);
* :mod:`~proxy.settings.loading` -- the YAML file, the overlays, validation into one
  ConfigError, and what a live reload may not change;
* :mod:`~proxy.settings.strict_yaml` -- PyYAML's safe loader, except that a mapping may
  not repeat a key;
* :mod:`~proxy.settings.environment` -- the ``HEADROOM_*`` overlay (variable names to
  setting paths) and validation errors turned into ``(field path, reason)`` problems;
* :mod:`~proxy.settings.sources` -- the secrets directory and the ``.env`` file, applied
  by the same overlay;
* :mod:`~proxy.settings.summary` -- the digest ``headroom check`` prints.

Import from ``proxy.settings``; the names below are its public interface.
"""

from __future__ import annotations

from proxy.metering.adapters.registry import HTTP_ROUTE_PROTOCOLS, WS_ROUTE_PROTOCOLS, Protocol
from proxy.settings.admission import (
    AdmissionSettings,
    RedisSettings,
    ReservationSettings,
    SentinelSettings,
)
from proxy.settings.auth import ApiKeySettings, AuthSettings
from proxy.settings.gateway import (
    AdminSettings,
    ForwardedSettings,
    GuardSettings,
    HealthSettings,
    LimitsSettings,
    ListenSettings,
    MeterSettings,
)
from proxy.settings.gpus import GpuEngineSettings, GpuSettings
from proxy.settings.loading import (
    cut_short_problems,
    load_settings,
    read_config_text,
    reload_problems,
    settings_from_mapping,
    settings_from_text,
)
from proxy.settings.schema import Settings
from proxy.settings.summary import summary
from proxy.settings.topology import (
    AudioSettings,
    FallbackSettings,
    PipelineSettings,
    PoolSettings,
    QueueSettings,
    ReplicaSettings,
    ReserveSettings,
    RouteSettings,
    ws_base,
)

__all__ = [
    "HTTP_ROUTE_PROTOCOLS",
    "WS_ROUTE_PROTOCOLS",
    "AdmissionSettings",
    "AdminSettings",
    "ApiKeySettings",
    "AudioSettings",
    "AuthSettings",
    "FallbackSettings",
    "ForwardedSettings",
    "GpuEngineSettings",
    "GpuSettings",
    "GuardSettings",
    "HealthSettings",
    "LimitsSettings",
    "ListenSettings",
    "MeterSettings",
    "PipelineSettings",
    "PoolSettings",
    "Protocol",
    "QueueSettings",
    "RedisSettings",
    "ReplicaSettings",
    "ReservationSettings",
    "ReserveSettings",
    "RouteSettings",
    "SentinelSettings",
    "Settings",
    "cut_short_problems",
    "load_settings",
    "read_config_text",
    "reload_problems",
    "settings_from_mapping",
    "settings_from_text",
    "summary",
    "ws_base",
]
