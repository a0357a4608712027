"""WebSocket limits and the session log line, over real sockets (fake clock for timeouts)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxy.admission.auth import KeyRedactionFilter
from proxy.clock import FakeClock
from proxy.logs import install_uvicorn_filters
from tests.conftest import Proxy, proxy_settings
from tests.integration.test_ws_relay import hello, upstream, wait_until, ws_route

__all__ = ["upstream"]  # the fixture, re-exported for pytest


async def test_idle_timeout_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route()],
                       limits={"idle_timeout_s": 30, "max_session_s": 0}),
        clock,
    )  # fmt: skip
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        clock.advance(20)
        await ws.send("still here")  # activity resets the idle timer
        assert await ws.recv() == "still here"
        clock.advance(20)  # 40 s since start, 20 s since the last frame
        await ws.send("ping")
        assert await ws.recv() == "ping"
        clock.advance(31)
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1008
    assert ws.close_reason == "idle timeout"
    await wait_until(lambda: proxy.gate.active == 0 and app.controls.ws_active == 0)


async def test_max_session_duration_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, _ = upstream
    clock = FakeClock()
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route()],
                       limits={"idle_timeout_s": 0, "max_session_s": 100}),
        clock,
    )  # fmt: skip
    async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
        await hello(ws)
        clock.advance(99)
        await ws.send("x")
        assert await ws.recv() == "x"
        clock.advance(2)
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1008
    assert "maximum session duration" in ws.close_reason
    await wait_until(lambda: proxy.gate.active == 0)


async def test_oversized_client_message_closes_with_1008(start_proxy: Any, upstream: Any) -> None:
    server, app = upstream
    proxy: Proxy = await start_proxy(
        proxy_settings([("gpu0", server.http_url, 1)], [ws_route()],
                       limits={"max_message_bytes": 4096})
    )  # fmt: skip
    async with connect(proxy.ws_url + "/ws/echo", compression=None, max_size=None) as ws:
        await hello(ws)
        await ws.send(b"a" * 4096)  # at the limit: relayed
        assert await ws.recv() == b"a" * 4096
        await ws.send(b"a" * 4097)
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1008
    await wait_until(lambda: proxy.gate.active == 0 and app.controls.ws_active == 0)


async def test_session_end_is_one_json_log_line(
    start_proxy: Any, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 1)], [ws_route()]))
    with caplog.at_level(logging.INFO, logger="headroom.session"):
        async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
            await hello(ws)
            await ws.send(b"12345")
            await ws.recv()
        await wait_until(lambda: any(r.name == "headroom.session" for r in caplog.records))
    record = next(r for r in caplog.records if r.name == "headroom.session")
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["event"] == "session_end"
    assert fields["route"] == "/ws/echo" and fields["pool"] == "main"
    assert fields["replica"] == "gpu0" and fields["decision"] == "admitted"
    assert fields["client_close"] == 1000
    assert fields["bytes_up"] == 5 and fields["frames_up"] == 1
    assert fields["bytes_down"] >= 5 and fields["duration_s"] >= 0
    from proxy.logs import JsonFormatter

    line = JsonFormatter().format(record)
    assert json.loads(line)["session"] == fields["session"]
    assert "\n" not in line


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_uvicorn_filters_are_installed_once() -> None:
    install_uvicorn_filters()
    install_uvicorn_filters()  # idempotent
    for name in ("uvicorn.error", "uvicorn.access"):
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, KeyRedactionFilter) for f in filters) == 1


async def test_refused_handshakes_log_no_error(start_proxy: Any, upstream: Any) -> None:
    """A refusal storm is normal operation: refused handshakes (HTTP 503 at the pool's
    cap, and a client's invalid UTF-8 text answered with 1007) put nothing at ERROR in
    uvicorn's log -- no WebSocket reaches uvicorn's own implementation."""
    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 1)], [ws_route()]))
    handler = _ListHandler()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        async with connect(proxy.ws_url + "/ws/echo", compression=None) as holder:
            await hello(holder)
            for _ in range(5):
                with pytest.raises(InvalidStatus) as refused:
                    await connect(proxy.ws_url + "/ws/echo", compression=None)
                assert refused.value.response.status_code == 503
        async with connect(proxy.ws_url + "/ws/echo", compression=None) as ws:
            await hello(ws)
            await ws.send(b"\xff", text=True)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1007
        await wait_until(lambda: proxy.gate.active == 0)
    finally:
        logger.removeHandler(handler)
    assert [r for r in handler.records if r.levelno >= logging.ERROR] == []


async def test_refusal_storm_logs_no_uvicorn_errors(start_proxy: Any, upstream: Any) -> None:
    from websockets.exceptions import InvalidStatus

    server, _ = upstream
    proxy: Proxy = await start_proxy(proxy_settings([("gpu0", server.http_url, 1)], [ws_route()]))
    holder = await connect(proxy.ws_url + "/ws/echo", compression=None)
    handler = _ListHandler()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(5):
            with pytest.raises(InvalidStatus):
                await connect(proxy.ws_url + "/ws/echo", compression=None)
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]
    await holder.close()
    await wait_until(lambda: proxy.gate.active == 0)
