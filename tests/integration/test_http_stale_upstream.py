"""An upstream that closes a kept-alive connection as the next request arrives, without
answering it (llama.cpp's server does this after streamed responses): the relay sends
the request again on a fresh connection instead of failing the session with 502."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import proxy_settings
from tests.integration.raw_upstream import raw_upstream


async def test_a_request_the_upstream_closed_unanswered_is_sent_again(start_proxy: Any) -> None:
    async with raw_upstream(close_reused=True, content_type="text/event-stream",
                            chunks=[b"data: {}\n\n"]) as upstream:  # fmt: skip
        route = {"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"}
        proxy = await start_proxy(proxy_settings([("gpu0", upstream.url, 2)], [route]))
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            for _ in range(4):
                response = await client.post("/v1/stream", json={})
                assert response.status_code == 200, response.text
                assert response.content == b"data: {}\n\n"
        # every request after the first on a connection went out twice: once on the
        # kept-alive connection (closed unanswered), once on a fresh one
        assert upstream.unanswered >= 1
        assert len(upstream.requests) == 4 + upstream.unanswered
