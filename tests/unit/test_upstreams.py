"""The upstreams' background work, on a fake clock: the start-up reachability check,
the health re-check of an ejected replica, engine scraping, and stop.

Replicas are real HTTP servers on 127.0.0.1 port 0 (or a port that was bound and closed:
connections refused); the clock only moves when a test advances it, so each re-check
and each scrape happens exactly when the test says, never on a real timer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from proxy import upstreams as upstreams_module
from proxy.admission.gate import Gate
from proxy.clock import FakeClock
from proxy.process.serving import bind_socket, running_server
from proxy.runtime import build_gate
from proxy.settings import Settings
from proxy.upstreams import (
    ENGINE_METRICS_MAX_BYTES,
    ENGINE_METRICS_PARSE_INLINE_BYTES,
    EngineFigures,
    Upstreams,
    parse_engine_metrics,
)
from tests.conftest import proxy_settings

VLLM_PAGE = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{model_name="a"} 0.0\n'
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{model_name="a"} 7.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{model_name="a"} 0.42\n'
)


def test_parse_engine_metrics() -> None:
    assert parse_engine_metrics(VLLM_PAGE) == (0.0, 7.0, 0.42)
    assert parse_engine_metrics(VLLM_PAGE + VLLM_PAGE.replace('"a"', '"b"')) == (0.0, 14.0, 0.84)
    with pytest.raises(ValueError, match="no vLLM"):
        parse_engine_metrics("other_metric 1\n")


class Replica:
    """An engine's HTTP side: ``/health`` answers the next status of ``health`` (the
    last one repeats), ``/metrics`` answers ``page``. Every request is recorded."""

    def __init__(self, health: list[int], page: str = "") -> None:
        self.health = health
        self.page = page
        self.requests: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.requests.append(scope["path"])
        if scope["path"] == "/health":
            status, body = self.health.pop(0) if len(self.health) > 1 else self.health[0], b""
        else:
            status, body = 200, self.page.encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})


def dead_url() -> str:
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def settings(url: str, **health: float) -> Settings:
    return proxy_settings(
        [("gpu0", url, 2)],
        [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}],
        health={"recheck_interval_s": 5, **health},
    )


def healthy(gate: Gate) -> bool:
    return gate.statistics()["main"].replicas[0].healthy


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate`` holds (a generous bound: ordering, not
    timing, is asserted)."""
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


async def test_recheck_waits_on_the_clock_and_restores_a_replica_once_it_answers() -> None:
    clock = FakeClock()
    replica = Replica(health=[503, 200])
    async with running_server(replica) as server:
        s = settings(server.http_url)
        gate = build_gate(s, clock, None)
        upstreams = Upstreams(s, gate, clock)
        await upstreams.start()
        try:
            await upstreams.replicas_checked.wait()
            assert healthy(gate) and replica.requests == []  # the start-up check is TCP only
            gate.set_healthy("main", "gpu0", False)
            assert upstreams.rechecking == [("main", "gpu0")]
            await until(lambda: clock.pending_timers == 1)
            assert replica.requests == []  # nothing before the interval has passed
            clock.advance(4.9)
            await asyncio.sleep(0.05)
            assert replica.requests == []
            clock.advance(0.1)
            await until(lambda: replica.requests == ["/health"] and clock.pending_timers == 1)
            assert not healthy(gate)  # 503: still ejected, the next probe is armed
            clock.advance(5)
            await until(lambda: healthy(gate))
            assert replica.requests == ["/health", "/health"]
            await until(lambda: upstreams.rechecking == [])
        finally:
            await upstreams.stop()


