"""The validated configuration: one frozen :class:`Settings`, the only reader of files/env.

Sources, highest priority first: ``HEADROOM_*`` environment variables (rules in
:mod:`proxy.settings_env`), then one YAML file (``headroom serve --config FILE`` or
``HEADROOM_CONFIG``), then the defaults declared here.

Every failure -- a missing or unreadable file, YAML syntax (with line and column), a
top level that is not a mapping, a bad environment variable, and every validation problem
-- is one :class:`~proxy.errors.ConfigError` listing all problems at once as
``(field path, reason)``, e.g. ``("pools[0].replicas[1].max_sessions", "must be >= 1
(got 0)")``. Unknown keys are errors, with a "did you mean" where a name is close; so
is a key repeated in one mapping (:mod:`proxy.strict_yaml`), in the file or in a
variable's YAML value.

All models are frozen and hashable, so a reload can compare old and new settings.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
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
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy import strict_yaml
from proxy.errors import ConfigError, FallbackHint
from proxy.settings_env import (
    CONFIG_VAR,
    LOAD_CONTEXT,
    EnvOverlaySource,
    LoadContext,
    Loc,
    Problems,
    did_you_mean,
    explain,
    format_loc,
)

__all__ = [
    "HTTP_PROTOCOLS",
    "WS_PROTOCOLS",
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
    "RouteSettings",
    "Settings",
    "load_settings",
    "reload_problems",
    "settings_from_mapping",
    "summary",
    "ws_base",
]

Protocol = Literal[
    "vllm-realtime",
    "openai-realtime",
    "vllm-omni-speech-ws",
    "openai-speech-http",
    "openai-transcription-sse",
    "sagemaker-bidi",
    "passthrough-ws",
    "passthrough-http",
]
#: Protocols relayed as WebSockets (a replica's http(s) URL is used in its ws(s) form).
WS_PROTOCOLS = frozenset(
    {"vllm-realtime", "openai-realtime", "vllm-omni-speech-ws", "sagemaker-bidi", "passthrough-ws"}
)
#: Protocols relayed as (streaming) HTTP requests.
HTTP_PROTOCOLS = frozenset({"openai-speech-http", "openai-transcription-sse", "passthrough-http"})

_FILE = "<file>"
_TOP = "<top level>"
_MAX_PROBLEMS = 50  # an aliased YAML list can multiply one mistake thousands of times
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
    (once); from a trusted peer it also keeps the ``X-Forwarded-Proto`` the peer sent."""

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
    # Start-up signals (proxy/guard.py), off unless set: the share of first seams that
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
    """Slots of a pool only sessions of class ``priority`` or higher may take (issue 18):
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
    need a WebSocket protocol; ``inner_protocol`` is required for, and only for,
    ``sagemaker-bidi``; ``upstream_path`` relays to a different upstream path.
    """

    path: UrlPath
    pool: str
    protocol: Protocol
    refusal: Literal["http", "close"] = "http"
    inner_protocol: Protocol | None = None
    queue_feedback: bool = False
    audio: AudioSettings = AudioSettings()
    upstream_path: UrlPath | None = None

    @property
    def is_websocket(self) -> bool:
        return self.protocol in WS_PROTOCOLS

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
        inner = ", ".join(sorted(WS_PROTOCOLS - {"sagemaker-bidi"}))
        if self.protocol == "sagemaker-bidi" and self.inner_protocol is None:
            why = f"required for sagemaker-bidi (the protocol inside the stream): {inner}"
            problems.append((("inner_protocol",), why))
        elif self.protocol != "sagemaker-bidi" and self.inner_protocol is not None:
            problems.append((("inner_protocol",), "only valid with protocol sagemaker-bidi"))
        elif self.inner_protocol in HTTP_PROTOCOLS | {"sagemaker-bidi"}:
            why = f"must be one of: {inner} (got {self.inner_protocol!r})"
            problems.append((("inner_protocol",), why))
        if problems:
            raise Problems(problems)
        return self


