"""WebSocket relay over real sockets: a uvicorn upstream, the proxy, websockets clients."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.process.serving import RunningServer, running_server
from tests.conftest import Proxy, proxy_settings
from tests.integration.abortable_ws_upstream import UpstreamConnection, abortable_ws_upstream
from tests.integration.upstream import FakeEngine


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    app = FakeEngine()
    async with running_server(app) as server:
        yield server, app


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll a condition with a generous bound (ordering, not timing, is asserted)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def ws_route(path: str = "/ws/echo", **extra: Any) -> dict[str, Any]:
    return {"path": path, "pool": "main", "protocol": "passthrough-ws", **extra}


async def hello(ws: Any) -> dict[str, Any]:
    message = json.loads(await ws.recv())
    assert message["type"] == "hello"
    return message  # type: ignore[no-any-return]


async def test_frames_relayed_byte_exact_both_ways(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    async with connect(proxy.ws_url + "/ws/echo?x=1", compression=None) as ws:
        greeting = await hello(ws)
        assert greeting["query"] == "x=1"
        assert greeting["headers"]["x-forwarded-proto"] == "http"
        assert "x-forwarded-for" in greeting["headers"]
        payload = bytes(range(256)) * 40
        await ws.send(payload)
        assert await ws.recv() == payload
        await ws.send("héllo ✓")
        assert await ws.recv() == "héllo ✓"
        assert proxy.gate.active == 1
    await wait_until(lambda: proxy.gate.active == 0)


async def test_subprotocol_and_headers_end_to_end(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    async with connect(
        proxy.ws_url + "/ws/echo",
        subprotocols=["realtime", "other"],  # type: ignore[list-item]
        additional_headers={"Authorization": "Bearer abc", "X-Custom": "1"},
        user_agent_header="test-agent/1",
        compression=None,
    ) as ws:
        assert ws.subprotocol == "realtime"
        headers = (await hello(ws))["headers"]
        assert headers["authorization"] == "Bearer abc"
        assert headers["x-custom"] == "1"
        assert headers["user-agent"] == "test-agent/1"
        assert "sec-websocket-extensions" not in headers  # compression off upstream too


async def test_custom_close_code_from_upstream_reaches_client(
    start_proxy: Any, upstream: Any
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        await ws.send("close:4001:custom reason")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4001
    assert ws.close_reason == "custom reason"
    await wait_until(lambda: proxy.gate.active == 0)


async def test_custom_close_code_from_client_reaches_upstream(
    start_proxy: Any, upstream: Any
) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        await ws.close(4002, "bye")
    await wait_until(lambda: app.controls.client_close_codes == [4002])
    await wait_until(lambda: proxy.gate.active == 0)


async def test_third_session_refused_then_fourth_admitted(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    a = await connect(proxy.ws_url + "/ws/echo", compression=None)
    b = await connect(proxy.ws_url + "/ws/echo", compression=None)
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/ws/echo", compression=None)
    response = info.value.response
    assert response.status_code == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert response.headers["X-Headroom-Reason"] == "pool_full"
    error = json.loads(response.body)["error"]
    assert error["type"] == "capacity_exhausted"
    assert error["code"] == "pool_full"
    assert error["retry_after_s"] >= 1
    assert error["fallback"]["voice"] == "lite-1"
    assert error["queue_position"] is None
    await a.close()
    await wait_until(lambda: proxy.gate.active == 1)
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as d:
        await hello(d)
    await b.close()
    await wait_until(lambda: proxy.gate.active == 0)
    assert (
        proxy.metric("headroom_session_decisions_total", pool="main", decision="rejected_pool_full")
        == 1
    )


async def test_waiters_admitted_in_arrival_order(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", server.http_url, 1)], [ws_route()], queue={"max_depth": 5, "max_wait_s": 60}
        )
    )
    holder = await connect(proxy.ws_url + "/ws/echo", compression=None)
    order: list[int] = []
    clients: dict[int, Any] = {}

    async def waiter(i: int) -> None:
        ws = await connect(proxy.ws_url + "/ws/echo", compression=None, open_timeout=30)
        order.append(i)
        clients[i] = ws

    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(waiter(i)))
        await wait_until(lambda i=i: proxy.gate.queued == i + 1)
    await holder.close()
    for i in range(3):
        await wait_until(lambda i=i: i in clients)
        await clients[i].close()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    await wait_until(lambda: proxy.gate.active == 0)


async def test_waiter_that_disconnects_loses_its_place(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", server.http_url, 1)], [ws_route()], queue={"max_depth": 5, "max_wait_s": 60}
        )
    )
    holder = await connect(proxy.ws_url + "/ws/echo", compression=None)

    async def open_ws() -> Any:
        return await connect(proxy.ws_url + "/ws/echo", compression=None, open_timeout=30)

    leaver = asyncio.create_task(open_ws())
    await wait_until(lambda: proxy.gate.queued == 1)
    stayer_task = asyncio.create_task(open_ws())
    await wait_until(lambda: proxy.gate.queued == 2)
    leaver.cancel()  # the client gives up during the held handshake
    await wait_until(lambda: proxy.gate.queued == 1)
    connections_before = app.controls.ws_connections
    await holder.close()
    stayer = await stayer_task
    await hello(stayer)
    assert app.controls.ws_connections == connections_before + 1
    await stayer.close()
    await wait_until(lambda: proxy.gate.active == 0)
    assert proxy.metric("headroom_session_decisions_total", pool="main", decision="abandoned") == 1


async def test_refusal_close_mode_sends_event_and_1013(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("gpu0", server.http_url, 1)],
            [{"path": "/v1/realtime", "pool": "main", "protocol": "vllm-realtime",
              "refusal": "close"}],
        )
    )  # fmt: skip
    holder = await connect(proxy.ws_url + "/v1/realtime", compression=None)
    async with connect(proxy.ws_url + "/v1/realtime", compression=None) as ws:
        event = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert event["type"] == "error"
    assert event["code"] == "pool_full"
    assert event["retry_after_s"] >= 1
    assert event["fallback"]["voice"] == "lite-1"
    assert ws.close_code == 1013
    assert len(ws.close_reason.encode()) <= 123
    await holder.close()
    await wait_until(lambda: proxy.gate.active == 0)


async def test_unreachable_replica_is_skipped(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    from proxy.process.serving import bind_socket

    dying = bind_socket()  # listening through the start-up check, refusing after it
    dead_port = dying.getsockname()[1]
    proxy: Proxy = await start_proxy(
        proxy_settings(
            [("dead", f"http://127.0.0.1:{dead_port}", 5), ("live", server.http_url, 1)],
            [ws_route()],
        )
    )
    assert all(r.healthy for r in proxy.gate.statistics()["main"].replicas)
    dying.close()
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        stats = {r.name: r for r in proxy.gate.statistics()["main"].replicas}
        assert not stats["dead"].healthy
        assert stats["live"].active == 1
    await wait_until(lambda: proxy.gate.active == 0)
    assert (
        proxy.metric("headroom_upstream_errors_total", pool="main", replica="dead", kind="connect")
        == 1
    )


async def test_a_plain_ws_upstream_is_connected_by_the_event_loop(
    start_proxy: Any, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spliced session to a ws:// replica lets the loop make and connect the socket
    (open_tcp_transport): a socket of the relay's own, handed over afterwards, cost
    13 more system calls a session. wss:// keeps open_tcp (TLS starts over it)."""
    from proxy.relay import ws_session as relay_ws

    server, _ = upstream
    opened: list[str] = []
    own_socket, loop_made = relay_ws.open_tcp, relay_ws.open_tcp_transport

    async def spy_socket(*args: Any, **kwargs: Any) -> Any:
        opened.append("socket")
        return await own_socket(*args, **kwargs)

    async def spy_transport(*args: Any, **kwargs: Any) -> Any:
        opened.append("transport")
        return await loop_made(*args, **kwargs)

    monkeypatch.setattr(relay_ws, "open_tcp", spy_socket)
    monkeypatch.setattr(relay_ws, "open_tcp_transport", spy_transport)
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        payload = bytes(range(256)) * 40
        await ws.send(payload)
        assert await ws.recv() == payload
    await wait_until(lambda: proxy.gate.active == 0)
    assert opened == ["transport"]


