"""proxy.client_request: one session's request head, read once."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.admission.reservation_requests import ReservationMalformed, reservation_token
from proxy.client_request import ClientRequest


def scope(headers: list[tuple[bytes, bytes]], query: bytes = b"") -> dict[str, Any]:
    return {"type": "websocket", "path": "/ws", "headers": headers, "query_string": query}


def test_the_bearer_header_wins_over_the_query_key() -> None:
    request = ClientRequest.of(
        scope([(b"authorization", b"Basic x"), (b"authorization", b"Bearer  k1 ")], b"api_key=k2")
    )
    assert request.api_key == "k1"
    assert ClientRequest.of(scope([], b"api_key=&api_key=k2")).api_key == "k2"
    assert ClientRequest.of(scope([(b"authorization", b"Bearer ")])).api_key is None


def test_the_fallback_opt_in_header_first_then_the_query() -> None:
    assert ClientRequest.of(scope([(b"X-Headroom-Allow-Fallback", b" YES ")])).allow_fallback
    assert not ClientRequest.of(
        scope([(b"x-headroom-allow-fallback", b"0")], b"headroom_fallback=1")
    ).allow_fallback
    assert ClientRequest.of(scope([], b"headroom_fallback=true")).allow_fallback
    assert not ClientRequest.of(scope([])).allow_fallback


def test_reservation_tokens_from_headers_and_query_must_agree() -> None:
    one = ClientRequest.of(
        scope([(b"x-headroom-reservation", b" t1 ")], b"headroom_reservation=t1")
    )
    assert reservation_token(one) == "t1"
    assert reservation_token(ClientRequest.of(scope([]))) is None
    two = ClientRequest.of(scope([(b"x-headroom-reservation", b"t1")], b"headroom_reservation=t2"))
    with pytest.raises(ReservationMalformed):
        reservation_token(two)
    with pytest.raises(ReservationMalformed):
        reservation_token(ClientRequest.of(scope([], b"headroom_reservation=%20")))


@pytest.mark.parametrize(
    ("query", "auth", "onward"),
    [
        (b"voice=a&format=pcm", False, "voice=a&format=pcm"),
        (b"voice=a&api_key=k&headroom_fallback=1", False, "voice=a&api_key=k"),
        (b"voice=a&api_key=k&headroom_fallback=1", True, "voice=a"),
        (b"voice=a&api_key=k", False, "voice=a&api_key=k"),
        (b"voice=a&api_key=k", True, "voice=a"),
        (b"text=a b#c", False, "text=a%20b%23c"),
        (b"headroom_reservation=t&x=", True, "x="),
        (b"", True, ""),
    ],
)
def test_the_upstream_query_drops_headrooms_own_parameters(
    query: bytes, auth: bool, onward: str
) -> None:
    assert ClientRequest.of(scope([], query)).upstream_query(auth=auth) == onward


def test_the_content_type_and_the_query_pairs() -> None:
    headers = [(b"Content-Type", b"application/json"), (b"content-type", b"text/plain")]
    request = ClientRequest.of(scope(headers, b"a=1&b=&a=2"))
    assert request.content_type == "application/json"
    assert request.query == (("a", "1"), ("b", ""), ("a", "2"))