class ApiKeySettings(_Frozen):
    """One tenant's key, stored as its SHA-256. ``pools`` empty = every pool;
    ``max_sessions`` caps the tenant's concurrent sessions (429 ``tenant_limit``).

    Scheduling (issue 18, README "Tenants and priorities"): ``priority`` is the key's
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


class RedisSettings(_Frozen):
    """The shared admission store (``admission.backend: redis``). TLS (``rediss://``)
    and AUTH (``redis://:password@host``) come with the URL."""

    url: Annotated[str, AfterValidator(_check_redis_url), Field(repr=False)] = (
        "redis://127.0.0.1:6379/0"
    )
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]*$")] = "headroom:"
    lease_ttl_s: Annotated[float, Field(ge=1, le=300)] = 10.0
    renew_interval_s: PositiveSeconds = 2.0
    fence_margin_s: PositiveSeconds = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=30)] = 1.0

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


# -- co-location: replicas sharing one GPU (issue 19) ----------------------------------
# Optional. Read only by ``headroom check`` (proxy.colocation): the gateway routes the same
# with or without it. Cross-references (replicas exist, each on one GPU) are checked in
# _gpu_problems below, with the other cross-references.


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


def _gpu_problems(data: Any) -> list[tuple[Loc, str]]:
    """GPU names unique, every engine's replica defined, each replica on one GPU only;
    on raw data like :func:`_reference_problems`; never raises."""
    if not isinstance(data, Mapping):
        return []
    gpus = _entries(data.get("gpus"))
    problems = _duplicates(
        [(("gpus", i, "name"), _text(g.get("name"))) for i, g in gpus], "GPU name"
    )
    defined: set[str] = set()
    for pool in (p for _, p in _entries(data.get("pools"))):
        pname = _text(pool.get("name"))
        defined |= {f"{pname}/{_text(r.get('name'))}" for _, r in _entries(pool.get("replicas"))}
    refs: list[tuple[Loc, str | None]] = []
    for i, gpu in gpus:
        for j, engine in _entries(gpu.get("engines")):
            loc: Loc = ("gpus", i, "engines", j, "replica")
            ref = _text(engine.get("replica"))
            refs.append((loc, ref))
            if ref is not None and "/" in ref and ref not in defined:
                known = ", ".join(sorted(defined)) or "(none)"
                problems.append((loc, f"unknown replica {ref!r}; defined replicas: {known}"))
    problems += _duplicates(refs, "replica (an engine runs on one GPU)")
    return problems


class PipelineSettings(_Frozen):
    """A named chain of pools one call uses together (a voice agent's ASR and TTS stages,
    say). Headroom reports which stage has the least headroom left (the limiting stage):
    metrics, ``GET /admin/status``. Admission is unchanged."""

    name: Name
    stages: tuple[str, ...] = Field(min_length=1)


def _pipeline_problems(data: Any) -> list[tuple[Loc, str]]:
    """Pipeline names unique, every stage a defined pool and listed once; on raw data
    like :func:`_reference_problems`; never raises."""
    if not isinstance(data, Mapping):
        return []
    pipelines = _entries(data.get("pipelines"))
    problems = _duplicates(
        [(("pipelines", i, "name"), _text(p.get("name"))) for i, p in pipelines],
        "pipeline name",
    )
    pools = [_text(p.get("name")) for _, p in _entries(data.get("pools"))]
    names = [name for name in dict.fromkeys(pools) if name is not None]
    defined = ", ".join(names) or "(none)"
    for i, pipeline in pipelines:
        stages = pipeline.get("stages")
        entries = list(enumerate(stages)) if isinstance(stages, list | tuple) else []
        locs = [(("pipelines", i, "stages", j), _text(stage)) for j, stage in entries]
        problems += _duplicates(locs, "stage")
        for loc, stage in locs:
            if stage is not None and stage not in names:
                problems.append((loc, f"unknown pool {stage!r}; defined pools: {defined}"))
    return problems


