"""Client authentication and per-tenant quotas.

Off unless the configuration has ``auth: {keys: [...]}``. Keys are stored as SHA-256
hex digests, never in clear. A client presents its key as ``Authorization: Bearer
<key>`` or, for browsers (which cannot set headers on a WebSocket), ``?api_key=<key>``.
The check runs before the gate: a missing or wrong key (401) or a key not allowed on
the route's pool (403) never takes a slot or a queue place. With auth on, the key is
Headroom's: the ``Authorization`` header and ``api_key`` parameter are not forwarded
upstream, and :class:`KeyRedactionFilter` keeps ``api_key`` values (and reservation
tokens) out of uvicorn's logs.

A key's ``max_sessions`` caps that tenant's concurrent sessions across pools: past it,
429 ``tenant_limit`` (other tenants are unaffected). The reservation is taken before
the gate and released on every exit path.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass

from proxy.admission.interface import TenantQuota
from proxy.admission.tenants import TenantSpec
from proxy.client_request import ClientRequest
from proxy.errors import Forbidden, TenantLimitRefused, Unauthorized
from proxy.settings import ApiKeySettings, AuthSettings

__all__ = [
    "NO_KEY",
    "Authorization",
    "KeyRedactionFilter",
    "TenantQuotas",
    "authenticate",
    "identify",
    "tenant_spec",
]

#: Secrets in a request target: the API key, and a gang reservation's token (whoever
#: holds it can claim the reserved slots), as a query value or in the release path.
_SECRET_RE = re.compile(
    r"((?:api_key|headroom_reservation)=|/v1/headroom/reservations/)[^&?#/\s\"']*"
)


def identify(auth: AuthSettings | None, request: ClientRequest) -> ApiKeySettings | None:
    """The caller's key settings (None when auth is off), from the request head alone:
    what runs before any body is read. Raises Unauthorized (401)."""
    if auth is None:
        return None
    key = request.api_key
    if key is None:
        raise Unauthorized("an API key is required: Authorization: Bearer <key> or ?api_key=")
    found = auth.key_for(hashlib.sha256(key.encode()).hexdigest())
    if found is None:
        raise Unauthorized("the API key is not valid")
    return found


def authenticate(
    auth: AuthSettings | None, request: ClientRequest, pool: str
) -> ApiKeySettings | None:
    """The caller's key settings (None when auth is off); raises Unauthorized (401) or
    Forbidden (403)."""
    found = identify(auth, request)
    if found is None:
        return None
    if not found.allows(pool):
        raise Forbidden(f"this API key may not use pool {pool!r}")
    return found


@dataclass(frozen=True, slots=True)
class Authorization:
    """What :meth:`proxy.runtime.Runtime.authorize` found for one session, passed on
    as a value: ``token`` for ``release_tenant`` (the key's count in this process),
    ``tenant`` (its scheduling identity) and ``quota`` (its ``max_sessions``) for the
    gate's :meth:`~proxy.admission.interface.AdmissionGate.admit`. All None: no key."""

    token: str | None = None
    tenant: TenantSpec | None = None
    quota: TenantQuota | None = None
    #: The key's settings (what pools it may use), read once.
    key: ApiKeySettings | None = None

    def allows(self, pool: str) -> bool:
        """Whether the session's key may use ``pool`` (any pool without auth)."""
        return self.key is None or self.key.allows(pool)


#: A session without an API key (authentication off).
NO_KEY = Authorization()


def tenant_spec(key: ApiKeySettings) -> TenantSpec:
    """The scheduling identity of an API key: its name, class, weight and
    ``max_queued``."""
    return TenantSpec(key.name, key.priority, key.weight, key.max_queued)


class TenantQuotas:
    """Concurrent sessions per key, against each key's ``max_sessions``."""

    def __init__(self) -> None:
        self._active: dict[str, int] = {}

    def reserve(
        self, key: ApiKeySettings | None, pool: str, retry_after_s: float, *, enforce: bool = True
    ) -> str | None:
        """Take one session of ``key``'s quota; returns a token for :meth:`release`
        (None when there is nothing to count). Raises TenantLimitRefused.
        ``enforce=False``: count without the check (a session taking over a count held
        for it, a claimed gang reservation's slot)."""
        if key is None:
            return None
        active = self._active.get(key.name, 0)
        if enforce and key.max_sessions is not None and active >= key.max_sessions:
            raise TenantLimitRefused("tenant_limit", retry_after_s=retry_after_s, pool=pool)
        self._active[key.name] = active + 1
        return key.name

    def release(self, token: str | None) -> None:
        """Give back the session counted by a token from :meth:`reserve`; None (nothing counted) is
        a no-op. Not idempotent: call it once per token."""
        if token is None:
            return
        left = self._active.get(token, 0) - 1
        if left > 0:
            self._active[token] = left
        else:
            self._active.pop(token, None)

    def active(self, name: str) -> int:
        """Sessions of key ``name`` counted in this process now (0 for an unknown key)."""
        return self._active.get(name, 0)


class KeyRedactionFilter(logging.Filter):
    """Rewrites ``api_key=...``, ``headroom_reservation=...`` and the token of
    ``/v1/headroom/reservations/<token>`` to ``REDACTED`` in any record it sees (uvicorn
    logs a request's path with its query string)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _SECRET_RE.sub(r"\1REDACTED", a) if isinstance(a, str) else a for a in record.args
            )
        if isinstance(record.msg, str) and ("=" in record.msg or "/v1/" in record.msg):
            record.msg = _SECRET_RE.sub(r"\1REDACTED", record.msg)
        return True
