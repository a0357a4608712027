"""One session's request head, read once: what authentication, admission and the relay
need of the client's headers and query.

:meth:`ClientRequest.of` walks the ASGI scope's headers once and parses the query once;
every later step (the key, a gang reservation's token, the fallback opt-in, the query
passed upstream, the content type) reads the frozen value instead of the scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

__all__ = ["ClientRequest", "RESERVATION_HEADER", "RESERVATION_PARAMETER"]

#: Where a gang reservation's token is presented.
RESERVATION_HEADER = b"x-headroom-reservation"
RESERVATION_PARAMETER = "headroom_reservation"
_FALLBACK_HEADER = b"x-headroom-allow-fallback"
_FALLBACK_PARAMETER = "headroom_fallback"
#: Query parameters that are Headroom's, never the upstream's.
_OWN_QUERY = frozenset({_FALLBACK_PARAMETER, RESERVATION_PARAMETER})
_OWN_QUERY_AND_KEY = _OWN_QUERY | {"api_key"}
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """What one session's steps read of its request head."""

    scope: dict[str, Any]
    #: The query's parameters, in order, blank values kept.
    query: tuple[tuple[str, str], ...]
    #: The key presented: ``Authorization: Bearer`` first, then ``api_key``.
    api_key: str | None
    #: The reservation tokens presented (``X-Headroom-Reservation`` headers and
    #: ``headroom_reservation`` parameters, stripped): see :attr:`reservation`.
    reservation_tokens: frozenset[str]
    #: The client opted in to the route's fallback pool.
    allow_fallback: bool
    content_type: str | None
    #: The query string to send upstream, without Headroom's own parameters.
    onward_query: str
    #: The same, without ``api_key`` too (when Headroom's auth is on, the key is ours).
    onward_query_without_key: str

    @classmethod
    def of(cls, scope: dict[str, Any]) -> ClientRequest:
        """Read an ASGI ``scope`` once: the API key (a ``Bearer`` token, else the ``api_key``
        parameter), every reservation token (header and parameter), the fallback opt-in and the
        query to send upstream. Of a repeated key, fallback or content type the first wins;
        nothing is checked here (authentication is the caller's)."""
        api_key: str | None = None
        tokens: set[str] = set()
        fallback: bool | None = None
        content_type: str | None = None
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name == b"authorization" and api_key is None:
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    api_key = token.strip()
            elif name == RESERVATION_HEADER:
                tokens.add(value.decode("latin-1").strip())
            elif name == _FALLBACK_HEADER and fallback is None:
                fallback = value.decode("latin-1").strip().lower() in _TRUE
            elif name == b"content-type" and content_type is None:
                content_type = value.decode("latin-1")
        raw: str = scope.get("query_string", b"").decode("latin-1")
        pairs = tuple(parse_qsl(raw, keep_blank_values=True)) if raw else ()
        for key, value in pairs:
            if key == "api_key" and value and api_key is None:
                api_key = value
            elif key == RESERVATION_PARAMETER:
                tokens.add(value.strip())
            elif key == _FALLBACK_PARAMETER and fallback is None:
                fallback = value.strip().lower() in _TRUE
        # A raw '#' (or space) is data here, not a fragment: keep it from ending the URL.
        onward = raw.replace("#", "%23").replace(" ", "%20")
        own = _OWN_QUERY_AND_KEY.intersection(k for k, _ in pairs)
        without_key = onward
        if own:
            without_key = urlencode([(k, v) for k, v in pairs if k not in _OWN_QUERY_AND_KEY])
            if own & _OWN_QUERY:
                onward = urlencode([(k, v) for k, v in pairs if k not in _OWN_QUERY])
        return cls(
            scope=scope,
            query=pairs,
            api_key=api_key,
            reservation_tokens=frozenset(tokens),
            allow_fallback=bool(fallback),
            content_type=content_type,
            onward_query=onward,
            onward_query_without_key=without_key,
        )

    def upstream_query(self, *, auth: bool) -> str:
        """The query string for the upstream: the client's, without Headroom's own
        parameters (and without ``api_key`` when Headroom's auth is on)."""
        return self.onward_query_without_key if auth else self.onward_query
