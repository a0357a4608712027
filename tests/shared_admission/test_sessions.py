"""Sessions through real gateways on a real redis-server: a fence ends only the sessions
of the pool whose leases were lost (issue 15 item 3); tenant quotas hold over every
gateway, with the same test on both backends (item 4); failover before the first byte
moves the lease through Redis (item 5)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.process.serving import bind_socket
from proxy.settings import Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.test_ws_relay import hello, upstream, wait_until
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

__all__ = ["upstream"]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def two_pool_settings(
    url: str,
    redis_url: str | None,
    *,
    cap: int = 4,
    extra_replica: str | None = None,
    max_sessions: int | None = None,
) -> Settings:
    main = [{"name": "gpu0", "url": url, "max_sessions": cap}]
    if extra_replica is not None:
        main.insert(0, {"name": "dead", "url": extra_replica, "max_sessions": cap})
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "health": {"recheck_interval_s": 60, "engine_metrics_interval_s": 0},
        "pools": [
            {"name": "main", "replicas": main, "queue": {"max_depth": 0, "max_wait_s": 5}},
            {"name": "other", "replicas": [{"name": "gpu9", "url": url, "max_sessions": cap}],
             "queue": {"max_depth": 0, "max_wait_s": 5}},
        ],
        "routes": [
            {"path": "/ws/echo", "pool": "main", "protocol": "passthrough-ws"},
            {"path": "/other", "pool": "other", "protocol": "passthrough-ws"},
        ],
    }  # fmt: skip
    if max_sessions is not None:
        data["auth"] = {"keys": [
            {"name": "team-a", "sha256": sha("key-a"), "max_sessions": max_sessions},
        ]}  # fmt: skip
    if redis_url is not None:
        data["admission"] = {
            "backend": "redis",
            "redis": {"url": redis_url, "lease_ttl_s": 10, "renew_interval_s": 2,
                      "fence_margin_s": 1, "timeout_s": 0.5},
        }  # fmt: skip
    return settings_from_mapping(data, env={})


async def _open(proxy: Proxy, path: str, key: str | None = None) -> ClientConnection:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ws = await connect(proxy.ws_url + path, additional_headers=headers, compression=None)
    await hello(ws)
    return ws


# --- item 3: a fence ends only the sessions of its pool -------------------------------


async def test_a_fence_ends_only_the_sessions_of_the_pool_whose_leases_were_lost(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    await seed_generation(redis.url, pool="other")
    gw: Proxy = await start_proxy(two_pool_settings(server.http_url, redis.url))
    main = await _open(gw, "/ws/echo")
    other = await _open(gw, "/other")
    assert gw.gate.active == 2
    # The main pool's lease vanishes from Redis (as after a pause past its TTL): the next
    # renewal of that pool finds it gone and fences the pool.
    client = aioredis.from_url(redis.url)
    await client.delete("headroom:{main}:leases", "headroom:{main}:owner")
    await client.aclose()
    await gw.gate.renew()
    with pytest.raises(ConnectionClosed) as closed:
        await main.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    # The other pool renewed fine: its session goes on.
    await other.send("still here")
    assert await other.recv() == "still here"
    assert gw.metric("headroom_lease_loss_closes_total", pool="main") == 1
    assert gw.metric("headroom_lease_loss_closes_total", pool="other") == 0
    await other.close()
    await wait_until(lambda: gw.gate.active == 0)


# --- item 4: tenant quotas over every gateway, both backends --------------------------


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_tenant_quota_holds_over_pools_and_gateways(
    start_proxy: Any, upstream: Any, kind: str
) -> None:
    """max_sessions 2: two sessions (two pools; with redis, two gateways) fill it, a third
    is refused 429 tenant_limit on either gateway; one ends, and one more fits."""
    server, _ = upstream
    store = RedisServer() if kind == "redis" else None
    try:
        url = store.url if store is not None else None
        if url is not None:
            await seed_generation(url, pool="main")
            await seed_generation(url, pool="other")
        a: Proxy = await start_proxy(two_pool_settings(server.http_url, url, max_sessions=2))
        b: Proxy = (
            await start_proxy(two_pool_settings(server.http_url, url, max_sessions=2))
            if url is not None else a
        )  # fmt: skip
        first = await _open(a, "/ws/echo", "key-a")
        second = await _open(b, "/other", "key-a")
        for gw, path in ((a, "/ws/echo"), (b, "/ws/echo"), (a, "/other")):
            with pytest.raises(InvalidStatus) as info:
                await _open(gw, path, "key-a")
            assert info.value.response.status_code == 429
            assert info.value.response.headers["X-Headroom-Reason"] == "tenant_limit"
        await second.close()
        await wait_until(lambda: b.gate.active == (1 if b is a else 0))
        if url is not None:
            await b.gate.quiesce()  # the release has reached Redis
        third = await _open(a, "/ws/echo", "key-a")
        await third.close()
        await first.close()
        await wait_until(lambda: a.gate.active == 0)
        for gw in {id(a): a, id(b): b}.values():
            if url is not None:
                await gw.gate.quiesce()
        refused = sum(
            gw.metric("headroom_session_decisions_total", pool=pool,
                      decision="rejected_tenant_limit")
            for gw in {id(a): a, id(b): b}.values() for pool in ("main", "other")
        )  # fmt: skip
        assert refused == 3
        if store is not None:
            assert await a.gate.backend.tenant_active("team-a") == 0
    finally:
        if store is not None:
            store.stop()


# --- item 5: failover before the first byte moves the lease ---------------------------


async def test_failover_before_the_first_byte_moves_the_lease_in_redis(
    start_proxy: Any, upstream: Any, redis: RedisServer
) -> None:
    """Replica 'dead' (first in order, so picked first) refuses connections: the session
    fails over to gpu0 and the lease in Redis moves with it, so the pool-wide counts
    are right for every gateway."""
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    dying = bind_socket()  # listening through the start-up check, refusing after it
    dead = f"http://127.0.0.1:{dying.getsockname()[1]}"
    gw: Proxy = await start_proxy(
        two_pool_settings(server.http_url, redis.url, cap=1, extra_replica=dead)
    )
    await gw.runtime.replicas_checked.wait()
    dying.close()
    ws = await _open(gw, "/ws/echo")
    client = aioredis.from_url(redis.url, decode_responses=True)
    try:
        owners = await client.hgetall("headroom:{main}:owner")
        assert list(owners.values()) == ["gpu0"]
        held = await client.hgetall("headroom:{main}:held")
        assert int(held.get("dead", 0)) == 0 and int(held["gpu0"]) == 1
        await ws.close()
        await wait_until(lambda: gw.gate.active == 0)
        await gw.gate.quiesce()
        held = await client.hgetall("headroom:{main}:held")
        assert int(held.get("dead", 0)) == 0 and int(held["gpu0"]) == 0
    finally:
        await client.aclose()
