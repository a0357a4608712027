"""Admission for the relays: the gate, the opt-in fallback pool, Headroom's own
query parameters.

A client opts in to fallback with the header ``X-Headroom-Allow-Fallback: 1`` or the
query parameter ``headroom_fallback=1``. An opted-in session never waits for a slot the
fallback pool (its pool's ``fallback.pool``, one the key may use) has free now:

1. the route's pool, if it has a slot now (without a queue place: waiters of its class
   or above are never overtaken);
2. else the fallback pool, if it has a slot now;
3. else the route's pool as for any session (its queue, when it has one);
4. and if that refuses (queue full, draining, no healthy replica...), the fallback pool,
   queue included.

The response of a session in the fallback pool carries ``X-Headroom-Fallback: <pool>``
(for WebSocket routes, on the handshake response). Without the opt-in, a refusal still
names the fallback in its body. The route's pool counts step 1's answer as a refusal
when the session goes on, as it counts step 3's.

A connection presenting a gang reservation (header ``X-Headroom-Reservation`` or query
parameter ``headroom_reservation``, :mod:`proxy.admission.reservations`) uses its reserved slot of
the route's pool instead: no queue, no fallback; a token without an unused slot for
that pool is refused (:class:`~proxy.admission.reservations.ReservationRefused`, 409 / 1008).
A token presented but not usable as one -- empty or only whitespace, or two that differ
(header and query parameter, or either given twice) -- is refused as malformed
(:class:`ReservationMalformed`, 400 / 1008): never taken as "no token" and admitted the
normal way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

from proxy.admission.auth import NO_KEY, Authorization, authenticate
from proxy.admission.gate import Lease, PositionCallback, Waiting
from proxy.admission.reservation_requests import ReservationMalformed, reservation_token
from proxy.errors import Refused

if TYPE_CHECKING:
    from proxy.relay.services import RelayServices
    from proxy.settings import RouteSettings

__all__ = [
    "FALLBACK_RESPONSE_HEADER",
    "ReservationMalformed",
    "enter",
    "reservation_token",
    "upstream_query",
    "wants_fallback",
]

FALLBACK_RESPONSE_HEADER = b"x-headroom-fallback"
_FALLBACK_HEADER = b"x-headroom-allow-fallback"
_OWN_QUERY = frozenset({"headroom_fallback", "headroom_reservation"})
_TRUE = frozenset({"1", "true", "yes", "on"})


def wants_fallback(scope: dict[str, Any]) -> bool:
    for name, value in scope["headers"]:
        if name.lower() == _FALLBACK_HEADER:
            return value.decode("latin-1").strip().lower() in _TRUE
    query = scope.get("query_string", b"")
    if b"headroom_fallback" in query:
        for key, value in parse_qsl(query.decode("latin-1")):
            if key == "headroom_fallback":
                return value.strip().lower() in _TRUE
    return False


def upstream_query(scope: dict[str, Any], *, auth: bool = False) -> str:
    """The client's query string without Headroom's own parameters (``api_key`` too
    when Headroom's auth is on: the key is Headroom's)."""
    raw: str = scope.get("query_string", b"").decode("latin-1")
    # A raw '#' (or space) here is data, not a fragment: keep it from ending the URL.
    raw = raw.replace("#", "%23").replace(" ", "%20")
    own = _OWN_QUERY | {"api_key"} if auth else _OWN_QUERY
    if not raw or not any(key in raw for key in own):
        return raw
    pairs = parse_qsl(raw, keep_blank_values=True)
    return urlencode([(k, v) for k, v in pairs if k not in own])


async def enter(
    services: RelayServices,
    route: RouteSettings,
    scope: dict[str, Any],
    on_position: PositionCallback | None = None,
    *,
    authorized: Authorization = NO_KEY,
) -> tuple[Lease | Waiting, str | None]:
    """Enter the route's pool, or its fallback pool if the client opted in and the
    primary refuses, as ``authorized``'s tenant (counted against its quota where the
    gate counts it). Returns the entry and the fallback pool used (None if primary).
    Raises the primary's :class:`Refused` (naming the fallback) if neither admits.
    With a reservation token: the reserved slot, or raises ReservationRefused."""
    token = reservation_token(scope)
    if token is not None:
        key = authenticate(services.settings.auth, scope, route.pool)
        claimed = await services.reservations.claim(token, route.pool, key)
        return claimed, None
    gate = services.gate
    tenant, quota = authorized.tenant, authorized.quota
    target = _fallback_pool(services, route.pool, scope)
    if target is not None:  # steps 1 and 2 of the module docstring: a slot now
        try:
            return await gate.admit(route.pool, queue=False, tenant=tenant, quota=quota), None
        except Refused:
            pass
        try:
            return await gate.admit(target, queue=False, tenant=tenant, quota=quota), target
        except Refused:
            pass
    try:
        entry = await gate.admit(route.pool, on_position=on_position, tenant=tenant, quota=quota)
        return entry, None
    except Refused as refusal:
        if target is None:
            raise
        try:
            entry = await gate.admit(target, on_position=on_position, tenant=tenant, quota=quota)
            return entry, target
        except Refused:
            raise refusal from None


def _fallback_pool(services: RelayServices, pool: str, scope: dict[str, Any]) -> str | None:
    """The pool an opted-in session may fall back to from ``pool`` (configured, and
    allowed for its key), or None."""
    if not wants_fallback(scope):
        return None
    hint = services.gate.fallback(pool)
    target = hint.pool if hint else None
    if target is None or target not in services.gate.pools():
        return None
    return target if services.key_allows(scope, target) else None
