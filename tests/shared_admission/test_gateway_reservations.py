"""Gang reservations through real gateways (uvicorn, real sockets) on both backends: one
in-process gateway, or two gateways sharing a real redis-server, and ``headroom serve
--workers 2`` -- every rule a session keeps (issue 26): the key's quota over every
gateway, the key's class, bounded holds and live reservations, no token-existence
oracle, and a token claimed on any gateway or worker."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.process.serving import RunningServer, running_server
from proxy.settings import Settings, settings_from_mapping
from tests.conftest import Proxy
from tests.integration.upstream import FakeEngine
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation
from tests.shared_admission.test_workers import Served, _wait_ready

RESERVE = "/v1/headroom/reservations"
KEYS = {  # name: (secret, settings)
    "agent": ("agent-secret", {"max_sessions": 3}),
    "gold": ("gold-secret", {"priority": 10}),
    "plain": ("plain-secret", {}),
    "outsider": ("outsider-secret", {"pools": ["main"]}),  # not on tts
}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name][0]}"}


def config(upstream: str, redis_url: str | None, cap: int = 8, **extra: Any) -> dict[str, Any]:
    pools = [
        {"name": name, "replicas": [{"name": "gpu0", "url": upstream, "max_sessions": cap}],
         "queue": {"max_depth": 0, "max_wait_s": 1}, **extra.pop(name, {})}
        for name in ("main", "tts")
    ]  # fmt: skip
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "health": {"recheck_interval_s": 30, "engine_metrics_interval_s": 0},
        "pools": pools,
        "routes": [{"path": "/sse", "pool": "main", "protocol": "passthrough-http"},
                   {"path": "/tts", "pool": "tts", "protocol": "passthrough-http",
                    "upstream_path": "/sse"}],
        "auth": {"keys": [
            {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest(), **fields}
            for name, (secret, fields) in KEYS.items()
        ]},
        **extra,
    }  # fmt: skip
    if redis_url is not None:
        data["admission"] = {
            "backend": "redis",
            "redis": {"url": redis_url, "lease_ttl_s": 10, "renew_interval_s": 2,
                      "fence_margin_s": 1, "timeout_s": 0.5},
        }  # fmt: skip
    return data


def settings(upstream: str, redis_url: str | None, **extra: Any) -> Settings:
    return settings_from_mapping(config(upstream, redis_url, **extra), env={})


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    app = FakeEngine()
    async with running_server(app) as server:
        yield server, app


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[RedisServer | None]:
    """None: one in-process gateway; a redis-server: two gateways sharing it."""
    server = RedisServer() if request.param == "redis" else None
    try:
        yield server
    finally:
        if server is not None:
            server.stop()


async def gateways(start_proxy: Any, upstream: str, redis: RedisServer | None,
                   **extra: Any) -> list[Proxy]:  # fmt: skip
    if redis is None:
        return [await start_proxy(settings(upstream, None, **extra))]
    for pool in ("main", "tts"):
        await seed_generation(redis.url, pool=pool)
    return [await start_proxy(settings(upstream, redis.url, **extra)) for _ in range(2)]


async def reserve(
    client: httpx.AsyncClient, gw: Proxy, key: str, pools: list[str], **body: Any
) -> httpx.Response:
    return await client.post(gw.http_url + RESERVE, json={"pools": pools, **body},
                             headers=auth(key))  # fmt: skip


async def test_reservations_count_against_max_sessions_over_every_gateway(
    start_proxy: Any, upstream: Any, store: RedisServer | None
) -> None:
    """max_sessions 3, reserving alternately on two gateways and claiming each token on
    the other one: 3 sessions, then 429 tenant_limit for a reservation and for a plain
    session, on every gateway."""
    server, app = upstream
    gws = await gateways(start_proxy, server.http_url, store)
    async with httpx.AsyncClient(timeout=30) as client, contextlib.AsyncExitStack() as held:
        chunks = []
        for i in range(3):
            granted = await reserve(client, gws[i % len(gws)], "agent", ["main"], hold_s=30)
            assert granted.status_code == 201, granted.text
            token = granted.json()["token"]
            stage = gws[(i + 1) % len(gws)]  # behind a load balancer: any gateway
            response = await held.enter_async_context(client.stream(
                "POST", stage.http_url + "/sse",
                headers={**auth("agent"), "X-Headroom-Reservation": token},
            ))  # fmt: skip
            assert response.status_code == 200
            chunks.append(response.aiter_raw())
            await anext(chunks[-1])
        for gw in gws:
            refused = await reserve(client, gw, "agent", ["main"], hold_s=30)
            assert refused.status_code == 429, refused.text
            assert refused.headers["x-headroom-reason"] == "tenant_limit"
            assert refused.json()["error"]["stage"] == "main"
            plain = await client.post(gw.http_url + "/sse", headers=auth("agent"))
            assert plain.status_code == 429
        assert sum(gw.gate.active for gw in gws) == 3
        app.controls.release.set()
        for stream in chunks:
            async for _ in stream:
                pass


async def test_a_reservation_takes_its_slots_in_the_keys_class(
    start_proxy: Any, upstream: Any, store: RedisServer | None
) -> None:
    """Only the slot kept for priority >= 10 is free: the priority-10 key's reservation
    gets it, as its plain session would; a class-0 key's is refused pool_full."""
    server, app = upstream
    reserve_gold = {"reserve": [{"priority": 10, "slots": 1}]}
    gws = await gateways(start_proxy, server.http_url, store, cap=2, main=reserve_gold)
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", gws[0].http_url + "/sse", headers=auth("plain")) as plain,
    ):
        chunks = plain.aiter_raw()
        await anext(chunks)  # class 0 holds the one unreserved slot
        refused = await reserve(client, gws[-1], "plain", ["main"])
        assert refused.status_code == 503
        assert refused.headers["x-headroom-reason"] == "pool_full"
        gold = await reserve(client, gws[-1], "gold", ["main"])
        assert gold.status_code == 201, gold.text
        token = gold.json()["token"]
        gone = await client.delete(gws[0].http_url + f"{RESERVE}/{token}",
                                       headers=auth("gold"))  # fmt: skip
        assert gone.status_code == 200 and gone.json()["released"] == ["main"]
        app.controls.release.set()
        async for _ in chunks:
            pass


