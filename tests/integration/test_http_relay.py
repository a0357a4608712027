"""Streaming HTTP relay over real sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from proxy.process.serving import RunningServer, bind_socket, running_server
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import wait_until
from tests.integration.upstream import FakeEngine


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    app = FakeEngine()
    async with running_server(app) as server:
        yield server, app


def http_route(path: str, **extra: Any) -> dict[str, Any]:
    return {"path": path, "pool": "main", "protocol": "passthrough-http", **extra}


async def test_request_and_response_relayed(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 2)], [http_route("/echo-http")])
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(
            proxy.http_url + "/echo-http?a=b",
            content=b'{"input": "hi"}',
            headers={"Authorization": "Bearer k", "X-Thing": "t", "Connection": "keep-alive"},
        )
    assert response.status_code == 200
    assert response.headers["x-upstream"] == "yes"
    echoed = response.json()
    assert echoed["method"] == "POST"
    assert echoed["query"] == "a=b"
    assert echoed["body"] == '{"input": "hi"}'
    assert echoed["headers"]["authorization"] == "Bearer k"
    assert echoed["headers"]["x-thing"] == "t"
    assert echoed["headers"]["x-forwarded-for"] == "127.0.0.1"
    await wait_until(lambda: proxy.gate.active == 0)


async def test_sse_first_event_arrives_before_upstream_finishes(
    start_proxy: Any, upstream: Any
) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 2)], [http_route("/sse")])
    )
    async with httpx.AsyncClient() as client, client.stream("POST", proxy.http_url + "/sse") as r:
        assert r.headers["content-type"] == "text/event-stream"
        chunks = r.aiter_raw()
        first = await anext(chunks)
        assert b"event: first" in first
        assert not app.controls.release.is_set()  # the upstream has not finished
        assert proxy.gate.active == 1
        app.controls.release.set()
        rest = b"".join([c async for c in chunks])
        assert b"event: second" in rest
    await wait_until(lambda: proxy.gate.active == 0)


async def test_refusal_503_with_contract_body(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [http_route("/sse")])
    )
    async with httpx.AsyncClient() as client, client.stream("POST", proxy.http_url + "/sse") as r:
        await anext(r.aiter_raw())
        refused = await client.post(proxy.http_url + "/sse")
        assert refused.status_code == 503
        assert refused.headers["x-headroom-reason"] == "pool_full"
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "capacity_exhausted" and error["code"] == "pool_full"
        app.controls.release.set()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_client_disconnect_mid_stream_frees_the_slot(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [http_route("/sse")])
    )
    async with httpx.AsyncClient() as client, client.stream("POST", proxy.http_url + "/sse") as r:
        await anext(r.aiter_raw())
        assert proxy.gate.active == 1
    # the client closed the connection while the upstream was still streaming
    await wait_until(lambda: proxy.gate.active == 0)


async def test_unreachable_upstream_gives_502(start_proxy: Any) -> None:
    dying = bind_socket()  # listening through the start-up check, refusing after it
    port = dying.getsockname()[1]
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", f"http://127.0.0.1:{port}", 1)], [http_route("/x")])
    )
    dying.close()
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/x", content=b"{}")
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "upstream_error"
    assert proxy.gate.active == 0


async def test_body_over_the_limit_gets_413(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", server.http_url, 1)],
            [http_route("/echo-http")],
            limits={"max_http_body_bytes": 2048},
        )
    )
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/echo-http", content=b"x" * 4096)
    assert response.status_code == 413
    assert proxy.gate.active == 0


async def test_ops_endpoints(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 3)], [http_route("/echo-http")])
    )
    async with httpx.AsyncClient() as client:
        assert (await client.get(proxy.http_url + "/healthz")).status_code == 200
        ready = await client.get(proxy.http_url + "/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        metrics = (await client.get(proxy.http_url + "/metrics")).text
        assert 'headroom_session_slots{pool="main",replica="gpu0"} 3.0' in metrics
        assert (await client.get(proxy.http_url + "/nope")).status_code == 404
        proxy.gate.drain()
        ready = await client.get(proxy.http_url + "/readyz")
        assert ready.status_code == 503 and json.loads(ready.text)["reason"] == "draining"
        refused = await client.post(proxy.http_url + "/echo-http")
        assert refused.status_code == 503
        assert refused.headers["x-headroom-reason"] == "draining"
    await asyncio.sleep(0)


async def test_queued_request_that_disconnects_leaves_the_queue(
    start_proxy: Any, upstream: Any
) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [http_route("/sse")],
                       queue={"max_depth": 4, "max_wait_s": 60})
    )  # fmt: skip
    async with httpx.AsyncClient() as client, client.stream("POST", proxy.http_url + "/sse") as r:
        chunks = r.aiter_raw()
        await anext(chunks)
        leaver = asyncio.create_task(client.post(proxy.http_url + "/sse"))
        await wait_until(lambda: proxy.gate.queued == 1)
        leaver.cancel()  # the client goes away while queued
        await wait_until(lambda: proxy.gate.queued == 0)
        assert proxy.gate.active == 1
        app.controls.release.set()
        assert b"second" in b"".join([c async for c in chunks])
    await wait_until(lambda: proxy.gate.active == 0)
    decisions = "headroom_session_decisions_total"
    assert proxy.metric(decisions, pool="main", decision="abandoned") == 1
    assert proxy.metric(decisions, pool="main", decision="admitted") == 1


async def test_unreachable_replicas_are_each_tried_once_then_502(start_proxy: Any) -> None:
    """Failover walks the pool once: both replicas refuse, each is tried (and ejected)
    once, then the client gets 502 and no slot is held."""
    dying = [bind_socket(), bind_socket()]
    replicas = [
        (f"gpu{i}", f"http://127.0.0.1:{s.getsockname()[1]}", 1) for i, s in enumerate(dying)
    ]
    proxy: Proxy = await start_proxy(proxy_settings(replicas, [http_route("/x")]))
    for s in dying:
        s.close()
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/x", content=b"{}")
    assert response.status_code == 502
    for name in ("gpu0", "gpu1"):
        assert (
            proxy.metric(
                "headroom_upstream_errors_total", pool="main", replica=name, kind="connect"
            )
            == 1
        )
    assert proxy.gate.active == 0


async def test_a_request_that_fails_over_is_metered_on_the_replica_that_served_it(
    start_proxy: Any, upstream: Any
) -> None:
    server, engine = upstream
    engine.controls.release.set()  # the SSE stream sends both its events at once
    dying = bind_socket()  # listening through the start-up check, refusing after it
    replicas = [("gpu0", f"http://127.0.0.1:{dying.getsockname()[1]}", 1),
                ("gpu1", server.http_url, 1)]  # fmt: skip
    proxy: Proxy = await start_proxy(proxy_settings(replicas, [http_route("/sse")]))
    dying.close()
    async with httpx.AsyncClient() as client:
        response = await client.post(proxy.http_url + "/sse", content=b"{}")
    assert response.status_code == 200 and b"second" in response.content
    await wait_until(lambda: proxy.gate.active == 0)
    gaps = {
        replica: proxy.metric("headroom_chunk_gap_seconds_count", pool="main", replica=replica)
        for replica in ("gpu0", "gpu1")
    }
    assert gaps == {"gpu0": 0, "gpu1": 1}  # the gap between the two events, where they came
