"""The issue's run (issue 26, item 8), through a real gateway: with
``X-Headroom-Allow-Fallback: 1`` and a primary that would queue, the session is served
by the idle fallback pool at once, on an injected clock that never moves -- it used to
wait the whole ``max_wait_s`` and get 503 ``queue_timeout``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from proxy.clock import FakeClock
from proxy.settings import settings_from_mapping
from tests.conftest import Proxy
from tests.integration.raw_upstream import raw_upstream
from tests.integration.test_ws_relay import wait_until


def settings(primary: str, fallback: str) -> Any:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "guard": {"mode": "off"},
            "pools": [
                {"name": "main", "replicas": [{"name": "gpu0", "url": primary,
                                               "max_sessions": 1}],
                 "queue": {"max_depth": 4, "max_wait_s": 10},
                 "fallback": {"voice": "lite-1", "pool": "lite"}},
                {"name": "lite", "replicas": [{"name": "cpu0", "url": fallback,
                                               "max_sessions": 1}]},
            ],
            "routes": [{"path": "/v1/stream", "pool": "main", "protocol": "passthrough-http"}],
        },
        env={},
    )  # fmt: skip


async def test_an_opted_in_session_goes_to_the_idle_fallback_without_waiting(
    start_proxy: Any,
) -> None:
    clock = FakeClock()  # never advanced: nothing here may wait for a queue deadline
    async with (
        raw_upstream(mode="stall") as primary,
        raw_upstream(mode="chunks") as fallback,
    ):
        proxy: Proxy = await start_proxy(settings(primary.url, fallback.url), clock)
        async with httpx.AsyncClient(base_url=proxy.http_url, timeout=30) as client:
            held = client.stream("POST", "/v1/stream", content=b"{}")
            first = await held.__aenter__()  # the primary's only slot, streaming
            assert first.status_code == 200
            opted = client.post("/v1/stream", content=b"{}",
                                headers={"X-Headroom-Allow-Fallback": "1"})  # fmt: skip
            response = await asyncio.wait_for(opted, 30)  # a bound, not a timing
            assert response.status_code == 200
            assert response.headers["x-headroom-fallback"] == "lite"
            assert len(fallback.requests) == 1 and len(primary.requests) == 1
            # without the opt-in the same request waits in the primary's queue
            plain = asyncio.ensure_future(client.post("/v1/stream", content=b"{}"))
            await wait_until(lambda: proxy.gate.queued == 1)
            await held.__aexit__(None, None, None)  # the primary's slot frees ...
            primary.mode = "chunks"
            assert (await plain).status_code == 200  # ... and the waiter takes it
        await wait_until(lambda: proxy.gate.active == 0)
