"""The configuration's models: field types, per-field checks and per-model rules.

:class:`Settings` is the root. Checks that span several parts of the file (names unique,
references to pools, replicas and GPUs defined) live in :mod:`proxy.settings.references`;
reading files and the environment in :mod:`proxy.settings.loading`.

All models are frozen and hashable, so a reload can compare old and new settings.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.errors import FallbackHint
from proxy.metering.base import MAX_TOKENS_PER_SECOND
from proxy.metering.table import (
    PROTOCOL_TABLE,
    Protocol,
    inner_protocols,
)
from proxy.settings.observability import MetricsSettings, Readiness, TracingSettings
from proxy.settings.references import (
    _gpu_problems,
    _pipeline_problems,
    _port_problems,
    _reconcile_problems,
    _reference_problems,
)
from proxy.settings_env import Loc, Problems, did_you_mean

_HASH_HOWTO = 'printf %s "$KEY" | sha256sum'


def _check_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise ValueError(f"must use only letters, digits, '_', '.' and '-' (got {value!r})")
    return value


def _check_sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        # Never echo the value: it may be the key itself, pasted by mistake.
        raise ValueError(
            f"must be 64 lowercase hex characters (got {len(value)} characters), the "
            f"SHA-256 of the key: {_HASH_HOWTO}"
        )
    return value


def _check_path(value: str) -> str:
    if not value.startswith("/") or any(c in value for c in "?# \t\r\n"):
        raise ValueError(f"must start with '/' and have no query or spaces (got {value!r})")
    return value


def _check_url(value: str, schemes: tuple[str, ...]) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"is not a valid URL ({exc}): {value!r}") from None
    if parts.scheme.lower() not in schemes:
        raise ValueError(f"must use {' or '.join(s + '://' for s in schemes)} (got {value!r})")
    if not parts.hostname:
        raise ValueError(f"must include a host (got {value!r})")
    if "?" in value or "#" in value or any(c.isspace() for c in value):
        raise ValueError(f"must have no query, fragment or spaces (got {value!r})")
    if parts.username is not None:
        raise ValueError("must not embed credentials")
    return urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/"), "", ""))


def _check_upstream_url(value: str) -> str:
    return _check_url(value, ("http", "https"))


def _check_hint_url(value: str) -> str:
    return _check_url(value, ("http", "https", "ws", "wss"))


Name = Annotated[str, AfterValidator(_check_name)]
Sha256 = Annotated[str, AfterValidator(_check_sha256)]
UrlPath = Annotated[str, AfterValidator(_check_path)]
Host = Annotated[str, Field(min_length=1)]
Port = Annotated[int, Field(ge=0, le=65535)]  # 0 = any free port (tests)
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
    )


class ListenSettings(_Frozen):
    """The client-facing listener."""

    host: Host = "0.0.0.0"
    port: Port = 8080


class AdminSettings(_Frozen):
    """The admin listener (metrics, health, drain). Off loopback it needs a key hash."""

    enabled: bool = True
    host: Host = "127.0.0.1"
    port: Port = 9901
    api_key_sha256: Sha256 | None = None

    @model_validator(mode="after")
    def _key_off_loopback(self) -> AdminSettings:
        if self.enabled and self.api_key_sha256 is None and not _is_loopback(self.host):
            why = (
                f"required when the admin listener is bound to {self.host} (not loopback): "
                f"set the SHA-256 of an admin key ({_HASH_HOWTO}) or bind admin.host "
                "to 127.0.0.1"
            )
            raise Problems([(("api_key_sha256",), why)])
        return self


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LimitsSettings(_Frozen):
    """Bounds on everything a client or upstream can make the proxy hold. 0 disables the
    idle timeout, the session cap and pings."""

    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_http_body_bytes: int = Field(25 * 1024 * 1024, ge=1024)
    # A control-plane request body (gang reservations, the admin listener, anything on
    # the client listener that is not a relay route): small enough that parsing it as
    # JSON on the event loop costs nothing a client could notice.
    max_control_body_bytes: int = Field(16 * 1024, ge=1024, le=1024 * 1024)
    # A request head (HTTP request or WebSocket upgrade) over either limit gets 431 before
    # anything else runs (auth, admission, upstream). 32 KiB holds the biggest real heads
    # (JWT bearers, SigV4 headers; nginx's default also tops out at 32 KiB) while 1,000
    # half-sent heads cost at most 32 MiB; 100 header lines is Apache's and CPython's cap.
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
    # write buffer (64 KiB high-water mark) plus one message.
    client_write_timeout_s: PositiveSeconds = 20


def _check_proxy(value: str) -> str:
    try:
        return ipaddress.ip_network(value.strip(), strict=True).compressed
    except ValueError as exc:
        raise ValueError(
            f"must be an IP address or network such as 10.0.0.0/8 (got {value!r}: {exc})"
        ) from None


class ForwardedSettings(_Frozen):
    """Which peers' forwarding headers Headroom believes. None by default: the TCP peer
    is the client. Headroom always appends the peer to the client's ``X-Forwarded-For``
    and ``Forwarded`` (once); from a trusted peer it also keeps the
    ``X-Forwarded-Proto`` and ``X-Real-IP`` the peer sent (proxy.relay.headers)."""

    trusted_proxies: tuple[Annotated[str, AfterValidator(_check_proxy)], ...] = ()


class MeterSettings(_Frozen):
    """Audio metering. ``chunk_durations_s`` become gap-histogram bucket edges (sorted)."""

    prebuffer_s: Seconds = 0.2
    window_s: PositiveSeconds = 30
    chunk_durations_s: tuple[PositiveSeconds, ...] = (0.02, 0.04, 0.08, 0.2, 2.0)

    @field_validator("chunk_durations_s")
    @classmethod
    def _sorted(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(sorted(set(value)))


class GuardSettings(_Frozen):
    """The per-replica delivery-ratio guard (``off`` | ``observe`` | ``enforce``)."""

    mode: Literal["off", "observe", "enforce"] = "observe"
    threshold: Annotated[float, Field(gt=0)] = 1.2  # worst-1% delivery ratio, x realtime
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


class HealthSettings(_Frozen):
    """Replica health. ``engine_metrics_interval_s`` 0 disables scraping replicas' /metrics."""

    recheck_interval_s: PositiveSeconds = 5
    engine_metrics_interval_s: Seconds = 0


