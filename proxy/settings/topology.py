"""The models of what the gateway routes to: pools of replicas (each with its queue,
fallback and reserved slots), the routes that bind client paths to pools, and the
pipelines that chain pools for one call."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator, Field, field_validator, model_validator

from proxy.errors import FallbackHint
from proxy.metering.adapters.base import MAX_TOKENS_PER_SECOND
from proxy.metering.adapters.registry import (
    PROTOCOL_TABLE,
    Protocol,
    inner_protocols,
)
from proxy.settings.environment import Loc, Problems
from proxy.settings.fields import Frozen, Name, PositiveSeconds, Seconds, UrlPath

__all__ = [
    "HANDSHAKE_WAIT_S",
    "AudioSettings",
    "FallbackSettings",
    "PipelineSettings",
    "PoolSettings",
    "QueueSettings",
    "ReplicaSettings",
    "ReserveSettings",
    "RouteSettings",
    "ws_base",
]


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


#: How long a session waits in its held WebSocket handshake when the pool's queue does not
#: set ``max_handshake_wait_s``: well inside the handshake timeouts clients use by default.
HANDSHAKE_WAIT_S = 5.0


class QueueSettings(Frozen):
    """The pool's FIFO wait queue; ``max_depth`` 0 refuses at once when every slot is busy.

    ``max_wait_s`` bounds every waiter. A WebSocket session whose handshake is still
    unanswered while it waits (a route without ``queue_feedback``) waits at most
    ``max_handshake_wait_s`` (unset: :data:`HANDSHAKE_WAIT_S`; either way no longer than
    ``max_wait_s``): its refusal must reach the client before the client's own handshake
    timeout gives up on it (``open_timeout`` in Python's websockets, which covers the
    connect, TLS and upgrade together). 0 refuses such a session at once when every slot
    is busy."""

    max_depth: int = Field(0, ge=0)
    max_wait_s: Seconds = 10
    max_handshake_wait_s: Seconds | None = None

    @model_validator(mode="after")
    def _handshake_wait_fits(self) -> QueueSettings:
        given = self.max_handshake_wait_s
        if given is not None and given > self.max_wait_s:
            why = (
                f"{given:g} s is longer than max_wait_s ({self.max_wait_s:g} s), which "
                "bounds every waiter: at most max_wait_s"
            )
            raise Problems([(("max_handshake_wait_s",), why)])
        return self

    @property
    def handshake_wait_s(self) -> float:
        """How long a session waits in its unanswered WebSocket handshake."""
        given = self.max_handshake_wait_s
        return min(HANDSHAKE_WAIT_S if given is None else given, self.max_wait_s)


class FallbackSettings(Frozen):
    """Where refused clients are pointed (the ``fallback`` of a rejection body)."""

    voice: str | None = None
    pool: Name | None = None
    url: Annotated[str, AfterValidator(_check_hint_url)] | None = None

    def as_hint(self) -> FallbackHint:
        return FallbackHint(voice=self.voice, pool=self.pool, url=self.url)


class ReplicaSettings(Frozen):
    """One upstream endpoint (one GPU). ``url`` is an http(s) base without trailing slash;
    ``max_sessions`` is the hard concurrency cap (find it with ``headroom probe``)."""

    name: Name
    url: Annotated[str, AfterValidator(_check_upstream_url)]
    max_sessions: int = Field(ge=1)

    @property
    def ws_url(self) -> str:
        return ws_base(self.url)


class ReserveSettings(Frozen):
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


class PoolSettings(Frozen):
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


class AudioSettings(Frozen):
    """The route's default PCM format, used to convert bytes to seconds of audio."""

    sample_rate: int = Field(24000, ge=8000, le=192000)
    channels: int = Field(1, ge=1, le=8)
    sample_width: int = Field(2, ge=1, le=4)

    @property
    def bytes_per_second(self) -> int:
        return self.sample_rate * self.channels * self.sample_width


class RouteSettings(Frozen):
    """A client-facing path bound to a pool and a protocol.

    ``refusal: close`` (accept, send one error event, close 1013) and ``queue_feedback``
    need a WebSocket protocol; ``inner_protocol`` is required for, and only for, a
    protocol that carries another (``sagemaker-bidi``); ``tokens_per_audio_second`` is
    required for, and only for, a protocol that counts generated tokens as audio
    (``openai-completions-tokens``); ``upstream_path`` relays to a different upstream
    path. What each protocol is: :mod:`proxy.metering.adapters.registry`.
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


class PipelineSettings(Frozen):
    """A named chain of pools one call uses together (a voice agent's ASR and TTS stages,
    say). Headroom reports which stage has the least headroom left (the limiting stage):
    metrics, ``GET /admin/status``. Admission is unchanged."""

    name: Name
    stages: tuple[str, ...] = Field(min_length=1)


def ws_base(http_url: str) -> str:
    """The WebSocket form of an http(s) base URL: http -> ws, https -> wss."""
    scheme, sep, rest = http_url.partition("://")
    ws = {"http": "ws", "https": "wss"}.get(scheme.lower())
    if not sep or ws is None:
        raise ValueError(f"not an http(s) URL: {http_url!r}")
    return f"{ws}://{rest}"
