"""Every error Headroom raises on purpose, in one hierarchy.

Each error knows how it reaches a client: the HTTP status for a plain request or a
refused WebSocket handshake, and the WebSocket close code once a socket is open.
Third-party exceptions (websockets, httpx, pydantic) are translated into these at
the boundary; they never reach the admission core.

::

    HeadroomError                          (500 / 1011)
    ├── ConfigError                        invalid configuration: field path + reason
    ├── ListenError                        a listener's address cannot be bound
    ├── Refused                            a session is not admitted (docs/contracts.md)
    │   ├── CapacityRefused                503 / 1013  pool_full, queue_full, queue_timeout,
    │   │                                              guard, no_healthy_replica,
    │   │                                              backend_unavailable,
    │   │                                              preempted_in_queue
    │   ├── DrainingRefused                503 / 1013  draining
    │   └── TenantLimitRefused             429 / 1013  tenant_limit
    ├── PolicyViolation                    400 / 1008  client broke a limit or the protocol
    │   ├── Unauthorized                   401 / 1008  missing or wrong API key
    │   ├── Forbidden                      403 / 1008  key not allowed on this pool
    │   ├── MessageTooLarge                413 / 1008  frame or body over the limit
    │   └── RequestTimeout                 408 / 1008  body too slow, client not reading
    ├── UpstreamError                      502 / 1014  the engine failed or is unreachable
    │   ├── UpstreamConnectError           before any byte was relayed (failover allowed)
    │   │   └── UpstreamConnectTimeout     504: set-up not done within the deadline
    │   └── UpstreamStreamError            after bytes flowed (never retried)
    │       └── UpstreamTimeout            504: no answer in time
    └── InternalError                      500 / 1011

A :class:`Refused` carries ``reason`` (a reason code of docs/contracts.md), ``retry_after_s``,
``queue_position`` and an optional fallback hint; :meth:`Refused.body` renders the
contract's JSON body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "REASONS",
    "CapacityRefused",
    "ConfigError",
    "DrainingRefused",
    "FallbackHint",
    "Forbidden",
    "HeadroomError",
    "InternalError",
    "ListenError",
    "MessageTooLarge",
    "PolicyViolation",
    "Refused",
    "RequestTimeout",
    "TenantLimitRefused",
    "Unauthorized",
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamError",
    "UpstreamStreamError",
    "UpstreamTimeout",
    "refusal_for",
]

#: Reason codes of the refusal contract, docs/contracts.md (``X-Headroom-Reason``,
#: ``error.code``).
REASONS = frozenset(
    {
        "pool_full",
        "queue_timeout",
        "queue_full",
        "draining",
        "guard",
        "no_healthy_replica",
        "tenant_limit",
        "backend_unavailable",
        "preempted_in_queue",
    }
)


class HeadroomError(Exception):
    """Base of every Headroom error."""

    http_status: ClassVar[int] = 500
    close_code: ClassVar[int] = 1011


class ConfigError(HeadroomError):
    """The configuration is invalid. ``problems`` lists ``(field path, reason)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid configuration{where}:"]
        lines += [f"  {path}: {reason}" for path, reason in problems]
        super().__init__("\n".join(lines))


class ListenError(HeadroomError):
    """A listener cannot be bound. The message names the listener, ``host:port`` and
    the operating system's reason (e.g. "Address already in use")."""

    def __init__(self, what: str, host: str, port: int, exc: OSError) -> None:
        self.host, self.port = host, port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        reason = exc.strerror or str(exc) or type(exc).__name__
        super().__init__(f"cannot bind the {what} to {address}: {reason}")


@dataclass(frozen=True, slots=True)
class FallbackHint:
    """Where a refused client may go instead (``fallback`` in docs/contracts.md)."""

    voice: str | None = None
    pool: str | None = None
    url: str | None = None

    def as_json(self) -> dict[str, str | None]:
        """The ``fallback`` object of an error body; absent fields are null."""
        return {"voice": self.voice, "pool": self.pool, "url": self.url}


_MESSAGES = {
    "pool_full": "All GPU slots for this model are busy.",
    "queue_full": "All GPU slots are busy and the wait queue is full.",
    "queue_timeout": "All GPU slots stayed busy for the longest allowed wait.",
    "draining": "This gateway is shutting down and takes no new sessions.",
    "guard": "The GPU is at its realtime limit; admitting more would stall live audio.",
    "no_healthy_replica": "No healthy upstream replica is available for this model.",
    "tenant_limit": "Your key has reached its own concurrency or queue quota.",
    "preempted_in_queue": "A higher-priority session needed your place in the full wait "
    "queue (your key's class is sheddable).",
    "backend_unavailable": "The shared admission store is unreachable, so no slot can be "
    "granted safely.",
}