async def test_hold_s_and_reservations_per_key_are_bounded(
    start_proxy: Any, upstream: Any, store: RedisServer | None
) -> None:
    server, _ = upstream
    limits = {"reservations": {"max_hold_s": 20, "default_hold_s": 2, "max_per_key": 2}}
    gws = await gateways(start_proxy, server.http_url, store, **limits)
    async with httpx.AsyncClient(timeout=30) as client:
        too_long = await reserve(client, gws[0], "plain", ["main"], hold_s=21)
        assert too_long.status_code == 400
        assert "(0, 20]" in too_long.json()["error"]["message"]
        tokens = []
        for i in range(2):
            granted = await reserve(client, gws[i % len(gws)], "plain", ["main"], hold_s=20)
            assert granted.status_code == 201
            tokens.append(granted.json()["token"])
        for gw in gws:
            refused = await reserve(client, gw, "plain", ["main", "tts"], hold_s=20)
            assert refused.status_code == 429
            assert refused.headers["x-headroom-reason"] == "tenant_limit"
        assert (await reserve(client, gws[-1], "gold", ["main"])).status_code == 201
        for token in tokens:
            gone = await client.delete(gws[-1].http_url + f"{RESERVE}/{token}",
                                       headers=auth("plain"))  # fmt: skip
            assert gone.status_code == 200
        again = await reserve(client, gws[0], "plain", ["main"])
        assert again.status_code == 201
    for gw in gws:  # the rest lapse after hold_s (2 s); nothing leaks meanwhile
        gw.runtime.reservations.close()


async def test_delete_with_a_key_that_may_not_use_the_token_is_a_404(
    start_proxy: Any, upstream: Any, store: RedisServer | None
) -> None:
    """No token-existence oracle: another key's DELETE of a live token gets the very
    answer of a token never issued, on every gateway."""
    server, _ = upstream
    gws = await gateways(start_proxy, server.http_url, store)
    async with httpx.AsyncClient(timeout=30) as client:
        granted = await reserve(client, gws[0], "agent", ["tts"])
        token = granted.json()["token"]
        for gw in gws:
            answers = []
            for key in ("outsider", "plain"):
                for tried in (token, "never-issued-token"):
                    r = await client.delete(gw.http_url + f"{RESERVE}/{tried}",
                                            headers=auth(key))  # fmt: skip
                    answers.append((r.status_code, r.content))
            assert answers[0][0] == 404 and len(set(answers)) == 1, answers
        gone = await client.delete(gws[-1].http_url + f"{RESERVE}/{token}",
                                   headers=auth("agent"))  # fmt: skip
        assert gone.status_code == 200 and gone.json()["released"] == ["tts"]


async def test_reserve_then_claim_on_any_worker(tmp_path: Path, upstream: Any) -> None:
    """``serve --workers 2``: every reserve-then-claim cycle succeeds, on new
    connections (each may reach either worker)."""
    server, app = upstream
    app.controls.release.set()  # the stage requests end at once
    redis = RedisServer()
    served: Served | None = None
    try:
        for pool in ("main", "tts"):
            await seed_generation(redis.url, pool=pool)
        path = tmp_path / "workers.yaml"
        path.write_text(yaml.safe_dump(config(server.http_url, redis.url)))
        served = Served(path, workers=2)
        port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
        url = f"http://127.0.0.1:{port}"
        await _wait_ready(url, 2, served)
        fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection each time
        outcomes = []
        async with httpx.AsyncClient(timeout=30, limits=fresh) as client:
            for _ in range(20):
                granted = await client.post(url + RESERVE, json={"pools": ["main", "tts"]},
                                            headers=auth("plain"))  # fmt: skip
                assert granted.status_code == 201, granted.text
                held = {**auth("plain"), "X-Headroom-Reservation": granted.json()["token"]}
                claims = await asyncio.gather(
                    client.post(url + "/sse", headers=held), client.post(url + "/tts", headers=held)
                )
                outcomes.append(tuple(c.status_code for c in claims))
        assert outcomes == [(200, 200)] * 20
    finally:
        if served is not None:
            served.stop()
        redis.stop()
