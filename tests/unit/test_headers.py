"""Forwarding headers (issue 14 item 13): X-Forwarded-For carries the TCP peer exactly
once after the client's own chain; X-Forwarded-Proto is believed only from a peer in
``forwarded.trusted_proxies``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proxy.relay.headers import forwarded_request_headers, is_trusted
from proxy.settings import ForwardedSettings


def forwarded(raw: list[tuple[bytes, bytes]], host: str | None = "10.1.2.3",
              scheme: str = "http", trusted: tuple[str, ...] = ()) -> dict[str, str]:  # fmt: skip
    out = forwarded_request_headers(
        raw, client_host=host, scheme=scheme, websocket=False, trusted_proxies=trusted
    )
    names = [n for n, _ in out]
    assert names.count("x-forwarded-for") <= 1 and names.count("x-forwarded-proto") == 1
    return dict(out)


def test_the_peer_is_appended_once_after_the_clients_chain() -> None:
    assert forwarded([])["x-forwarded-for"] == "10.1.2.3"
    raw = [(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b" 7.7.7.7, 8.8.8.8 ")]
    assert forwarded(raw)["x-forwarded-for"] == "6.6.6.6, 7.7.7.7, 8.8.8.8, 10.1.2.3"
    # a loopback peer is not special: it is appended once, like any other
    got = forwarded([(b"x-forwarded-for", b"6.6.6.6")], host="127.0.0.1")
    assert got["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
    assert forwarded([(b"x-forwarded-for", b"  ")])["x-forwarded-for"] == "10.1.2.3"
    # no peer known (a Unix socket): the client's chain as it came, nothing invented
    assert forwarded([(b"x-forwarded-for", b"6.6.6.6")], host=None)["x-forwarded-for"] == (
        "6.6.6.6"
    )
    assert "x-forwarded-for" not in forwarded([], host=None)


def test_forwarded_proto_is_the_peers_word_only_when_trusted() -> None:
    https = [(b"x-forwarded-proto", b"HTTPS")]
    assert forwarded(https)["x-forwarded-proto"] == "http"  # untrusted: our own scheme
    assert forwarded(https, trusted=("10.0.0.0/8",))["x-forwarded-proto"] == "https"
    assert forwarded(https, trusted=("10.1.2.4",))["x-forwarded-proto"] == "http"
    # only http or https is believed, even from a trusted peer
    odd = [(b"x-forwarded-proto", b"gopher")]
    assert forwarded(odd, trusted=("10.0.0.0/8",))["x-forwarded-proto"] == "http"
    # without a header, the scheme the client used to reach Headroom
    assert forwarded([], scheme="wss")["x-forwarded-proto"] == "https"


def test_is_trusted() -> None:
    assert is_trusted("10.1.2.3", ["10.0.0.0/8"])
    assert is_trusted("10.1.2.3", ["192.168.0.1", "10.1.2.3"])
    assert is_trusted("::1", ["::1/128"])
    assert is_trusted("fd00::7", ["fd00::/8"])
    assert not is_trusted("10.1.2.3", [])
    assert not is_trusted("11.0.0.1", ["10.0.0.0/8"])
    assert not is_trusted("::ffff:1", ["10.0.0.0/8"])
    assert not is_trusted(None, ["10.0.0.0/8"])
    assert not is_trusted("not-an-address", ["10.0.0.0/8"])


def test_trusted_proxies_are_checked_in_configuration() -> None:
    settings = ForwardedSettings(trusted_proxies=(" 10.0.0.0/8", "::1", "192.168.1.7"))
    assert settings.trusted_proxies == ("10.0.0.0/8", "::1/128", "192.168.1.7/32")
    assert ForwardedSettings().trusted_proxies == ()  # nobody trusted by default
    with pytest.raises(ValidationError, match="IP address or network"):
        ForwardedSettings(trusted_proxies=("lb.internal",))
    with pytest.raises(ValidationError, match="IP address or network"):
        ForwardedSettings(trusted_proxies=("10.0.0.1/8",))  # host bits set: a typo
