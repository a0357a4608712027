"""A gang reservation request as the client sends it (:mod:`proxy.admission.reservations`): the
token a stage connection presents, the body of ``POST /v1/headroom/reservations``, the
key that makes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from proxy.admission.auth import identify
from proxy.client_request import RESERVATION_HEADER, RESERVATION_PARAMETER, ClientRequest
from proxy.errors import Forbidden, PolicyViolation
from proxy.settings import ApiKeySettings, AuthSettings, ReservationSettings

__all__ = [
    "MAX_POOLS",
    "QUERY_PARAMETER",
    "RESERVATION_HEADER",
    "BadReservation",
    "ReservationMalformed",
    "key_of",
    "parse_request",
    "reservation_token",
]

QUERY_PARAMETER = RESERVATION_PARAMETER
MAX_POOLS = 8
_DEFAULTS = ReservationSettings()


class BadReservation(PolicyViolation):
    """The reservation request itself is malformed (400)."""

    code: ClassVar[str] = "invalid_reservation"


class ReservationMalformed(PolicyViolation):
    """A reservation token was presented but cannot be one (400 / 1008)."""

    code: ClassVar[str] = "reservation_malformed"


def reservation_token(request: ClientRequest) -> str | None:
    """The gang reservation token the connection presents (None: it presents none):
    every ``X-Headroom-Reservation`` header and ``headroom_reservation`` parameter.
    Raises :class:`ReservationMalformed` when one is empty or only whitespace, or when
    they do not all name the same token."""
    seen = request.reservation_tokens
    if not seen:
        return None
    if "" in seen:
        raise ReservationMalformed("the reservation token is empty")
    if len(seen) > 1:
        raise ReservationMalformed(
            "two different reservation tokens (X-Headroom-Reservation and "
            "headroom_reservation must name the same one)"
        )
    (token,) = seen
    return token


def parse_request(
    body: Any, known: Sequence[str], limits: ReservationSettings = _DEFAULTS
) -> tuple[list[str], float]:
    """(pools, hold_s) of a reservation request body; raises :class:`BadReservation`."""
    if not isinstance(body, dict):
        raise BadReservation('the body must be a JSON object: {"pools": [...], "hold_s": 5}')
    unknown_fields = set(body) - {"pools", "hold_s"}
    if unknown_fields:
        raise BadReservation(f"unknown field(s): {', '.join(sorted(unknown_fields))}")
    pools = body.get("pools")
    if not isinstance(pools, list) or not pools or not all(isinstance(p, str) for p in pools):
        raise BadReservation('"pools" must be a non-empty list of pool names')
    if len(pools) > MAX_POOLS:
        raise BadReservation(f'"pools" may name at most {MAX_POOLS} pools')
    if len(set(pools)) != len(pools):
        raise BadReservation('"pools" names a pool twice')
    missing = [p for p in pools if p not in known]
    if missing:
        raise BadReservation(f"no pool named {', '.join(map(repr, missing))}")
    hold = body.get("hold_s", limits.default_hold_s)
    top = limits.max_hold_s
    if isinstance(hold, bool) or not isinstance(hold, int | float) or not 0 < hold <= top:
        raise BadReservation(f'"hold_s" must be a number of seconds in (0, {top:g}]')
    return list(pools), float(hold)


def key_of(
    auth: AuthSettings | None, request: ClientRequest, pools: Sequence[str]
) -> ApiKeySettings | None:
    """The caller's key, checked for every pool (raises Unauthorized/Forbidden)."""
    key = identify(auth, request)
    for pool in pools:
        if key is not None and not key.allows(pool):
            raise Forbidden(f"this API key may not use pool {pool!r}")
    return key