async def test_a_replica_refusing_at_start_up_is_ejected_and_the_recheck_outlives_any_error() -> (
    None
):
    """The start-up check ejects a replica whose port refuses; its re-check survives
    an error from outside httpx's hierarchy (as raised under a connection reset) and an
    httpx error, and restores it when ``/health`` answers."""
    calls: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise AttributeError("'NoneType' object has no attribute 'send'")
        if len(calls) == 2:
            raise httpx.ConnectError("refused")
        return httpx.Response(200)

    clock = FakeClock()
    s = settings(dead_url())
    gate = build_gate(s, clock, None)
    upstreams = Upstreams(s, gate, clock, transport=httpx.MockTransport(answer))
    await upstreams.start()
    try:
        await upstreams.replicas_checked.wait()
        assert not healthy(gate)
        assert upstreams.rechecking == [("main", "gpu0")]
        for probes in (1, 2):
            await until(lambda: clock.pending_timers == 1)
            clock.advance(5)
            await until(lambda: len(calls) == probes)  # noqa: B023
            assert not healthy(gate)
        await until(lambda: clock.pending_timers == 1)
        clock.advance(5)
        await until(lambda: healthy(gate))
        assert calls == ["/health"] * 3
    finally:
        await upstreams.stop()


async def test_engine_figures_are_scraped_every_interval_and_dropped_when_the_page_fails() -> None:
    clock = FakeClock()
    replica = Replica(health=[200], page=VLLM_PAGE)
    async with running_server(replica) as server:
        s = settings(server.http_url, engine_metrics_interval_s=10)
        gate = build_gate(s, clock, None)
        upstreams = Upstreams(s, gate, clock)
        await upstreams.start()
        try:
            await until(lambda: ("main", "gpu0") in upstreams.engine)
            assert upstreams.engine[("main", "gpu0")] == (0.0, 7.0, 0.42)
            assert replica.requests == ["/metrics"]
            replica.page = "not_vllm 1\n"
            await until(lambda: clock.pending_timers == 1)
            await asyncio.sleep(0.05)
            assert replica.requests == ["/metrics"]  # the next scrape waits for the clock
            clock.advance(10)
            await until(lambda: ("main", "gpu0") not in upstreams.engine)
            assert replica.requests == ["/metrics"] * 2
        finally:
            await upstreams.stop()


async def test_stop_cancels_the_rechecks_and_closes_the_client() -> None:
    clock = FakeClock()
    s = settings(dead_url())
    gate = build_gate(s, clock, None)
    upstreams = Upstreams(s, gate, clock)
    with pytest.raises(RuntimeError, match="not started"):
        _ = upstreams.http
    await upstreams.start()
    await upstreams.replicas_checked.wait()
    assert upstreams.rechecking == [("main", "gpu0")]
    await upstreams.stop()
    assert upstreams.rechecking == []
    with pytest.raises(RuntimeError, match="not started"):
        _ = upstreams.http
    gate.set_healthy("main", "gpu0", True)
    gate.set_healthy("main", "gpu0", False)  # ejected after stop: no re-check starts
    assert upstreams.rechecking == []


async def test_a_reload_moves_the_next_probe_to_the_new_url_and_interval() -> None:
    clock = FakeClock()
    replica = Replica(health=[503, 200])
    async with running_server(replica) as server:
        s = settings(dead_url())
        gate = build_gate(s, clock, None)
        upstreams = Upstreams(s, gate, clock)
        await upstreams.start()
        try:
            await upstreams.replicas_checked.wait()
            assert not healthy(gate)
            await until(lambda: clock.pending_timers == 1)  # first probe in 5 s
            upstreams.apply(settings(server.http_url, recheck_interval_s=1))
            assert upstreams.http_url("main", "gpu0") == server.http_url
            clock.advance(5)
            # the probe went to the new URL (the old port refuses): 503, next in 1 s
            await until(lambda: replica.requests == ["/health"] and clock.pending_timers == 1)
            clock.advance(0.9)
            await asyncio.sleep(0.05)
            assert replica.requests == ["/health"]
            clock.advance(0.1)
            await until(lambda: healthy(gate))
            assert replica.requests == ["/health", "/health"]
        finally:
            await upstreams.stop()