class QueueSettings(_Frozen):
    """The pool's FIFO wait queue; ``max_depth`` 0 refuses at once when every slot is busy."""

    max_depth: int = Field(0, ge=0)
    max_wait_s: Seconds = 10


class FallbackSettings(_Frozen):
    """Where refused clients are pointed (the ``fallback`` of a rejection body)."""

    voice: str | None = None
    pool: Name | None = None
    url: Annotated[str, AfterValidator(_check_hint_url)] | None = None

    def as_hint(self) -> FallbackHint:
        return FallbackHint(voice=self.voice, pool=self.pool, url=self.url)


class ReplicaSettings(_Frozen):
    """One upstream endpoint (one GPU). ``url`` is an http(s) base without trailing slash;
    ``max_sessions`` is the hard concurrency cap (find it with ``headroom probe``)."""

    name: Name
    url: Annotated[str, AfterValidator(_check_upstream_url)]
    max_sessions: int = Field(ge=1)

    @property
    def ws_url(self) -> str:
        return ws_base(self.url)


class ReserveSettings(_Frozen):
    """Slots of a pool only sessions of class ``priority`` or higher may take:
    ``slots`` over the whole pool, or ``per_replica`` on each replica that takes sessions
    (healthy, not guard-held). The classes below see a pool that many slots smaller."""

    priority: int = Field(ge=-1000, le=1000)
    slots: int = Field(0, ge=0)
    per_replica: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _one_amount(self) -> ReserveSettings:
        if (self.slots > 0) == (self.per_replica > 0):
            raise Problems([((), "give exactly one of slots or per_replica, above 0")])
        return self