async def test_upstream_killed_mid_stream_gives_1014(start_proxy: Any) -> None:
    started = asyncio.Event()

    async def on_open(conn: UpstreamConnection) -> None:
        await conn.send(b"\x00" * 4800)
        started.set()

    async with abortable_ws_upstream(on_open) as upstream:
        proxy: Proxy = await start_proxy(
            proxy_settings([("gpu0", upstream.url, 2)], [ws_route("/anything")])
        )
        async with connect(proxy.ws_url + "/anything", compression=None) as ws:
            assert await ws.recv() == b"\x00" * 4800
            await started.wait()
            upstream.connections[0].abort()  # the upstream dies without a close frame
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1014
        await wait_until(lambda: proxy.gate.active == 0)
        assert (
            proxy.metric(
                "headroom_upstream_errors_total", pool="main", replica="gpu0", kind="midstream"
            )
            == 1
        )


async def test_unknown_path_is_404(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 2)], [ws_route()]))
    with pytest.raises(InvalidStatus) as info:
        await connect(proxy.ws_url + "/not/a/route", compression=None)
    assert info.value.response.status_code == 404


async def test_a_wss_upstream_is_spliced_over_tls(
    start_proxy: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica at https:// is reached as wss:// (SNI, certificate checked against the
    trusted CAs) and relayed like any other."""
    import ssl

    import trustme

    from proxy.relay import upstream_handshake as upstream_ws

    ca = trustme.CA()
    server_cert = ca.issue_cert("localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    server_cert.cert_chain_pems[0].write_to_path(str(cert))
    server_cert.private_key_pem.write_to_path(str(key))
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    monkeypatch.setattr(upstream_ws, "_tls", trusted)
    async with running_server(FakeEngine(), ssl_certfile=str(cert), ssl_keyfile=str(key)) as server:
        url = f"https://localhost:{server.port}"
        proxy: Proxy = await start_proxy(proxy_settings([("gpu0", url, 1)], [ws_route()]))
        async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
            greeting = await hello(ws)
            assert greeting["headers"]["host"] == f"localhost:{server.port}"
            payload = bytes(range(256)) * 64
            await ws.send(payload)
            assert await ws.recv() == payload
        await wait_until(lambda: proxy.gate.active == 0)
        # An untrusted certificate is a connect failure: the handshake is refused with 502
        monkeypatch.setattr(upstream_ws, "_tls", ssl.create_default_context())
        with pytest.raises(InvalidStatus) as refused:
            await connect(proxy.ws_url + "/ws/echo", compression=None)
        assert refused.value.response.status_code == 502
