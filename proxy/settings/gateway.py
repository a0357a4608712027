"""The models of the gateway process's own behaviour: its listeners, the bounds on what
it holds, which forwarding headers it believes, audio metering, the delivery-ratio guard
and replica health checks."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from proxy.metering.rolling import DELIVERY_THRESHOLD
from proxy.settings.environment import Problems
from proxy.settings.fields import (
    HASH_HOWTO,
    Frozen,
    Host,
    Port,
    PositiveSeconds,
    Seconds,
    Sha256,
    is_loopback,
)

__all__ = [
    "AdminSettings",
    "ForwardedSettings",
    "GuardSettings",
    "HealthSettings",
    "LimitsSettings",
    "ListenSettings",
    "MeterSettings",
]


class ListenSettings(Frozen):
    """The client-facing listener."""

    host: Host = "0.0.0.0"
    port: Port = 8080


class AdminSettings(Frozen):
    """The admin listener (metrics, health, drain). Off loopback it needs a key hash."""

    enabled: bool = True
    host: Host = "127.0.0.1"
    port: Port = 9901
    api_key_sha256: Sha256 | None = None

    @model_validator(mode="after")
    def _key_off_loopback(self) -> AdminSettings:
        if self.enabled and self.api_key_sha256 is None and not is_loopback(self.host):
            why = (
                f"required when the admin listener is bound to {self.host} (not loopback): "
                f"set the SHA-256 of an admin key ({HASH_HOWTO}) or bind admin.host "
                "to 127.0.0.1"
            )
            raise Problems([(("api_key_sha256",), why)])
        return self


class LimitsSettings(Frozen):
    """Bounds on everything a client or upstream can make the proxy hold. 0 disables the
    idle timeout, the session cap and pings."""

    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_http_body_bytes: int = Field(25 * 1024 * 1024, ge=1024)
    # A control-plane request body (gang reservations, the admin listener, anything on
    # the client listener that is not a relay route): small enough that parsing it as
    # JSON on the event loop costs nothing a client could notice.
    max_control_body_bytes: int = Field(16 * 1024, ge=1024, le=1024 * 1024)
    # A request head (HTTP request or WebSocket upgrade) over either limit gets 431 before
    # anything else runs (auth, admission, upstream); docs/contracts.md says how the
    # defaults were chosen.
    max_head_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024)
    max_headers: int = Field(100, ge=1, le=10_000)
    # the request head (from accept, or the end of the previous response) + the client
    # request body (HTTP) + upstream connect and handshake
    handshake_timeout_s: PositiveSeconds = 10
    upstream_connect_timeout_s: PositiveSeconds = 5
    # An HTTP upstream must send its response head within this of the session's
    # admission (connect included), or the session ends with 504 and frees its slot.
    upstream_response_timeout_s: PositiveSeconds = 30
    idle_timeout_s: Seconds = 60  # no frames either way
    max_session_s: Seconds = 3600
    ping_interval_s: Seconds = 20  # keepalive pings on both legs
    ping_timeout_s: PositiveSeconds = 20
    # A client that accepts no data for this long (its socket buffer stays full) is
    # disconnected and its slot freed; memory per client stays bounded by the socket's
    # write buffer (up to its high-water mark) plus one message.
    client_write_timeout_s: PositiveSeconds = 20


def _check_proxy(value: str) -> str:
    try:
        return ipaddress.ip_network(value.strip(), strict=True).compressed
    except ValueError as exc:
        raise ValueError(
            f"must be an IP address or network such as 10.0.0.0/8 (got {value!r}: {exc})"
        ) from None


class ForwardedSettings(Frozen):
    """Which peers' forwarding headers Headroom believes. None by default: the TCP peer
    is the client. Headroom always appends the peer to the client's ``X-Forwarded-For``
    and ``Forwarded`` (once); from a trusted peer it also keeps the
    ``X-Forwarded-Proto`` and ``X-Real-IP`` the peer sent (proxy.relay.headers)."""

    trusted_proxies: tuple[Annotated[str, AfterValidator(_check_proxy)], ...] = ()


class MeterSettings(Frozen):
    """Audio metering. ``chunk_durations_s`` become gap-histogram bucket edges (sorted)."""

    prebuffer_s: Seconds = 0.2
    window_s: PositiveSeconds = 30
    chunk_durations_s: tuple[PositiveSeconds, ...] = (0.02, 0.04, 0.08, 0.2, 2.0)

    @field_validator("chunk_durations_s")
    @classmethod
    def _sorted(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(sorted(set(value)))


class GuardSettings(Frozen):
    """The per-replica delivery-ratio guard (``off`` | ``observe`` | ``enforce``)."""

    mode: Literal["off", "observe", "enforce"] = "observe"
    threshold: Annotated[float, Field(gt=0)] = DELIVERY_THRESHOLD  # worst-hundredth, x realtime
    hysteresis: Annotated[float, Field(ge=0)] = 0.1
    hold_s: Seconds = 10
    min_samples: int = Field(50, ge=1)
    # Start-up signals (proxy/admission/guard.py), off unless set: the share of first seams that
    # may stall, and the TTFA p99 limit in seconds, judged once the window holds
    # startup_min_streams first seams (first audios).
    startup_stall_share: Annotated[float, Field(ge=0, lt=1)] | None = None
    ttfa_p99_s: Annotated[float, Field(gt=0)] | None = None
    startup_min_streams: int = Field(10, ge=1)

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false


class HealthSettings(Frozen):
    """Replica health. ``engine_metrics_interval_s`` 0 disables scraping replicas' /metrics."""

    recheck_interval_s: PositiveSeconds = 5
    engine_metrics_interval_s: Seconds = 0
