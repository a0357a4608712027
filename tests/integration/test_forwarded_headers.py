"""``Forwarded`` and ``X-Real-IP`` follow the trusted-proxy rules of ``X-Forwarded-For``
and ``X-Forwarded-Proto`` (issue 26, item 8), over real sockets, HTTP and WebSocket.

From an untrusted peer: ``Forwarded`` keeps the client's elements and gets Headroom's
own ``for=<peer>;proto=<scheme>`` appended once (as the peer is appended to
``X-Forwarded-For``); ``X-Real-IP`` becomes the peer (as ``X-Forwarded-Proto`` becomes
Headroom's own scheme). From a trusted proxy, ``X-Real-IP`` is kept. A request without
them gets neither.
"""

from __future__ import annotations

from typing import Any

import pytest
from websockets.asyncio.client import connect

from proxy.relay.headers import forwarded_request_headers
from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import raw_upstream
from tests.integration.test_http_hardening import raw_request
from tests.integration.test_ws_relay import hello, upstream

__all__ = ["upstream"]

SPOOFED = (b"forwarded: for=6.6.6.6;proto=https\r\nforwarded: for=7.7.7.7\r\n"
           b"x-real-ip: 6.6.6.6\r\n")  # fmt: skip


def settings(url: str, **top: Any) -> Any:
    return proxy_settings(
        [("gpu0", url, 2)],
        [{"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"}], **top
    )  # fmt: skip


async def relayed(proxy: Proxy, extra: bytes) -> dict[str, str]:
    got = await raw_request(proxy.server.port, b"POST /v1/stream HTTP/1.1\r\nhost: x\r\n"
                            + extra + b"content-length: 0\r\n\r\n")  # fmt: skip
    return dict(got["headers"])


async def test_an_untrusted_peer_cannot_name_the_client(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as up:
        proxy: Proxy = await start_proxy(settings(up.url))  # default: nobody trusted
        got = await relayed(proxy, SPOOFED)
        assert got["forwarded"] == "for=6.6.6.6;proto=https, for=7.7.7.7, for=127.0.0.1;proto=http"
        assert got["x-real-ip"] == "127.0.0.1"  # the peer, not the client's claim
        plain = await relayed(proxy, b"")
        assert "forwarded" not in plain and "x-real-ip" not in plain  # never added


async def test_a_trusted_proxy_names_the_client(start_proxy: Any) -> None:
    async with raw_upstream(mode="echo") as up:
        proxy: Proxy = await start_proxy(
            settings(up.url, forwarded={"trusted_proxies": ["127.0.0.0/8"]})
        )
        got = await relayed(proxy, SPOOFED)
    assert got["x-real-ip"] == "6.6.6.6"  # the proxy's word
    assert got["forwarded"].endswith(", for=127.0.0.1;proto=http")  # the hop, once


async def test_a_websocket_upstream_gets_the_same(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 2)],
                       [{"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"}])
    )  # fmt: skip
    sent = {"Forwarded": "for=6.6.6.6", "X-Real-IP": "6.6.6.6"}
    async with connect(proxy.ws_url + "/ws/echo", additional_headers=sent,
                       compression=None) as client:  # fmt: skip
        seen = {k.lower(): v for k, v in dict((await hello(client))["headers"]).items()}
    assert seen["forwarded"] == "for=6.6.6.6, for=127.0.0.1;proto=http"
    assert seen["x-real-ip"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("peer", "element"),
    [("::1", 'for="[::1]";proto=https'), (None, "for=unknown;proto=https")],
)
def test_the_appended_element_quotes_ipv6_and_names_an_unknown_peer(
    peer: str | None, element: str
) -> None:
    headers = dict(forwarded_request_headers(
        [(b"forwarded", b"for=1.2.3.4")], client_host=peer, scheme="https", websocket=False,
    ))  # fmt: skip
    assert headers["forwarded"] == f"for=1.2.3.4, {element}"