class Settings(BaseSettings):
    """Everything Headroom reads from the outside world, validated and frozen.

    Build it with :func:`load_settings` or :func:`settings_from_mapping`. Constructing it
    directly also applies ``os.environ``, but invalid values then raise pydantic's
    ValidationError rather than ConfigError.
    """

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        coerce_numbers_to_str=True,
        allow_inf_nan=False,
        env_prefix="HEADROOM_",
        env_nested_delimiter="__",
        case_sensitive=False,
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
    pools: tuple[PoolSettings, ...] = Field(min_length=1)
    routes: tuple[RouteSettings, ...] = Field(min_length=1)
    auth: AuthSettings | None = None
    gpus: tuple[GpuSettings, ...] = ()  # co-location, read by `headroom check` (issue 19)
    # stages whose headroom is compared, limiting stage reported (issue 19)
    pipelines: tuple[PipelineSettings, ...] = ()
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

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Environment (with list indices) over the file's data; no dotenv or secrets dir."""
        base = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        return EnvOverlaySource(settings_cls, base), init_settings

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
        problems += settings._port_problems() + settings._tenant_problems()
        if problems:
            raise Problems(problems)
        raw_auth = data.get("auth") if isinstance(data, Mapping) else None
        # A mapping that validated yet left no AuthSettings said ``enabled: false``.
        settings._auth_disabled = raw_auth is not None and settings.auth is None
        return settings

    def _tenant_problems(self) -> list[tuple[Loc, str]]:
        """Priority classes, weights and reserves are decided by the in-process core;
        the shared (Redis) backend does not apply them yet, so it refuses them rather
        than ignore them."""
        if self.admission.backend != "redis":
            return []
        why = "not supported with admission.backend: redis yet (README 'Tenants and priorities')"
        out: list[tuple[Loc, str]] = [
            (("pools", i, "reserve"), why) for i, p in enumerate(self.pools) if p.reserve
        ]
        if self.auth is not None:
            for i, key in enumerate(self.auth.keys):
                for field in ("priority", "weight", "max_queued"):
                    if field in key.model_fields_set:
                        out.append((("auth", "keys", i, field), why))
        return out

    def _port_problems(self) -> list[tuple[Loc, str]]:
        listen, admin = self.listen, self.admin
        wildcard = {"0.0.0.0", "::"}
        overlap = listen.host == admin.host or bool({listen.host, admin.host} & wildcard)
        if admin.enabled and admin.port and admin.port == listen.port and overlap:
            return [(("admin", "port"), f"clashes with listen.port {listen.port}")]
        return []

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


def _entries(value: Any) -> list[tuple[int, Mapping[Any, Any]]]:
    items = value if isinstance(value, list | tuple) else ()
    return [(i, item) for i, item in enumerate(items) if isinstance(item, Mapping)]


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _duplicates(
    entries: Iterable[tuple[Loc, str | None]], what: str, *, show: bool = True
) -> list[tuple[Loc, str]]:
    seen: dict[str, Loc] = {}
    problems = []
    for loc, value in entries:
        if value is None:
            continue
        if value in seen:
            shown = f" {value!r}" if show else ""
            problems.append((loc, f"duplicate {what}{shown} (also {format_loc(seen[value])})"))
        else:
            seen[value] = loc
    return problems


def _reference_problems(data: Any) -> list[tuple[Loc, str]]:
    """Uniqueness and cross-references, on raw (possibly invalid) data; never raises."""
    if not isinstance(data, Mapping):
        return []
    pools, routes = _entries(data.get("pools")), _entries(data.get("routes"))
    auth = data.get("auth")
    keys = _entries(auth.get("keys")) if isinstance(auth, Mapping) else []
    named = [(("pools", i, "name"), _text(p.get("name"))) for i, p in pools]
    problems = _duplicates(named, "pool name")
    names = list(dict.fromkeys(name for _, name in named if name is not None))
    defined = ", ".join(names) or "(none)"

    def check(loc: Loc, target: Any, own: str | None = None) -> None:
        if (name := _text(target)) is None:
            return
        if name == own:
            problems.append((loc, "must name another pool"))
        elif name not in names:
            problems.append((loc, f"unknown pool {name!r}; defined pools: {defined}"))

    for (loc, own), (i, pool) in zip(named, pools, strict=True):
        replicas = _entries(pool.get("replicas"))
        rnames = [((*loc[:2], "replicas", j, "name"), _text(r.get("name"))) for j, r in replicas]
        problems += _duplicates(rnames, "replica name")
        if isinstance(fallback := pool.get("fallback"), Mapping):
            check(("pools", i, "fallback", "pool"), fallback.get("pool"), own)
    problems += _duplicates(
        [(("routes", i, "path"), _text(r.get("path"))) for i, r in routes], "route path"
    )
    for i, route in routes:
        check(("routes", i, "pool"), route.get("pool"))
    problems += _duplicates(
        [(("auth", "keys", i, "name"), _text(k.get("name"))) for i, k in keys], "key name"
    )
    hashes = [(("auth", "keys", i, "sha256"), _text(k.get("sha256"))) for i, k in keys]
    problems += _duplicates(hashes, "key hash", show=False)
    for i, key in keys:
        allowed = key.get("pools")
        for j, target in enumerate(allowed if isinstance(allowed, list | tuple) else ()):
            check(("auth", "keys", i, "pools", j), target)
    return problems