class PoolSettings(_Frozen):
    """Replicas serving the same model, with one gate and queue."""

    name: Name
    replicas: tuple[ReplicaSettings, ...] = Field(min_length=1)
    queue: QueueSettings = QueueSettings()
    fallback: FallbackSettings | None = None
    session_estimate_s: PositiveSeconds = 20  # seeds Retry-After before any session ended
    reserve: tuple[ReserveSettings, ...] = ()
    # Streams the engine runs that Headroom did not admit take slots off the caps
    # (proxy/admission/reconcile.py); needs health.engine_metrics_interval_s > 0.
    engine_reconcile: bool = False
    engine_reconcile_hold_s: PositiveSeconds = 30  # a reduction not confirmed lapses

    @model_validator(mode="after")
    def _reserve_fits(self) -> PoolSettings:
        problems: list[tuple[Loc, str]] = []
        seen: set[int] = set()
        for i, r in enumerate(self.reserve):
            if r.priority in seen:
                problems.append((("reserve", i, "priority"), f"{r.priority} is reserved twice"))
            seen.add(r.priority)
        kept = sum(r.slots + r.per_replica * len(self.replicas) for r in self.reserve)
        if self.reserve and kept >= self.total_slots:
            why = (
                f"keeps {kept} of the pool's {self.total_slots} slots; the lowest class "
                "would never be admitted"
            )
            problems.append((("reserve",), why))
        for i, r in enumerate(self.reserve):
            small = [x.name for x in self.replicas if x.max_sessions <= r.per_replica]
            if r.per_replica and small:
                why = f"{r.per_replica} per replica leaves no slot on {', '.join(small)}"
                problems.append((("reserve", i, "per_replica"), why))
        if problems:
            raise Problems(problems)
        return self

    @field_validator("fallback")
    @classmethod
    def _empty_fallback(cls, value: FallbackSettings | None) -> FallbackSettings | None:
        return value if value and (value.voice or value.pool or value.url) else None

    @property
    def total_slots(self) -> int:
        return sum(replica.max_sessions for replica in self.replicas)


class AudioSettings(_Frozen):
    """The route's default PCM format, used to convert bytes to seconds of audio."""

    sample_rate: int = Field(24000, ge=8000, le=192000)
    channels: int = Field(1, ge=1, le=8)
    sample_width: int = Field(2, ge=1, le=4)

    @property
    def bytes_per_second(self) -> int:
        return self.sample_rate * self.channels * self.sample_width


class RouteSettings(_Frozen):
    """A client-facing path bound to a pool and a protocol.

    ``refusal: close`` (accept, send one error event, close 1013) and ``queue_feedback``
    need a WebSocket protocol; ``inner_protocol`` is required for, and only for, a
    protocol that carries another (``sagemaker-bidi``); ``tokens_per_audio_second`` is
    required for, and only for, a protocol that counts generated tokens as audio
    (``openai-completions-tokens``); ``upstream_path`` relays to a different upstream
    path. What each protocol is: :mod:`proxy.metering.table`.
    """

    path: UrlPath
    pool: str
    protocol: Protocol
    refusal: Literal["http", "close"] = "http"
    inner_protocol: Protocol | None = None
    queue_feedback: bool = False
    audio: AudioSettings = AudioSettings()
    tokens_per_audio_second: float | None = Field(None, gt=0, le=MAX_TOKENS_PER_SECOND)
    upstream_path: UrlPath | None = None

    @property
    def is_websocket(self) -> bool:
        return PROTOCOL_TABLE[self.protocol].transport == "ws"

    @property
    def stream_protocol(self) -> str:
        """The protocol whose events carry the audio: ``inner_protocol`` when set."""
        return self.inner_protocol or self.protocol

    @property
    def relay_path(self) -> str:
        """The upstream path requests are relayed to."""
        return self.upstream_path or self.path

    @model_validator(mode="after")
    def _protocol_rules(self) -> RouteSettings:
        problems: list[tuple[Loc, str]] = []
        http = f"{self.protocol} is HTTP"
        if self.refusal == "close" and not self.is_websocket:
            why = f"'close' needs a WebSocket protocol; {http}, so use refusal: http"
            problems.append((("refusal",), why))
        if self.queue_feedback and not self.is_websocket:
            problems.append((("queue_feedback",), f"needs a WebSocket protocol; {http}"))
        inner = ", ".join(inner_protocols())
        carriers = [n for n, spec in PROTOCOL_TABLE.items() if spec.carries_inner]
        carries = PROTOCOL_TABLE[self.protocol].carries_inner
        carried = PROTOCOL_TABLE[self.inner_protocol] if self.inner_protocol else None
        if carries and carried is None:
            why = f"required for {self.protocol} (the protocol inside the stream): {inner}"
            problems.append((("inner_protocol",), why))
        elif not carries and carried is not None:
            why = f"only valid with protocol {' or '.join(carriers)}"
            problems.append((("inner_protocol",), why))
        elif carried is not None and not carried.carriable:
            why = f"must be one of: {inner} (got {self.inner_protocol!r})"
            problems.append((("inner_protocol",), why))
        counts = [n for n, spec in PROTOCOL_TABLE.items() if spec.counts_tokens]
        if PROTOCOL_TABLE[self.protocol].counts_tokens:
            if self.tokens_per_audio_second is None:
                why = (f"required for {self.protocol}: how many generated tokens make one "
                       "second of audio (Orpheus's: docs/protocols.md)")  # fmt: skip
                problems.append((("tokens_per_audio_second",), why))
        elif self.tokens_per_audio_second is not None:
            why = f"only valid with protocol {' or '.join(counts)}"
            problems.append((("tokens_per_audio_second",), why))
        if problems:
            raise Problems(problems)
        return self


