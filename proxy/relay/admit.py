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

A WebSocket session on a route without queue feedback waits with its handshake
unanswered, so its client's own handshake timeout runs while it is queued: it waits at
most its pool's ``queue.max_handshake_wait_s`` (:meth:`QueueSettings.handshake_wait_s
<proxy.settings.QueueSettings.handshake_wait_s>`), then is refused ``queue_timeout``
like any waiter, in time for the client to read the 503 and its ``Retry-After``. HTTP
requests, and WebSocket sessions told their place (``queue_feedback``: accepted at
once), wait up to the pool's ``max_wait_s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.admission.auth import NO_KEY, Authorization
from proxy.admission.reservation_requests import ReservationMalformed, reservation_token
from proxy.admission.session_lease import Lease, PositionCallback, Waiting
from proxy.client_request import ClientRequest
from proxy.errors import Refused

if TYPE_CHECKING:
    from proxy.relay.services import RelayServices
    from proxy.settings import RouteSettings

__all__ = [
    "FALLBACK_RESPONSE_HEADER",
    "ReservationMalformed",
    "enter",
    "reservation_token",
]

FALLBACK_RESPONSE_HEADER = b"x-headroom-fallback"


async def enter(
    services: RelayServices,
    route: RouteSettings,
    request: ClientRequest,
    on_position: PositionCallback | None = None,
    *,
    authorized: Authorization = NO_KEY,
) -> tuple[Lease | Waiting, str | None]:
    """Enter the route's pool, or its fallback pool if the client opted in and the
    primary refuses, as ``authorized``'s tenant (counted against its quota where the
    gate counts it). Returns the entry and the fallback pool used (None if primary).
    Raises the primary's :class:`Refused` (naming the fallback) if neither admits.
    With a reservation token: the reserved slot, or raises ReservationRefused."""
    token = reservation_token(request)
    if token is not None:
        claimed = await services.reservations.claim(token, route.pool, authorized.key)
        return claimed, None
    gate = services.gate
    tenant, quota = authorized.tenant, authorized.quota
    target = _fallback_pool(services, route.pool, request, authorized)
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
        entry = await gate.admit(
            route.pool, on_position=on_position, tenant=tenant, quota=quota,
            max_wait_s=_wait_bound(services, route, route.pool),
        )  # fmt: skip
        return entry, None
    except Refused as refusal:
        if target is None:
            raise
        try:
            entry = await gate.admit(
                target, on_position=on_position, tenant=tenant, quota=quota,
                max_wait_s=_wait_bound(services, route, target),
            )  # fmt: skip
            return entry, target
        except Refused:
            raise refusal from None


def _wait_bound(services: RelayServices, route: RouteSettings, pool: str) -> float | None:
    """The session's own bound on its wait in ``pool``'s queue: the pool's handshake
    wait for a WebSocket route without queue feedback (module docstring), else None
    (the pool's ``max_wait_s``)."""
    if not route.is_websocket or route.queue_feedback:
        return None
    try:
        return services.settings.pool(pool).queue.handshake_wait_s
    except KeyError:  # a pool the gate still has but the configuration no longer names
        return None


def _fallback_pool(
    services: RelayServices, pool: str, request: ClientRequest, authorized: Authorization
) -> str | None:
    """The pool an opted-in session may fall back to from ``pool`` (configured, and
    allowed for its key), or None."""
    if not request.allow_fallback:
        return None
    hint = services.gate.fallback(pool)
    target = hint.pool if hint else None
    if target is None or target not in services.gate.pools():
        return None
    return target if authorized.allows(target) else None
