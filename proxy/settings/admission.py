"""The models of where admission state lives: this process's memory or a Redis store
shared by every gateway (found directly or through Redis Sentinel), and the bounds on
gang reservations."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from proxy.admission.redis_clients import CLUSTER_SCHEMES, cluster_nodes
from proxy.settings.environment import Problems
from proxy.settings.fields import Frozen, PositiveSeconds

__all__ = [
    "AdmissionSettings",
    "RedisSettings",
    "ReservationSettings",
    "SentinelSettings",
]


def _check_redis_url(value: str) -> str:
    # Never echo the URL: it may carry the Redis password.
    if cluster_nodes(value) is not None:  # raises ValueError with the reason
        return value
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise ValueError("is not a valid URL") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            "must use redis://, rediss:// (TLS), unix://, or redis+cluster:// "
            "(rediss+cluster:// for TLS) for a Redis Cluster"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("must include a host")
    return value


def _check_sentinel_node(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be host:port (e.g. sentinel-0:26379)")
    return value


class SentinelSettings(Frozen):
    """Redis Sentinel (docs/shared-admission.md, "Redis Sentinel"): the gateway asks
    ``nodes`` which server is the primary of ``master`` now, and asks again when a
    connection fails, so a failover moves it to the promoted replica. The data nodes'
    password, database and TLS come from ``admission.redis.url`` (its host is not
    used); ``password`` is the sentinels' own, if they require one."""

    master: Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s]+$")]
    nodes: Annotated[
        list[Annotated[str, AfterValidator(_check_sentinel_node)]],
        Field(min_length=1, max_length=16),
    ]
    password: Annotated[str | None, Field(repr=False)] = None


class RedisSettings(Frozen):
    """The shared admission store (``admission.backend: redis``). TLS (``rediss://``)
    and AUTH (``redis://:password@host``) come with the URL; with ``sentinel``, the
    primary is found through Redis Sentinel; a ``redis+cluster://host:port,...`` URL
    names seed nodes of a Redis Cluster (each pool's keys on the shard of its slot)."""

    url: Annotated[str, AfterValidator(_check_redis_url), Field(repr=False)] = (
        "redis://127.0.0.1:6379/0"
    )
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]*$")] = "headroom:"
    lease_ttl_s: Annotated[float, Field(ge=1, le=300)] = 10.0
    renew_interval_s: PositiveSeconds = 2.0
    fence_margin_s: PositiveSeconds = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=30)] = 1.0
    sentinel: SentinelSettings | None = None

    @model_validator(mode="after")
    def _renew_before_fence(self) -> RedisSettings:
        if self.renew_interval_s * 2 > self.lease_ttl_s - self.fence_margin_s:
            why = (
                f"must leave room for two renewals before the fence: renew_interval_s x 2 "
                f"<= lease_ttl_s - fence_margin_s (got {self.renew_interval_s:g} x 2 > "
                f"{self.lease_ttl_s:g} - {self.fence_margin_s:g})"
            )
            raise Problems([(("renew_interval_s",), why)])
        if self.timeout_s >= self.renew_interval_s:
            why = f"must be below renew_interval_s ({self.renew_interval_s:g})"
            raise Problems([(("timeout_s",), why)])
        if self.sentinel is not None and self.url.startswith("unix:"):
            why = "a unix:// socket cannot be used with sentinel: use redis:// or rediss://"
            raise Problems([(("url",), why)])
        if self.sentinel is not None and self.url.split("://")[0] in CLUSTER_SCHEMES:
            why = "a Redis Cluster (redis+cluster://) is not found through sentinel: drop one"
            raise Problems([(("sentinel",), why)])
        return self


class AdmissionSettings(Frozen):
    """Where caps and queues live. ``memory`` (default): in this process. ``redis``:
    shared by every gateway on the same Redis (one cap per replica over all of them).

    ``on_backend_loss`` says what a gateway does with its running sessions once it can
    no longer prove its leases (renewals failing for lease_ttl_s - fence_margin_s):
    ``close`` them (1012; the caps hold, the default) or ``keep`` them (no session is
    cut, but other gateways reuse those slots: replicas may run over their caps)."""

    backend: Literal["memory", "redis"] = "memory"
    redis: RedisSettings = RedisSettings()
    on_backend_loss: Literal["close", "keep"] = "close"


class ReservationSettings(Frozen):
    """Gang reservations (docs/voice-agents.md): how long a client may hold slots
    unused (``max_hold_s``; ``default_hold_s`` when the request names none) and how many
    reservations with unclaimed slots one API key may hold at once (``max_per_key``;
    past it, 429 ``tenant_limit``; without authentication there are no keys to bound).
    Reserved slots also count against the key's ``max_sessions``. Live on reload (new
    reservations)."""

    max_hold_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    default_hold_s: PositiveSeconds = 5.0
    max_per_key: Annotated[int, Field(ge=1, le=10_000)] = 32

    @model_validator(mode="after")
    def _default_within_max(self) -> ReservationSettings:
        if self.default_hold_s > self.max_hold_s:
            why = f"must be <= max_hold_s ({self.max_hold_s:g})"
            raise Problems([(("default_hold_s",), why)])
        return self