class ApiKeySettings(_Frozen):
    """One tenant's key, stored as its SHA-256. ``pools`` empty = every pool;
    ``max_sessions`` caps the tenant's concurrent sessions (429 ``tenant_limit``).

    Scheduling (README "Tenants and priorities"): ``priority`` is the key's
    class (higher first; negative: sheddable), ``weight`` its share of session-seconds
    within the class (unset: the key shares its class's plain FIFO), ``max_queued`` its
    waiters in one pool's queue (429 ``tenant_limit`` past it). A key without them behaves
    as before."""

    name: Name
    sha256: Sha256
    pools: tuple[str, ...] = ()
    max_sessions: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-1000, le=1000)
    weight: float | None = Field(None, gt=0, le=1000)
    max_queued: int | None = Field(None, ge=0)

    @property
    def schedules(self) -> bool:
        """Whether the key sets any of the scheduling fields."""
        return self.priority != 0 or self.weight is not None or self.max_queued is not None

    def allows(self, pool: str) -> bool:
        return not self.pools or pool in self.pools


class AuthSettings(_Frozen):
    """Client API keys; when present, every request needs one.

    ``enabled: false`` turns client authentication off *explicitly* (the keys, if any, are
    kept but not checked). A reload may turn authentication off only this way: a file that
    merely lacks ``auth`` -- which is also what a file cut short by a partial write looks
    like -- is refused while authentication is on (:func:`reload_problems`)."""

    enabled: bool = True
    keys: tuple[ApiKeySettings, ...] = ()

    @model_validator(mode="after")
    def _keys_when_enabled(self) -> AuthSettings:
        if self.enabled and not self.keys:
            why = (
                "needs at least 1 key; to turn client authentication off on purpose, "
                "write auth: {enabled: false}"
            )
            raise Problems([(("keys",), why)])
        return self

    def key_for(self, sha256_hex: str) -> ApiKeySettings | None:
        return next((key for key in self.keys if key.sha256 == sha256_hex), None)


def _check_redis_url(value: str) -> str:
    # Never echo the URL: it may carry the Redis password.
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        raise ValueError("is not a valid URL") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must use redis://, rediss:// (TLS) or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("must include a host")
    return value