class Refused(HeadroomError):
    """A session was not admitted. Recoverable: retry later or fall back."""

    http_status: ClassVar[int] = 503
    close_code: ClassVar[int] = 1013
    error_type: ClassVar[str] = "capacity_exhausted"

    def __init__(
        self,
        reason: str,
        *,
        retry_after_s: float,
        pool: str,
        queue_position: int | None = None,
        fallback: FallbackHint | None = None,
        message: str | None = None,
    ) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self.reason = reason
        # Whole seconds, rounded up, so the header, the body's retry_after_s and the
        # message all say the same number and no client comes back early.
        self.retry_after_s = float(max(1, math.ceil(round(retry_after_s, 3))))
        self.pool = pool
        self.queue_position = queue_position
        self.fallback = fallback
        self.message = message or (
            f"{_MESSAGES[reason]} Retry in about {self.retry_after_header} s"
            + (" or use the fallback." if fallback else ".")
        )
        super().__init__(self.message)

    @property
    def retry_after_header(self) -> str:
        """``Retry-After``: integer seconds, the same number as :attr:`retry_after_s`."""
        return str(int(self.retry_after_s))

    def headers(self) -> dict[str, str]:
        """The HTTP headers a refusal carries: ``Retry-After`` (whole seconds) and
        ``X-Headroom-Reason``."""
        return {"Retry-After": self.retry_after_header, "X-Headroom-Reason": self.reason}

    def body(self) -> dict[str, Any]:
        """The JSON error body of docs/contracts.md: type, code (the reason), message,
        ``retry_after_s``, fallback and queue position."""
        return {
            "error": {
                "type": self.error_type,
                "code": self.reason,
                "message": self.message,
                "retry_after_s": round(self.retry_after_s, 3),
                "fallback": self.fallback.as_json() if self.fallback else None,
                "queue_position": self.queue_position,
            }
        }

    def with_fallback(self, fallback: FallbackHint | None) -> Refused:
        """The same refusal (type, reason, pool, Retry-After, position) with ``fallback`` instead;
        the message is the reason's standard one again, so a custom message is not kept."""
        return type(self)(
            self.reason,
            retry_after_s=self.retry_after_s,
            pool=self.pool,
            queue_position=self.queue_position,
            fallback=fallback,
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.reason} pool={self.pool} "
            f"retry_after={self.retry_after_s:.1f}s position={self.queue_position}>"
        )


class CapacityRefused(Refused):
    """The pool has no slot to give (full, queue full or timed out, guarded, unhealthy)."""


class DrainingRefused(Refused):
    """The gateway is draining before shutdown or restart."""


class TenantLimitRefused(Refused):
    """The caller's own quota is used up; other tenants are unaffected."""

    http_status: ClassVar[int] = 429


def refusal_for(
    reason: str,
    *,
    retry_after_s: float,
    pool: str,
    queue_position: int | None = None,
    fallback: FallbackHint | None = None,
) -> Refused:
    """Build the right :class:`Refused` subclass for a reason code."""
    cls: type[Refused]
    if reason == "draining":
        cls = DrainingRefused
    elif reason == "tenant_limit":
        cls = TenantLimitRefused
    else:
        cls = CapacityRefused
    return cls(
        reason,
        retry_after_s=retry_after_s,
        pool=pool,
        queue_position=queue_position,
        fallback=fallback,
    )


class PolicyViolation(HeadroomError):
    """The client broke a limit or the protocol."""

    http_status: ClassVar[int] = 400
    close_code: ClassVar[int] = 1008
    code: ClassVar[str] = "policy_violation"


class Unauthorized(PolicyViolation):
    http_status: ClassVar[int] = 401
    code: ClassVar[str] = "unauthorized"
    #: ``WWW-Authenticate`` of every 401, HTTP and refused WebSocket handshake alike (RFC
    #: 9110 requires one): the key goes in ``Authorization: Bearer`` (RFC 6750).
    challenge: ClassVar[str] = 'Bearer realm="headroom"'


class Forbidden(PolicyViolation):
    http_status: ClassVar[int] = 403
    code: ClassVar[str] = "forbidden"


class MessageTooLarge(PolicyViolation):
    http_status: ClassVar[int] = 413
    code: ClassVar[str] = "message_too_large"


class RequestTimeout(PolicyViolation):
    """The client was too slow: a request body, or reading what it asked for."""

    http_status: ClassVar[int] = 408
    code: ClassVar[str] = "timeout"


class UpstreamError(HeadroomError):
    """The upstream engine failed or could not be reached."""

    http_status: ClassVar[int] = 502
    close_code: ClassVar[int] = 1014

    def __init__(self, message: str, *, replica: str | None = None, kind: str = "error") -> None:
        self.replica = replica
        self.kind = kind
        super().__init__(message)


class UpstreamConnectError(UpstreamError):
    """Connecting to the replica failed before any byte was relayed: safe to fail over."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """The session's upstream set-up (every connect and handshake attempt together) did
    not finish within ``limits.handshake_timeout_s``. Not a replica failure: the
    request itself may be what the upstream will not answer."""

    http_status: ClassVar[int] = 504


class UpstreamStreamError(UpstreamError):
    """The upstream failed after bytes flowed: never retried."""


class UpstreamTimeout(UpstreamStreamError):
    """The upstream took the request but answered nothing in time."""

    http_status: ClassVar[int] = 504


class InternalError(HeadroomError):
    """A bug in Headroom. Logged with a traceback; the client sees 500 / 1011."""
