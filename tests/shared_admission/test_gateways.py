"""Several real gateways (uvicorn, real sockets) sharing one real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from proxy.process.serving import RunningServer, running_server
from proxy.settings import Settings
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import wait_until
from tests.integration.upstream import FakeEngine
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    app = FakeEngine()
    async with running_server(app) as server:
        yield server, app


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def shared_settings(
    url: str, redis_url: str, cap: int = 1, queue: dict[str, Any] | None = None, **admission: Any
) -> Settings:
    redis_options = {
        "url": redis_url, "lease_ttl_s": 10, "renew_interval_s": 2, "fence_margin_s": 1,
        "timeout_s": 0.5, **admission.pop("redis", {}),
    }  # fmt: skip
    return proxy_settings(
        [("gpu0", url, cap)],
        [{"path": "/sse", "pool": "main", "protocol": "passthrough-http"}],
        queue=queue,
        admission={"backend": "redis", "redis": redis_options, **admission},
    )


async def test_two_gateways_hold_one_cap_and_hand_the_slot_over(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    server, app = upstream
    await seed_generation(redis.url, pool="main")
    a: Proxy = await start_proxy(shared_settings(server.http_url, redis.url))
    b: Proxy = await start_proxy(shared_settings(server.http_url, redis.url))
    async with httpx.AsyncClient() as client:
        assert (await client.get(b.http_url + "/readyz")).status_code == 200
        async with client.stream("POST", a.http_url + "/sse") as held:
            chunks = held.aiter_raw()
            await anext(chunks)
            refused = await client.post(b.http_url + "/sse")
            assert refused.status_code == 503
            assert refused.headers["x-headroom-reason"] == "pool_full"
            app.controls.release.set()
            async for _ in chunks:
                pass
        await wait_until(lambda: a.gate.active == 0)
        await a.gate.quiesce()  # the release has reached Redis
        admitted = await client.post(b.http_url + "/sse")
        assert admitted.status_code == 200


async def test_a_request_queued_on_one_gateway_gets_the_slot_another_frees(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    server, app = upstream
    await seed_generation(redis.url, pool="main")
    queue = {"max_depth": 4, "max_wait_s": 30}
    a: Proxy = await start_proxy(shared_settings(server.http_url, redis.url, queue=queue))
    b: Proxy = await start_proxy(shared_settings(server.http_url, redis.url, queue=queue))
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", a.http_url + "/sse") as held:
            chunks = held.aiter_raw()
            await anext(chunks)
            queued = asyncio.create_task(client.post(b.http_url + "/sse"))
            await wait_until(lambda: b.gate.queued == 1)
            assert not queued.done()
            await a.gate.renew()  # reads the pool-wide figures from Redis
            metrics = (await client.get(a.http_url + "/metrics")).text
            held = 'headroom_shared_sessions_active{pool="main",replica="gpu0",scope="pool"} 1.0'
            assert held in metrics
            assert 'headroom_shared_queue_depth{pool="main",scope="pool"} 1.0' in metrics
            assert 'headroom_sessions_active{pool="main",replica="gpu0"} 1.0' in metrics
            app.controls.release.set()  # the held stream ends; its slot goes to b's waiter
            async for _ in chunks:
                pass
        response = await queued
        assert response.status_code == 200
    assert b.metric("headroom_session_decisions_total", pool="main", decision="queued") == 1


async def test_redis_down_refuses_backend_unavailable_and_fails_readyz(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    gw: Proxy = await start_proxy(shared_settings(server.http_url, redis.url))
    redis.stop()
    async with httpx.AsyncClient() as client:
        refused = await client.post(gw.http_url + "/sse")
        assert refused.status_code == 503
        assert refused.headers["x-headroom-reason"] == "backend_unavailable"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "backend_unavailable"
        ready = await client.get(gw.http_url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["reason"] == "admission backend unavailable"
        assert gw.metric("headroom_admission_backend_up", backend="redis") == 0
        assert gw.metric("headroom_session_decisions_total", pool="main",
                         decision="rejected_backend_unavailable") == 1  # fmt: skip


async def test_a_gateway_cut_off_from_redis_closes_its_sessions_before_its_leases_lapse(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    settings = shared_settings(
        server.http_url, redis.url,
        redis={"lease_ttl_s": 1, "renew_interval_s": 0.2, "fence_margin_s": 0.4,
               "timeout_s": 0.1},
    )  # fmt: skip
    gw: Proxy = await start_proxy(settings)
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", gw.http_url + "/sse") as held:
            chunks = held.aiter_raw()
            await anext(chunks)
            assert gw.gate.active == 1
            redis.stop()  # renewals fail from now on
            with pytest.raises(httpx.HTTPError):
                async for _ in chunks:  # ended by the gateway, not the upstream
                    pass
        await wait_until(lambda: gw.gate.active == 0)
    assert gw.metric("headroom_lease_loss_closes_total", pool="main") >= 1
