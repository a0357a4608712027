"""Header and query-string code on the routing path, fed what uvicorn can hand it.

uvicorn (httptools) passes request headers as raw bytes -- names lower-cased, values any
bytes but CR, LF and NUL, including obs-text 0x80-0xFF -- and the query string as the raw
bytes of the request target after ``?``. Properties: nothing raises; hop-by-hop and
Headroom's own headers and parameters never reach the upstream; whatever is forwarded
can be put on the wire by the upstream client libraries (httpx, websockets).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from hypothesis import given
from hypothesis import strategies as st
from websockets.uri import parse_uri

from proxy.client_request import ClientRequest
from proxy.relay.headers import HOP_BY_HOP, forwarded_request_headers, response_headers
from tests.fuzz.conftest import fuzz_settings

TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
names = st.one_of(
    st.sampled_from([
        "authorization", "connection", "upgrade", "host", "content-length", "keep-alive",
        "transfer-encoding", "te", "x-forwarded-for", "x-forwarded-proto",
        "x-headroom-allow-fallback", "sec-websocket-key", "sec-websocket-protocol",
        "user-agent", "x-custom", "proxy-authorization",
    ]),
    st.text(alphabet=TOKEN, min_size=1, max_size=12),
).map(str.encode)  # fmt: skip
# A header value as uvicorn delivers it: any byte but CR, LF, NUL; no surrounding spaces.
values = st.binary(max_size=40).map(
    lambda b: bytes(c for c in b if c not in (0, 10, 13)).strip(b" \t")
) | st.sampled_from([b"Bearer abc", b"bearer   k ", b"close, x-custom", b"1", b"yes",
                     b"Upgrade, Keep-Alive", b"Jos\xe9", b"10.0.0.1, 10.0.0.2"])  # fmt: skip
headers = st.lists(st.tuples(names, values), max_size=12)
# A query string as uvicorn delivers it: visible ASCII (httptools refuses control
# characters, spaces and bytes >= 0x80 in the request target; '#' gets through).
query_chars = "".join(chr(c) for c in range(0x21, 0x7F))
queries = st.one_of(
    st.text(alphabet=query_chars, max_size=60),
    st.lists(
        st.tuples(st.sampled_from(["api_key", "headroom_fallback", "model", "x", "a%20b", ""]),
                  st.text(alphabet=query_chars.replace("&", "").replace("=", ""), max_size=10)),
        max_size=5,
    ).map(lambda kv: "&".join(f"{k}={v}" for k, v in kv)),
).map(str.encode)  # fmt: skip


def scope(raw_headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {"headers": raw_headers, "query_string": query}


@fuzz_settings(1000)
@given(raw=headers, host=st.none() | st.sampled_from(["127.0.0.1", "::1"]),
       scheme=st.sampled_from(["http", "https", "ws", "wss"]), websocket=st.booleans(),
       keep_auth=st.booleans())  # fmt: skip
def test_forwarded_headers(
    raw: list[tuple[bytes, bytes]], host: str | None, scheme: str, websocket: bool,
    keep_auth: bool,
) -> None:  # fmt: skip
    out = forwarded_request_headers(
        raw, client_host=host, scheme=scheme, websocket=websocket, keep_authorization=keep_auth
    )
    named = [n for n, _ in out]
    connection_tokens = {
        t.strip().lower() for n, v in raw if n == b"connection"
        for t in v.decode("latin-1").split(",")
    }  # fmt: skip
    for name, value in out:
        assert name == name.lower()
        assert name not in HOP_BY_HOP and name != "x-headroom-allow-fallback"
        assert name not in connection_tokens or name in ("x-forwarded-for", "x-forwarded-proto")
        assert "\r" not in value and "\n" not in value
        value.encode("latin-1")  # every value goes back on the wire byte for byte
    assert named.count("x-forwarded-proto") == 1 and named[-1] == "x-forwarded-proto"
    assert named.count("x-forwarded-for") <= 1
    if not keep_auth:
        assert "authorization" not in named
    if websocket:
        assert not any(n.startswith("sec-websocket-") for n in named)


@fuzz_settings(1000)
@given(raw=headers)
def test_response_headers(raw: list[tuple[bytes, bytes]]) -> None:
    out = response_headers(raw)
    for name, _ in out:
        lowered = name.decode("latin-1").lower()
        assert lowered not in HOP_BY_HOP - {"content-length"}


@fuzz_settings(1000)
@given(raw=headers, query=queries)
def test_presented_key_and_fallback_opt_in(raw: list[tuple[bytes, bytes]], query: bytes) -> None:
    request = ClientRequest.of(scope(raw, query))
    key = request.api_key
    assert key is None or (isinstance(key, str) and key != "")
    assert request.allow_fallback in (True, False)


@fuzz_settings(1000)
@given(query=queries, auth=st.booleans())
def test_upstream_query_drops_headrooms_own_parameters(query: bytes, auth: bool) -> None:
    out = ClientRequest.of(scope([], query)).upstream_query(auth=auth)
    own = {"headroom_fallback"} | ({"api_key"} if auth else set())
    assert not own & {k for k, _ in parse_qsl(out, keep_blank_values=True)}
    if not any(k.encode() in query for k in own):
        # unchanged, but for '#' and ' ' escaped so they stay data (see the next test)
        escaped = query.decode("latin-1").replace("#", "%23").replace(" ", "%20")
        assert out == escaped


@fuzz_settings(1000)
@given(query=queries, auth=st.booleans())
def test_upstream_query_makes_a_url_the_upstream_clients_accept(query: bytes, auth: bool) -> None:
    """The relays build ``ws(s)://replica/path?<query>`` (websockets) and
    ``http(s)://replica/path?<query>`` (httpx) from it: both must accept the URL, or the
    session fails inside Headroom (an internal error) instead of reaching the upstream."""
    import httpx

    out = ClientRequest.of(scope([], query)).upstream_query(auth=auth)
    suffix = f"?{out}" if out else ""
    parse_uri("ws://127.0.0.1:8000/v1/realtime" + suffix)
    httpx.URL("http://127.0.0.1:8000/v1/audio/speech" + suffix)


def _forwarded_reference(
    raw: list[tuple[bytes, bytes]], client_host: str | None, scheme: str, websocket: bool,
    keep_authorization: bool, trusted_proxies: tuple[str, ...],
) -> list[tuple[str, str]]:  # fmt: skip
    """forwarded_request_headers as first written (drop sets built per request, the
    Connection tokens read in a pass of their own): the rules, plainly."""
    from proxy.relay.headers import _OWN, _WS_HANDSHAKE, _connection_tokens, is_trusted

    drop = HOP_BY_HOP | _OWN | _connection_tokens(raw)
    if not keep_authorization:
        drop = drop | {"authorization"}
    if websocket:
        drop = drop | _WS_HANDSHAKE
    out: list[tuple[str, str]] = []
    chain: list[str] = []
    given_proto: str | None = None
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
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
        out.append((name, value))
    if client_host:
        chain.append(client_host)
    if chain:
        out.append(("x-forwarded-for", ", ".join(chain)))
    proto = "https" if scheme in ("https", "wss") else "http"
    if given_proto in ("http", "https") and is_trusted(client_host, trusted_proxies):
        proto = given_proto
    out.append(("x-forwarded-proto", proto))
    return out


@fuzz_settings(500)
@given(raw=st.lists(st.tuples(names | st.sampled_from([b"X-Custom", b"Connection"]),
                              values | st.sampled_from([b"x-custom, x-forwarded-for", b"HTTPS"])),
                    max_size=12),
       host=st.none() | st.sampled_from(["127.0.0.1", "10.0.0.9"]),
       scheme=st.sampled_from(["http", "https", "ws", "wss"]), websocket=st.booleans(),
       keep_auth=st.booleans(), trusted=st.sampled_from([(), ("10.0.0.0/8",)]))  # fmt: skip
def test_forwarded_headers_are_the_plain_rules(
    raw: list[tuple[bytes, bytes]], host: str | None, scheme: str, websocket: bool,
    keep_auth: bool, trusted: tuple[str, ...],
) -> None:  # fmt: skip
    """The per-request work is trimmed (drop sets built once, one decode per name), the
    result is exactly the plain algorithm's."""
    got = forwarded_request_headers(
        raw, client_host=host, scheme=scheme, websocket=websocket,
        keep_authorization=keep_auth, trusted_proxies=trusted,
    )  # fmt: skip
    assert got == _forwarded_reference(raw, host, scheme, websocket, keep_auth, trusted)