async def test_scraping_turned_on_by_a_reload_starts_and_turned_off_ends() -> None:
    clock = FakeClock()
    replica = Replica(health=[200], page=VLLM_PAGE)
    async with running_server(replica) as server:
        gate = build_gate(settings(server.http_url), clock, None)
        upstreams = Upstreams(settings(server.http_url), gate, clock)
        await upstreams.start()
        try:
            await upstreams.replicas_checked.wait()
            assert replica.requests == [] and upstreams.engine == {}
            upstreams.apply(settings(server.http_url, engine_metrics_interval_s=10))
            await until(lambda: ("main", "gpu0") in upstreams.engine)
            upstreams.apply(settings(server.http_url, engine_metrics_interval_s=10))
            await until(lambda: clock.pending_timers == 1)
            await asyncio.sleep(0.05)
            assert clock.pending_timers == 1 and replica.requests == ["/metrics"]  # one loop
            upstreams.apply(settings(server.http_url))
            clock.advance(10)
            await until(lambda: not upstreams.scraping)
            assert replica.requests == ["/metrics"] and clock.pending_timers == 0
        finally:
            await upstreams.stop()


class StreamedPage:
    """An engine whose ``/metrics`` body is ``size`` bytes of comment lines followed by
    :data:`VLLM_PAGE`, sent in chunks (with a Content-Length header if ``declare``)."""

    def __init__(self, size: int, *, declare: bool = False) -> None:
        self.size = size
        self.declare = declare

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        line = b"# " + b"x" * 1021 + b"\n"
        tail = VLLM_PAGE.encode()
        lines = max(0, (self.size - len(tail)) // len(line))
        headers = []
        if self.declare:
            headers.append((b"content-length", str(lines * len(line) + len(tail)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for start in range(0, lines, 64):
            chunk = line * min(64, lines - start)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": tail})


async def scrape(app: Any) -> Upstreams:
    clock = FakeClock()
    async with running_server(app) as server:
        s = settings(server.http_url)
        upstreams = Upstreams(s, build_gate(s, clock, None), clock)
        await upstreams.start()
        try:
            await upstreams.scrape_once()
        finally:
            await upstreams.stop()
    return upstreams


@pytest.mark.parametrize("declare", [False, True], ids=["chunked", "content-length"])
async def test_an_engine_page_over_the_bound_drops_the_figures_with_a_warning(
    declare: bool, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[EngineFigures | None] = []
    app = StreamedPage(2 * ENGINE_METRICS_MAX_BYTES, declare=declare)
    clock = FakeClock()
    async with running_server(app) as server:
        s = settings(server.http_url)
        upstreams = Upstreams(s, build_gate(s, clock, None), clock)
        upstreams.on_scrape(lambda pool, replica, figures: seen.append(figures))
        await upstreams.start()
        try:
            with caplog.at_level(logging.WARNING, logger="headroom.upstreams"):
                await upstreams.scrape_once()
        finally:
            await upstreams.stop()
    assert seen == [None]
    assert ("main", "gpu0") not in upstreams.engine
    assert any(
        "engine metrics page" in r.message and str(ENGINE_METRICS_MAX_BYTES) in r.message
        for r in caplog.records
    )


async def test_a_long_engine_page_within_the_bound_is_parsed_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[int] = []

    def parse(text: str) -> EngineFigures:
        threads.append(threading.get_ident())
        return parse_engine_metrics(text)

    monkeypatch.setattr(upstreams_module, "parse_engine_metrics", parse)
    short = await scrape(StreamedPage(0))
    long = await scrape(StreamedPage(4 * ENGINE_METRICS_PARSE_INLINE_BYTES))
    assert short.engine[("main", "gpu0")] == long.engine[("main", "gpu0")] == (0.0, 7.0, 0.42)
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread  # a short page is parsed in place
    assert threads[1] != loop_thread


async def test_the_scrape_stops_reading_an_engine_page_at_the_bound() -> None:
    sent: list[int] = []
    chunk = b"# " + b"x" * (64 * 1024 - 3) + b"\n"

    async def body() -> AsyncIterator[bytes]:
        for _ in range(4 * ENGINE_METRICS_MAX_BYTES // len(chunk)):
            sent.append(len(chunk))
            yield chunk
        yield VLLM_PAGE.encode()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    clock = FakeClock()
    s = settings("http://127.0.0.1:9")
    upstreams = Upstreams(
        s, build_gate(s, clock, None), clock, transport=httpx.MockTransport(answer)
    )
    await upstreams.start()
    try:
        await upstreams.scrape_once()
    finally:
        await upstreams.stop()
    assert ("main", "gpu0") not in upstreams.engine
    assert sum(sent) <= ENGINE_METRICS_MAX_BYTES + len(chunk)
