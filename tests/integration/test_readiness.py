"""``/readyz`` at start-up reflects whether the replicas can be reached, before any
client has failed on them (issue 14, item 8): every replica's TCP port is checked once
at start-up (:meth:`proxy.upstreams.Upstreams.check_replicas`), a refusing one is ejected
and left to the background health re-check, and readiness waits for the check.

Upstreams are real sockets on 127.0.0.1 port 0; a "dead" one is a port that was bound
and closed (connections are refused).
"""

from __future__ import annotations

from typing import Any

import httpx

from proxy.runtime import Runtime
from proxy.serving import bind_socket, running_server
from tests.conftest import Proxy, proxy_settings
from tests.integration.upstream import FakeEngine


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
