"""The root of the configuration: :class:`Settings`, one frozen model holding every section.

The sections' models live by concern: :mod:`~proxy.settings.gateway` (listeners, limits,
metering, guard, health), :mod:`~proxy.settings.topology` (pools, replicas, routes,
pipelines), :mod:`~proxy.settings.auth` (client keys), :mod:`~proxy.settings.admission`
(the admission store, reservations), :mod:`~proxy.settings.gpus` (co-location) and
:mod:`~proxy.settings.observability`; their shared field types in
:mod:`~proxy.settings.fields`. Checks that span several parts of the file (names unique,
references to pools, replicas and GPUs defined) live in :mod:`proxy.settings.references`;
reading files and the environment in :mod:`proxy.settings.loading`.

All models are frozen and hashable, so a reload can compare old and new settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.settings.admission import AdmissionSettings, ReservationSettings
from proxy.settings.auth import AuthSettings
from proxy.settings.environment import Problems
from proxy.settings.fields import PositiveSeconds
from proxy.settings.gateway import (
    AdminSettings,
    ForwardedSettings,
    GuardSettings,
    HealthSettings,
    LimitsSettings,
    ListenSettings,
    MeterSettings,
)
from proxy.settings.gpus import GpuSettings
from proxy.settings.observability import MetricsSettings, Readiness, TracingSettings
from proxy.settings.references import (
    _gpu_problems,
    _pipeline_problems,
    _port_problems,
    _reconcile_problems,
    _reference_problems,
)
from proxy.settings.topology import PipelineSettings, PoolSettings, RouteSettings

__all__ = ["Settings"]


class Settings(BaseModel):
    """Everything Headroom reads from the outside world, validated and frozen.

    Build it with :func:`load_settings` or :func:`settings_from_mapping`, which apply the
    environment over the file's data before validating it. Constructing or validating it
    directly reads no environment, and invalid values then raise pydantic's
    ValidationError rather than ConfigError.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        coerce_numbers_to_str=True,
        allow_inf_nan=False,
        validate_default=True,
    )

    listen: ListenSettings = ListenSettings()
    admin: AdminSettings = AdminSettings()
    drain_timeout_s: PositiveSeconds = 30
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    limits: LimitsSettings = LimitsSettings()
    forwarded: ForwardedSettings = ForwardedSettings()
    meter: MeterSettings = MeterSettings()
    guard: GuardSettings = GuardSettings()
    health: HealthSettings = HealthSettings()
    admission: AdmissionSettings = AdmissionSettings()
    reservations: ReservationSettings = ReservationSettings()
    pools: tuple[PoolSettings, ...] = Field(min_length=1)
    routes: tuple[RouteSettings, ...] = Field(min_length=1)
    auth: AuthSettings | None = None
    gpus: tuple[GpuSettings, ...] = ()  # co-location, read by `headroom check`
    # stages whose headroom is compared, limiting stage reported (proxy.pool_headroom)
    pipelines: tuple[PipelineSettings, ...] = ()
    readiness: Readiness = "upstream"
    tracing: TracingSettings = TracingSettings()
    metrics: MetricsSettings = MetricsSettings()
    # The file says ``auth: {enabled: false}`` (``auth`` is then None); see auth_disabled.
    _auth_disabled: bool = PrivateAttr(False)

    @field_validator("auth")
    @classmethod
    def _auth_off(cls, value: AuthSettings | None) -> AuthSettings | None:
        # Everything that enforces auth reads ``settings.auth is None`` as "off".
        return value if value is None or value.enabled else None

    @property
    def auth_disabled(self) -> bool:
        """True when client authentication is off because the configuration says so
        (``auth: {enabled: false}``), not merely because ``auth`` is absent."""
        return self._auth_disabled

    @model_validator(mode="wrap")
    @classmethod
    def _check_across(cls, data: Any, handler: ModelWrapValidatorHandler[Settings]) -> Settings:
        # Cross-references are checked on the raw data so they are reported together with
        # field errors, not only once every field is valid.
        problems = _reference_problems(data) + _gpu_problems(data)
        problems += _pipeline_problems(data)
        try:
            settings = handler(data)
        except ValidationError as exc:
            if problems:
                raise Problems(problems, prior=exc.errors()) from None
            raise
        problems += _port_problems(settings) + _reconcile_problems(settings)
        if problems:
            raise Problems(problems)
        raw_auth = data.get("auth") if isinstance(data, Mapping) else None
        # A mapping that validated yet left no AuthSettings said ``enabled: false``.
        settings._auth_disabled = raw_auth is not None and settings.auth is None
        return settings

    @property
    def total_slots(self) -> int:
        return sum(pool.total_slots for pool in self.pools)

    def pool(self, name: str) -> PoolSettings:
        """The pool called ``name``; KeyError if there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"unknown pool {name!r}")

    def route_for_path(self, path: str) -> RouteSettings | None:
        """The route whose path equals ``path`` (any query string ignored), or None."""
        path = path.split("?", 1)[0]
        return next((route for route in self.routes if route.path == path), None)

    def warnings(self) -> list[str]:
        """Legal but probably unintended choices, for ``headroom check`` and start-up logs."""
        used = {route.pool for route in self.routes}
        used |= {p.fallback.pool for p in self.pools if p.fallback and p.fallback.pool}
        out = [
            f"pool {p.name!r} is used by no route and is no pool's fallback"
            for p in self.pools
            if p.name not in used
        ]
        out += [
            f"route {r.path}: queue_feedback has no effect, pool {r.pool!r} has no queue"
            for r in self.routes
            if r.queue_feedback and self.pool(r.pool).queue.max_depth == 0
        ]
        if self.limits.upstream_connect_timeout_s > self.limits.handshake_timeout_s:
            out.append(
                "limits.upstream_connect_timeout_s exceeds limits.handshake_timeout_s, "
                "which bounds the whole handshake including the upstream connect"
            )
        return out