def settings_from_mapping(
    data: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Settings:
    """Validate ``data`` (the shape of the YAML file) with ``env`` applied over it.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. ``source``
    names where ``data`` came from in error messages. Raises :class:`ConfigError` only.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            [(_TOP, f"must be a mapping of settings (got {type(data).__name__})")], source
        )
    fields = list(Settings.model_fields)
    # Unknown top-level keys are caught here: pydantic-settings would take `_env_file` & co.
    # as options rather than data.
    problems = [
        (_TOP, f"unknown key {key!r}{did_you_mean(str(key), fields)}")
        for key in data
        if not isinstance(key, str) or key not in fields
    ]
    known = {key: value for key, value in data.items() if isinstance(key, str) and key in fields}
    context = LoadContext(os.environ if env is None else env)
    token = LOAD_CONTEXT.set(context)
    try:
        settings = Settings(**known)
    except ValidationError as exc:
        problems += explain(exc.errors(), Settings, context.origins)
    except ConfigError as exc:  # an environment variable that cannot be applied
        problems += exc.problems
    finally:
        LOAD_CONTEXT.reset(token)
    if len(problems) > _MAX_PROBLEMS:
        hidden = len(problems) - _MAX_PROBLEMS
        problems = [*problems[:_MAX_PROBLEMS], ("...", f"{hidden} more problems not shown")]
    if problems:
        raise ConfigError(problems, source)
    return settings


def load_settings(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Settings:
    """Load the YAML file at ``path`` (default: ``$HEADROOM_CONFIG``), then apply ``env``.

    ``env`` defaults to ``os.environ``. Raises :class:`ConfigError` only.
    """
    environ = os.environ if env is None else env
    if path is None:
        path = next((v for k, v in environ.items() if k.upper() == CONFIG_VAR and v), None)
        if path is None:
            raise ConfigError(
                [(_FILE, f"no configuration file: pass --config FILE or set {CONFIG_VAR}")]
            )
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            [(_FILE, f"no such file: {source} (check --config / {CONFIG_VAR})")], source
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([(_FILE, f"not UTF-8 text (byte {exc.start})")], source) from None
    except OSError as exc:
        raise ConfigError(
            [(_FILE, f"cannot read {source}: {exc.strerror or exc}")], source
        ) from None
    return settings_from_mapping(_parse_yaml(text, source), env=environ, source=source)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        data = strict_yaml.load(text)
    except strict_yaml.DuplicateKeyError as exc:
        # A repeated key is an error, never "the last one wins": for a hard cap like
        # max_sessions the silently kept value could be ten times the measured ceiling.
        mark = exc.problem_mark
        assert mark is not None
        found = strict_yaml.key_path(text, mark.index)
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        loc = format_loc(found) if found else where
        reason = f"{exc.problem}" + (f" ({where})" if found else "")
        raise ConfigError([(loc, reason)], source) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else _FILE
        context = f" ({exc.context})" if exc.context and exc.problem else ""
        raise ConfigError(
            [(where, f"invalid YAML: {exc.problem or exc}{context}")], source
        ) from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ConfigError([(_FILE, f"invalid YAML: {exc}")], source) from None
    if data is None:
        raise ConfigError([(_TOP, "the file is empty; it needs at least pools and routes")], source)
    return data


def reload_problems(
    old: Settings, new: Settings, *, admin_bound: str | None = None
) -> list[tuple[str, str]]:
    """Why the valid configuration ``new`` must not replace the running ``old`` live, as
    ``(field path, reason)``; empty when the reload is safe.

    * Client authentication may be turned off only explicitly (``auth: {enabled:
      false}``): a file without ``auth`` is what a truncated write looks like.
    * ``admin_bound`` is the host the running admin listener is bound to (None: no admin
      listener). Addresses change only on restart, so while that host is not loopback the
      new configuration must keep an admin key: the key in force follows the bound socket,
      not the file.
    """
    problems: list[tuple[str, str]] = []
    if old.auth is not None and new.auth is None and not new.auth_disabled:
        problems.append((
            "auth",
            "missing, which would turn client authentication off; refused, the running "
            "configuration stays. A file cut short by a partial write looks the same: write "
            "the file to a temporary name and rename it. To turn authentication off on "
            "purpose, write auth: {enabled: false}",
        ))  # fmt: skip
    if admin_bound is not None and not _is_loopback(admin_bound) and not new.admin.api_key_sha256:
        problems.append((
            "admin.api_key_sha256",
            f"required: the admin listener stays bound to {admin_bound} until a restart, "
            "so a reload cannot remove its key (to drop the key, set admin.host: 127.0.0.1 "
            "and restart)",
        ))  # fmt: skip
    return problems


def ws_base(http_url: str) -> str:
    """The WebSocket form of an http(s) base URL: http -> ws, https -> wss."""
    scheme, sep, rest = http_url.partition("://")
    ws = {"http": "ws", "https": "wss"}.get(scheme.lower())
    if not sep or ws is None:
        raise ValueError(f"not an http(s) URL: {http_url!r}")
    return f"{ws}://{rest}"


def summary(settings: Settings) -> str:
    """A human-readable digest for ``headroom check`` (warnings are listed separately)."""
    admin, guard = settings.admin, settings.guard
    keyed = " (key required)" if admin.api_key_sha256 else ""
    lines = [
        f"listen  {settings.listen.host}:{settings.listen.port}",
        f"admin   {admin.host}:{admin.port}{keyed}" if admin.enabled else "admin   off",
        f"pools   {len(settings.pools)}, {settings.total_slots} slots in all",
    ]
    for pool in settings.pools:
        queue = pool.queue
        waiting = (
            f"queue up to {queue.max_depth}, wait up to {queue.max_wait_s:g} s"
            if queue.max_depth
            else "no queue (refuse when full)"
        )
        lines.append(
            f"  {pool.name}: {len(pool.replicas)} replica(s), {pool.total_slots} slots; {waiting}"
        )
        lines += [f"    {r.name}  {r.url}  {r.max_sessions} slots" for r in pool.replicas]
        if pool.fallback:
            hint = pool.fallback.as_hint().as_json().items()
            lines.append("    fallback " + ", ".join(f"{k}={v}" for k, v in hint if v))
    lines.append(f"routes  {len(settings.routes)}")
    for route in settings.routes:
        protocol = route.protocol + (f"/{route.inner_protocol}" if route.inner_protocol else "")
        upstream = f", upstream {route.upstream_path}" if route.upstream_path else ""
        lines.append(
            f"  {route.path} -> {route.pool}  {protocol}, refusal {route.refusal}{upstream}"
        )
    if settings.pipelines:
        lines.append(f"pipelines {len(settings.pipelines)}")
        lines += [f"  {p.name}: {' -> '.join(p.stages)}" for p in settings.pipelines]
    lines.append(
        f"guard   {guard.mode} (worst-1% delivery ratio < {guard.threshold:g}, "
        f"hysteresis {guard.hysteresis:g}, hold {guard.hold_s:g} s)"
    )
    keys = settings.auth.keys if settings.auth else ()
    names = ", ".join(key.name for key in keys)
    off = "off (auth.enabled: false)" if settings.auth_disabled else "off (no API keys)"
    lines.append(f"auth    {len(keys)} key(s): {names}" if keys else f"auth    {off}")
    return "\n".join(lines)
