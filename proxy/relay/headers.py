"""Which request/response headers cross the proxy.

End-to-end headers (Authorization, subprotocols, user agent, custom ``X-*``, content
type...) are forwarded; hop-by-hop ones (RFC 9110 7.6.1, plus the WebSocket handshake
headers the client library regenerates) are dropped.

``X-Forwarded-For``: the client's chain as it sent it (several header lines joined in
order), then the peer address -- the TCP peer, since uvicorn's own proxy-header
rewrite is off (:func:`proxy.process.gateway.uvicorn_options`) -- appended exactly once.
``X-Forwarded-Proto``: the scheme the client used to reach Headroom, unless the peer
is one of ``forwarded.trusted_proxies`` and sent its own (``http`` or ``https``, e.g.
a load balancer that terminated TLS): that one is kept. An untrusted peer cannot
choose it.

The other two ways of naming the client follow the same rules, when the client sent
them (Headroom does not add them to a request that had none):

* ``Forwarded`` (RFC 7239), like ``X-Forwarded-For``: the client's elements as it sent
  them (several header lines joined in order), then Headroom's own element for the hop
  it saw, ``for=<peer>;proto=<scheme>``, appended exactly once;
* ``X-Real-IP``, like ``X-Forwarded-Proto``: from a trusted proxy, the address it sent
  (its last line); from any other peer, the peer's own address -- an untrusted client
  cannot name itself.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Sequence

__all__ = ["HOP_BY_HOP", "forwarded_request_headers", "is_trusted", "response_headers"]

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
_OWN = frozenset({"x-headroom-allow-fallback", "x-headroom-reservation"})


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.decode("latin-1").split(","))
    return tokens


@functools.lru_cache(maxsize=64)
def _networks(
    entries: tuple[str, ...],
) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(e, strict=False) for e in entries)


def is_trusted(host: str | None, trusted_proxies: Sequence[str]) -> bool:
    """Whether the peer ``host`` is in ``trusted_proxies`` (addresses or networks)."""
    if not host or not trusted_proxies:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in net for net in _networks(tuple(trusted_proxies)))


#: What never crosses, by (keep_authorization, websocket): built once, not per request.
_DROP = {
    (keep, ws): frozenset(
        HOP_BY_HOP
        | _OWN
        | (set() if keep else {"authorization"})
        | (_WS_HANDSHAKE if ws else set())
    )
    for keep in (True, False)
    for ws in (True, False)
}


def forwarded_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    client_host: str | None,
    scheme: str,
    websocket: bool,
    keep_authorization: bool = True,
    trusted_proxies: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """The headers to send upstream for a client request's raw ASGI headers. With
    ``keep_authorization=False`` (Headroom's own auth is on) the client's key stays
    here. ``client_host`` is the TCP peer (see the module docstring)."""
    named = [(name.decode("latin-1").lower(), value) for name, value in raw]
    drop = _DROP[keep_authorization, websocket]
    tokens: set[str] = set()
    for name, value_b in named:
        if name == "connection":
            tokens.update(t.strip().lower() for t in value_b.decode("latin-1").split(","))
    if not tokens <= drop:  # the Connection header names more hop-by-hop headers
        drop = drop | tokens
    out: list[tuple[str, str]] = []
    chain: list[str] = []
    given_proto: str | None = None
    forwarded: list[str] | None = None  # None: the client sent no Forwarded header
    real_ip: str | None = None
    for name, value_b in named:
        if name in drop:
            continue
        value = value_b.decode("latin-1")
        if name == "x-forwarded-for":
            if value.strip():
                chain.append(value.strip())
            continue
        if name == "x-forwarded-proto":
            given_proto = value.strip().lower()
            continue
        if name == "forwarded":
            if forwarded is None:
                forwarded = []
            if value.strip():
                forwarded.append(value.strip())
            continue
        if name == "x-real-ip":
            real_ip = value.strip()
            continue
        out.append((name, value))
    if client_host:
        chain.append(client_host)
    if chain:
        out.append(("x-forwarded-for", ", ".join(chain)))
    own_scheme = "https" if scheme in ("https", "wss") else "http"
    trusted = is_trusted(client_host, trusted_proxies)
    proto = given_proto if given_proto in ("http", "https") and trusted else own_scheme
    out.append(("x-forwarded-proto", proto))
    if forwarded is not None:
        forwarded.append(_forwarded_element(client_host, own_scheme))
        out.append(("forwarded", ", ".join(forwarded)))
    if real_ip is not None:
        out.append(("x-real-ip", real_ip if trusted and real_ip else client_host or ""))
    return out


def _forwarded_element(host: str | None, scheme: str) -> str:
    """RFC 7239's element for the hop Headroom saw: ``for=<peer>;proto=<scheme>`` (an
    IPv6 address quoted and bracketed, an unknown peer ``unknown``)."""
    if not host:
        node = "unknown"
    elif ":" in host:
        node = f'"[{host}]"'
    else:
        node = host
    return f"for={node};proto={scheme}"


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers to relay to the client (hop-by-hop removed). The body
    is relayed byte for byte, so a Content-Length stays true."""
    raw = list(raw)
    # uvicorn adds its own Date and Server headers: relaying the upstream's would double them
    drop = (HOP_BY_HOP - {"content-length"}) | {"date", "server"} | _connection_tokens(raw)
    return [(n, v) for n, v in raw if n.decode("latin-1").lower() not in drop]
