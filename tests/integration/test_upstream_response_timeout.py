"""An HTTP upstream that accepts the connection and never answers holds the slot only
until ``limits.upstream_response_timeout_s`` (issue 26, item 8), not ``idle_timeout_s``:
then 504 ``upstream_timeout``, the upstream request closed and the slot released. Over
real sockets with a raw upstream, on the injected clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from proxy.clock import FakeClock
from tests.conftest import Proxy, proxy_settings
from tests.integration.raw_upstream import raw_upstream
from tests.integration.test_http_hardening import captured, session_fields
from tests.integration.test_ws_relay import wait_until


@pytest.mark.parametrize("idle_timeout_s", [300, 0])  # far off, and turned off
async def test_a_silent_upstream_is_given_up_at_the_response_timeout(
    start_proxy: Any, idle_timeout_s: float
) -> None:
    clock = FakeClock()
    async with raw_upstream(mode="never") as upstream:
        limits = {"idle_timeout_s": idle_timeout_s, "upstream_response_timeout_s": 5}
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", upstream.url, 1)],
                           [{"path": "/v1/stream", "pool": "main",
                             "protocol": "passthrough-http"}], limits=limits),
            clock,
        )  # fmt: skip
        with captured("headroom.session") as log:
            async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
                pending = asyncio.ensure_future(client.post("/v1/stream", content=b"{}"))
                await wait_until(lambda: len(upstream.requests) == 1)  # sent, unanswered
                clock.advance(4.9)
                await asyncio.sleep(0.05)
                assert not pending.done() and proxy.gate.active == 1  # not yet
                clock.advance(0.2)
                response = await pending
            await wait_until(lambda: bool(log))
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["code"] == "upstream_timeout"
        assert "no response head within 5 s" in error["message"]
        await wait_until(lambda: proxy.gate.active == 0 and upstream.closed == 1)
        assert session_fields(log)["decision"] == "upstream_failed"
        assert proxy.metric("headroom_upstream_errors_total", pool="main", replica="gpu0",
                            kind="timeout") == 1  # fmt: skip


async def test_a_response_that_started_is_not_cut_by_it(start_proxy: Any) -> None:
    clock = FakeClock()
    async with raw_upstream(mode="stall") as upstream:  # the head and a chunk, then silence
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", upstream.url, 1)],
                           [{"path": "/v1/stream", "pool": "main",
                             "protocol": "passthrough-http"}],
                           limits={"idle_timeout_s": 0, "upstream_response_timeout_s": 5}),
            clock,
        )  # fmt: skip
        async with (
            httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client,
            client.stream("POST", "/v1/stream", content=b"{}") as response,
        ):
            assert response.status_code == 200
            chunks = response.aiter_raw()
            await anext(chunks)
            clock.advance(60)
            await asyncio.sleep(0.05)
            assert proxy.gate.active == 1  # still streaming: only the head was timed
        await wait_until(lambda: proxy.gate.active == 0)