def _check_sentinel_node(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be host:port (e.g. sentinel-0:26379)")
    return value


class SentinelSettings(_Frozen):
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


class RedisSettings(_Frozen):
    """The shared admission store (``admission.backend: redis``). TLS (``rediss://``)
    and AUTH (``redis://:password@host``) come with the URL; with ``sentinel``, the
    primary is found through Redis Sentinel."""

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
        return self


class AdmissionSettings(_Frozen):
    """Where caps and queues live. ``memory`` (default): in this process. ``redis``:
    shared by every gateway on the same Redis (one cap per replica over all of them).

    ``on_backend_loss`` says what a gateway does with its running sessions once it can
    no longer prove its leases (renewals failing for lease_ttl_s - fence_margin_s):
    ``close`` them (1012; the caps hold, the default) or ``keep`` them (no session is
    cut, but other gateways reuse those slots: replicas may run over their caps)."""

    backend: Literal["memory", "redis"] = "memory"
    redis: RedisSettings = RedisSettings()
    on_backend_loss: Literal["close", "keep"] = "close"


class ReservationSettings(_Frozen):
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


# -- co-location: replicas sharing one GPU ----------------------------------------------
# Optional. Read only by ``headroom check`` (proxy.colocation): the gateway routes the same
# with or without it. Cross-references (replicas exist, each on one GPU) are checked in
# proxy.settings.references (_gpu_problems), with the other cross-references.


def _check_replica_ref(value: str) -> str:
    pool, sep, replica = value.partition("/")
    if (
        not sep
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", pool)
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", replica)
    ):
        raise ValueError(f"must be 'pool/replica', e.g. 'tts-main/gpu0' (got {value!r})")
    return value


def _check_preset(value: str) -> str:
    from proxy.sim.presets import PRESETS  # the simulator's figures; imported only when named

    if value not in PRESETS:
        raise ValueError(
            f"unknown preset {value!r}{did_you_mean(value, list(PRESETS))}; presets: "
            + ", ".join(PRESETS)
        )
    return value


class GpuEngineSettings(_Frozen):
    """One engine (a replica) on a shared GPU: its ``gpu_memory_utilization`` (vLLM's
    ``--gpu-memory-utilization``, a share of the whole GPU's memory) and where the KV
    cache figures come from: a simulator ``preset`` and/or measured ``weights_gb``,
    ``activations_gb`` and ``kv_bytes_per_session`` (measured figures win). GB = 1e9
    bytes. ``session_s`` (default 20) is the audio a session holds in KV when the
    per-session figure comes from the preset."""

    replica: Annotated[str, AfterValidator(_check_replica_ref)]
    gpu_memory_utilization: float = Field(gt=0, le=1)
    preset: Annotated[str, AfterValidator(_check_preset)] | None = None
    weights_gb: float | None = Field(None, gt=0)
    activations_gb: float | None = Field(None, ge=0)
    kv_bytes_per_session: float | None = Field(None, gt=0)
    session_s: PositiveSeconds | None = None

    @model_validator(mode="after")
    def _session_source(self) -> GpuEngineSettings:
        if self.session_s is not None and self.kv_bytes_per_session is not None:
            why = "has no effect with kv_bytes_per_session (a measured figure); drop one"
            raise Problems([(("session_s",), why)])
        if self.session_s is not None and self.preset is None:
            why = "needs a preset (it sizes the preset's per-session KV figure)"
            raise Problems([(("session_s",), why)])
        return self

    @property
    def pool(self) -> str:
        return self.replica.partition("/")[0]

    @property
    def replica_name(self) -> str:
        return self.replica.partition("/")[2]


class GpuSettings(_Frozen):
    """A physical GPU shared by the engines listed (co-location). ``memory_gb`` defaults
    to the memory of the presets' GPU when the engines name presets."""

    name: Name
    memory_gb: float | None = Field(None, gt=0)
    engines: tuple[GpuEngineSettings, ...] = Field(min_length=1)


class PipelineSettings(_Frozen):
    """A named chain of pools one call uses together (a voice agent's ASR and TTS stages,
    say). Headroom reports which stage has the least headroom left (the limiting stage):
    metrics, ``GET /admin/status``. Admission is unchanged."""

    name: Name
    stages: tuple[str, ...] = Field(min_length=1)


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


def ws_base(http_url: str) -> str:
    """The WebSocket form of an http(s) base URL: http -> ws, https -> wss."""
    scheme, sep, rest = http_url.partition("://")
    ws = {"http": "ws", "https": "wss"}.get(scheme.lower())
    if not sep or ws is None:
        raise ValueError(f"not an http(s) URL: {http_url!r}")
    return f"{ws}://{rest}"
