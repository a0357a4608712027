"""Which request/response headers cross the proxy.

End-to-end headers (Authorization, subprotocols, user agent, custom ``X-*``, content
type...) are forwarded; hop-by-hop ones (RFC 9110 7.6.1, plus the WebSocket handshake
headers the client library regenerates) are dropped. ``X-Forwarded-For`` and
``X-Forwarded-Proto`` are appended.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["HOP_BY_HOP", "forwarded_request_headers", "response_headers"]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_WS_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-accept",
        "sec-websocket-protocol",  # passed as the client library's subprotocols argument
    }
)
#: Headroom's own request headers that are not for the upstream.
_OWN = frozenset({"x-headroom-allow-fallback"})


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.decode("latin-1").split(","))
    return tokens


def forwarded_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    client_host: str | None,
    scheme: str,
    websocket: bool,
    keep_authorization: bool = True,
) -> list[tuple[str, str]]:
    """The headers to send upstream for a client request's raw ASGI headers. With
    ``keep_authorization=False`` (Headroom's own auth is on) the client's key stays
    here."""
    raw = list(raw)
    drop = HOP_BY_HOP | _OWN | _connection_tokens(raw)
    if not keep_authorization:
        drop = drop | {"authorization"}
    if websocket:
        drop = drop | _WS_HANDSHAKE
    out: list[tuple[str, str]] = []
    prior_xff: str | None = None
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
        if name in drop:
            continue
        value = value_b.decode("latin-1")
        if name == "x-forwarded-for":
            prior_xff = value
            continue
        if name == "x-forwarded-proto":
            continue
        out.append((name, value))
    if client_host:
        out.append(("x-forwarded-for", f"{prior_xff}, {client_host}" if prior_xff else client_host))
    elif prior_xff:
        out.append(("x-forwarded-for", prior_xff))
    out.append(("x-forwarded-proto", "https" if scheme in ("https", "wss") else "http"))
    return out


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers to relay to the client (hop-by-hop removed). The body
    is relayed byte for byte, so a Content-Length stays true."""
    raw = list(raw)
    # uvicorn adds its own Date and Server headers: relaying the upstream's would double them
    drop = (HOP_BY_HOP - {"content-length"}) | {"date", "server"} | _connection_tokens(raw)
    return [(n, v) for n, v in raw if n.decode("latin-1").lower() not in drop]
