"""``/readyz`` follows the ``readiness`` setting: with ``upstream`` (the default) it
reflects whether the admission backend and the replicas can take a session; with
``self`` (a gateway Deployment) it is ready while this process serves, so refusals reach
clients, and the upstream's state shows beside it.

At start-up it reflects whether the replicas can be reached, before any
client has failed on them (issue 14, item 8): every replica's TCP port is checked once
at start-up (:meth:`proxy.upstreams.Upstreams.check_replicas`), a refusing one is ejected
and left to the background health re-check, and readiness waits for the check.

Upstreams are real sockets on 127.0.0.1 port 0; a "dead" one is a port that was bound
and closed (connections are refused).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from proxy.process.admin import create_admin_app
from proxy.process.serving import bind_socket, running_server
from proxy.runtime import Runtime
from tests.conftest import Proxy, proxy_settings
from tests.integration.upstream import FakeEngine
from tests.redis_support import RedisServer


def dead_url() -> str:
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def route() -> dict[str, Any]:
    return {"path": "/ws", "pool": "main", "protocol": "passthrough-ws"}


async def readyz(proxy: Proxy) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(proxy.http_url + "/readyz")


async def test_every_replica_dead_is_not_ready_before_any_client(start_proxy: Any) -> None:
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", dead_url(), 2), ("gpu1", dead_url(), 2)], [route()])
    )
    answer = await readyz(proxy)
    assert answer.status_code == 503
    assert answer.json()["reason"] == "no healthy replica"


async def test_a_dead_replica_is_ejected_at_start_up_and_a_live_one_keeps_it_ready(
    start_proxy: Any,
) -> None:
    async with running_server(FakeEngine()) as server:
        proxy: Proxy = await start_proxy(
            proxy_settings([("dead", dead_url(), 2), ("live", server.http_url, 2)], [route()])
        )
        healthy = {r.name: r.healthy for r in proxy.gate.statistics()["main"].replicas}
        assert healthy == {"dead": False, "live": True}
        answer = await readyz(proxy)
        assert answer.status_code == 200 and answer.json()["ready"] is True


async def test_not_ready_until_the_check_has_run() -> None:
    rt = Runtime(proxy_settings([("gpu0", dead_url(), 2)], [route()]))
    await rt.start()
    try:
        assert rt.ready() == (False, "checking replicas")  # the check has not run yet
        await rt.replicas_checked.wait()
        assert rt.ready() == (False, "no healthy replica")
    finally:
        await rt.stop()


# -- readiness: self | upstream ---------------------------------------------------------


async def test_a_gateway_ready_on_itself_answers_refusals_when_every_replica_is_down(
    start_proxy: Any,
) -> None:
    # The gateway Deployments' setting: the pod stays in its Service, so clients get the
    # documented refusal (503 no_healthy_replica, Retry-After) rather than no endpoint.
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", dead_url(), 2), ("gpu1", dead_url(), 2)], [route()], readiness="self"
        )
    )
    answer = await readyz(proxy)
    assert answer.status_code == 200
    body = answer.json()
    assert body["ready"] is True and body["readiness"] == "self"
    assert body["reason"] == "ready; upstream: no healthy replica"
    assert body["upstream"] == {"ready": False, "reason": "no healthy replica"}
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/ws", compression=None)
    refused = info.value.response
    assert refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert json.loads(refused.body)["error"]["code"] == "no_healthy_replica"
    assert proxy.gate.active == 0 and proxy.gate.queued == 0


async def test_upstream_readiness_is_the_default_and_keeps_the_pod_out(
    start_proxy: Any,
) -> None:
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", dead_url(), 2)], [route()]))
    answer = await readyz(proxy)
    assert answer.status_code == 503
    assert answer.json()["readiness"] == "upstream"
    assert answer.json()["upstream"] == {"ready": False, "reason": "no healthy replica"}


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("readiness", ["self", "upstream"])
async def test_readyz_says_when_admission_grants_are_blocked_after_a_data_loss(
    redis: RedisServer, readiness: str
) -> None:
    # A brand-new (or flushed) Redis starts a new generation: grants are blocked for one
    # lease TTL while surviving gateways re-assert their sessions. A TTL far longer than
    # the test keeps the block in force throughout.
    async with running_server(FakeEngine()) as engine:
        settings = proxy_settings(
            [("gpu0", engine.http_url, 2)],
            [route()],
            readiness=readiness,
            admission={
                "backend": "redis",
                "redis": {"url": redis.url, "lease_ttl_s": 300, "renew_interval_s": 2},
            },
        )
        rt = Runtime(settings)
        await rt.start()
        try:
            await rt.replicas_checked.wait()
            await rt.gate.renew()  # one renewal tick sees the new generation
            ready, why = rt.ready()
            assert "admission grants blocked for" in why
            assert "lost its data" in why
            assert ready is (readiness == "self")
            upstream, upstream_why = rt.upstream_ready()
            assert upstream is False and upstream_why.startswith("admission grants blocked")
            status = await status_of(rt)
            assert status["upstream"]["ready"] is False
        finally:
            await rt.stop()


async def status_of(rt: Runtime) -> dict[str, Any]:
    """``GET /admin/status`` of ``rt``, served from the admin app on a real socket."""

    def reload() -> Any:
        raise AssertionError("not reloaded here")

    admin_app = create_admin_app(rt, reload, lambda: None)
    async with running_server(admin_app) as admin, httpx.AsyncClient() as client:
        answer = await client.get(admin.http_url + "/admin/status")
    assert answer.status_code == 200
    body: dict[str, Any] = answer.json()
    return body
