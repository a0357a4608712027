"""Hostile HTTP requests against a live proxy: random header bytes and query strings on a
streaming route, malformed bodies, and bytes that are not HTTP.

Every request gets an answer that is not a 500 (the upstream's answer relayed, or one of
Headroom's contract errors: 4xx for the client's mistakes, 502/503 with the JSON body),
the slot comes back, and a normal session still works afterwards.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsraw import handshake_request, read_head, read_http_body

from tests.fuzz.conftest import ROUTES, Live, fuzz_settings, normal_session

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
SPEECH = json.dumps({"input": "Hi.", "stream": True, "response_format": "pcm"}).encode()

header_names = st.one_of(
    st.sampled_from([b"x-custom", b"user-agent", b"authorization", b"x-forwarded-for",
                     b"x-headroom-allow-fallback", b"accept", b"cookie", b"te", b"connection",
                     b"x-request-id", b"content-type"]),
    st.text(alphabet=TOKEN, min_size=1, max_size=10).map(lambda t: b"x-" + t.encode()),
)  # fmt: skip
header_values = st.binary(max_size=30).map(
    lambda b: bytes(c for c in b if c not in (0, 10, 13)).strip(b" \t")
)
query_chars = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")
queries = st.text(alphabet=query_chars, max_size=40)


async def request(live: Live, raw: bytes) -> tuple[int | None, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(read_head(reader), 30)
        if head is None:
            return None, b""
        if raw.startswith(b"HEAD ") or head.status == 101:
            return head.status, b""  # no body follows
        body, _ = await asyncio.wait_for(read_http_body(reader, head), 30)
        return head.status, body
    except (ConnectionError, OSError):
        return None, b""
    finally:
        writer.close()


def check(status: int | None, body: bytes) -> None:
    assert status != 500, body[:200]
    if status in (502, 503, 429) and body:
        error = json.loads(body)["error"]
        assert error["type"] and error["message"]


@fuzz_settings(80)
@given(
    headers=st.lists(st.tuples(header_names, header_values), max_size=8),
    query=queries,
)
async def test_random_headers_and_query_on_a_streaming_route(
    live: Live, headers: list[tuple[bytes, bytes]], query: str
) -> None:
    lines = [b"POST " + ROUTES["http"].encode() + (b"?" + query.encode() if query else b"")
             + b" HTTP/1.1", b"Host: 127.0.0.1"]  # fmt: skip
    lines += [name + b": " + value for name, value in headers]
    lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(SPEECH)]
    status, body = await request(live, b"\r\n".join(lines) + b"\r\n\r\n" + SPEECH)
    check(status, body)
    await live.settled()


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nnot json!",
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n[1,2]",
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n"
        + b"{" * 70000,  # over max_http_body_bytes (64 KiB here): 413
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\n{\"inp\r\nZZ\r\n",  # a broken chunk size
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # both lengths: smuggling shape
        b"GET /v1/audio/speech HTTP/1.1\r\nHost: x\r\n\r\n",  # wrong method, relayed
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json; "
        b"charset=utf-16\r\nContent-Length: 4\r\n\r\n\xff\xfe{\x00",
        b"\x00\x01\x02\x03 / HTTP/1.1\r\n\r\n",
        b"POST /v1/audio/speech HTTP/9.9\r\nHost: x\r\n\r\n",
        b"POST " + b"/v1/audio/speech?" + b"a=" * 30000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["not-json", "json-array", "too-large", "bad-chunk", "cl-and-te", "get",
         "negative-length", "utf16", "binary-line", "http-9.9", "huge-query"],
)  # fmt: skip
async def test_malformed_requests_get_an_answer_that_is_not_a_500(live: Live, raw: bytes) -> None:
    status, body = await request(live, raw)
    check(status, body)
    await live.settled()
    await normal_session(live.port)


OPS_PATHS = {"/healthz", "/readyz", "/ping", "/metrics"}
path_chars = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "?#")
targets = st.one_of(
    st.text(alphabet=path_chars, max_size=40).map(lambda p: "/" + p),
    st.sampled_from(list(ROUTES.values())).flatmap(
        lambda r: st.sampled_from([r + "/", r.upper(), "/" + r, r + "%2F", r + "/..",
                                   r.replace("/", "//"), r + ";x", "/.." + r])
    ),
)  # fmt: skip


@fuzz_settings(80)
@given(
    target=targets,
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"]),
    upgrade=st.booleans(),
)
async def test_routing_is_exact_and_unknown_paths_are_404(
    live: Live, target: str, method: str, upgrade: bool
) -> None:
    """Routes are an exact path match: a path that is not one of them (however close) is
    answered by the operations app (404 for an unknown path), never relayed and never a
    500; a WebSocket to an unknown path is denied."""
    if upgrade:
        raw = handshake_request(target)
    else:
        raw = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(SPEECH)}\r\n\r\n").encode() + SPEECH  # fmt: skip
    status, body = await request(live, raw)
    check(status, body)
    if status is not None and target not in {*ROUTES.values(), *OPS_PATHS}:
        assert status in (400, 404, 405), (target, status)
    await live.settled()
