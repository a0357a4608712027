"""Engine scraping that cannot die (proxy/upstreams.py): a page with a value that is not
a finite number, a page that drips, a listener that raises and a scrape task that is
killed each leave every other replica scraped on time.

Replicas are real HTTP servers on 127.0.0.1 port 0; the gateway's clock is a FakeClock,
so each scrape pass and each scrape's time bound happen exactly when the test moves it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.process.serving import running_server
from proxy.runtime import Runtime
from proxy.settings import Settings, settings_from_mapping
from proxy.upstreams import (
    ENGINE_METRICS_TIMEOUT_S,
    EngineFigures,
    EnginePageError,
    NoEngineFigures,
    parse_engine_metrics,
)

INTERVAL_S = 5.0
HOLD_S = 30.0
CAP = 3


def vllm_page(waiting: str, running: str) -> str:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )


class Page:
    """An engine's ``/metrics``: ``page``, counting the requests."""

    def __init__(self, page: str) -> None:
        self.page = page
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.requests += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": self.page.encode()})


class DrippingPage:
    """An engine whose ``/metrics`` never ends: one byte every 0.2 s (real time, so
    httpx's own read timeout never fires) until :attr:`release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.requests += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"# ", "more_body": True})
        self.started.set()
        while not self.release.is_set():
            try:
                await asyncio.wait_for(self.release.wait(), 0.2)
            except TimeoutError:
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b"\n"})


def two_pools(tts_url: str, other_url: str) -> Settings:
    """Pool ``other`` (listed first, so scraped first) with one replica, and pool ``tts``
    whose replica ``gpu0`` is capped at 3 with ``engine_reconcile``."""
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "health": {"engine_metrics_interval_s": INTERVAL_S, "recheck_interval_s": 5},
            "pools": [
                {"name": "other",
                 "replicas": [{"name": "gpu1", "url": other_url, "max_sessions": CAP}]},
                {"name": "tts", "engine_reconcile": True, "engine_reconcile_hold_s": HOLD_S,
                 "replicas": [{"name": "gpu0", "url": tts_url, "max_sessions": CAP}]},
            ],
            "routes": [{"path": "/a", "pool": "other", "protocol": "passthrough-ws"},
                       {"path": "/b", "pool": "tts", "protocol": "passthrough-ws"}],
        },
        env={},
    )  # fmt: skip


def one_pool(tts_url: str) -> Settings:
    """:func:`two_pools` after a reload that removed pool ``other``."""
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "health": {"engine_metrics_interval_s": INTERVAL_S, "recheck_interval_s": 5},
            "pools": [
                {"name": "tts", "engine_reconcile": True, "engine_reconcile_hold_s": HOLD_S,
                 "replicas": [{"name": "gpu0", "url": tts_url, "max_sessions": CAP}]},
            ],
            "routes": [{"path": "/b", "pool": "tts", "protocol": "passthrough-ws"}],
        },
        env={},
    )  # fmt: skip


def count_scrapes(rt: Runtime) -> dict[str, int]:
    """Scrapes handled so far per replica (a listener after the runtime's own)."""
    scraped: dict[str, int] = {}

    def seen(pool: str, replica: str, figures: object) -> None:
        scraped[replica] = scraped.get(replica, 0) + 1

    rt.upstreams.on_scrape(seen)
    return scraped


def cap(rt: Runtime) -> int:
    return rt.gate.statistics()["tts"].replicas[0].cap


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate`` holds (a generous bound: ordering, not
    timing, is asserted)."""
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


async def test_a_nan_page_of_another_pool_leaves_the_reduction_of_a_gpu_in_force() -> None:
    """2 streams bypass Headroom on gpu0 (cap 3); a replica of another pool answers
    NaN. Every pass still scrapes gpu0, so its cap stays 1 past the hold time."""
    clock = FakeClock()
    bypassed = Page(vllm_page("0", "2"))
    lying = Page(vllm_page("0", "NaN"))
    async with running_server(bypassed) as tts, running_server(lying) as other:
        rt = Runtime(two_pools(tts.http_url, other.http_url), clock=clock)
        scraped = count_scrapes(rt)
        await rt.upstreams.start()
        try:
            await until(lambda: scraped == {"gpu0": 1, "gpu1": 1})
            passes = 2 + int(HOLD_S / INTERVAL_S)
            for n in range(2, passes + 1):
                await until(lambda: clock.pending_timers >= 2)
                clock.advance(INTERVAL_S)
                await until(lambda: scraped == {"gpu0": n, "gpu1": n})  # noqa: B023
                assert cap(rt) == CAP - 2
            assert rt.upstreams.scraping
            assert ("other", "gpu1") not in rt.upstreams.engine
        finally:
            await rt.upstreams.stop()


async def test_a_dripping_page_does_not_hold_up_the_scrape_of_another_replica() -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    slow = DrippingPage()
    async with running_server(good) as tts, running_server(slow) as other:
        rt = Runtime(two_pools(tts.http_url, other.http_url), clock=clock)
        await rt.upstreams.start()
        try:
            await slow.started.wait()
            await until(lambda: ("tts", "gpu0") in rt.upstreams.engine)
            assert good.requests == 1
        finally:
            slow.release.set()
            await rt.upstreams.stop()


def errors(rt: Runtime, replica: str, reason: str) -> float:
    pool = "other" if replica == "gpu1" else "tts"
    labels = {"pool": pool, "replica": replica, "reason": reason}
    return rt.metrics.registry.get_sample_value("headroom_engine_scrape_errors_total", labels) or 0


def age(rt: Runtime, replica: str) -> float | None:
    pool = "other" if replica == "gpu1" else "tts"
    labels = {"pool": pool, "replica": replica}
    return rt.metrics.registry.get_sample_value("headroom_engine_figures_age_seconds", labels)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_figure_that_is_not_a_finite_number_is_refused(value: str) -> None:
    with pytest.raises(EnginePageError, match="not a finite number") as info:
        parse_engine_metrics(vllm_page(value, "1"))
    assert info.value.reason == "not_finite"
    # elsewhere on the page it is no concern of the scrape's
    assert parse_engine_metrics(vllm_page("0", "1") + "other_gauge NaN\n") == (0.0, 1.0, 0.25)
    with pytest.raises(NoEngineFigures):
        parse_engine_metrics("other_gauge 1\n")


async def test_a_nan_page_is_counted_and_logged_once_until_the_replica_answers_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    lying = Page(vllm_page("0", "NaN"))
    async with running_server(good) as tts, running_server(lying) as other:
        rt = Runtime(two_pools(tts.http_url, other.http_url), clock=clock)
        scraped = count_scrapes(rt)
        with caplog.at_level(logging.WARNING, logger="headroom.upstreams"):
            await rt.upstreams.start()
            try:
                for n in (1, 2, 3):
                    if n > 1:
                        await until(lambda: clock.pending_timers >= 2)
                        clock.advance(INTERVAL_S)
                    await until(lambda: scraped == {"gpu0": n, "gpu1": n})  # noqa: B023
                    assert errors(rt, "gpu1", "not_finite") == n
                logged = [r for r in caplog.records if "not a finite number" in r.message]
                assert len(logged) == 1 and "other/gpu1" in logged[0].message
                lying.page = vllm_page("1", "1")  # it answers again: the next NaN is logged
                clock.advance(INTERVAL_S)
                await until(lambda: scraped["gpu1"] == 4)
                assert ("other", "gpu1") in rt.upstreams.engine
                lying.page = vllm_page("0", "+Inf")
                await until(lambda: clock.pending_timers >= 2)
                clock.advance(INTERVAL_S)
                await until(lambda: scraped["gpu1"] == 5)
                logged = [r for r in caplog.records if "not a finite number" in r.message]
                assert len(logged) == 2 and errors(rt, "gpu1", "not_finite") == 4
                assert errors(rt, "gpu0", "not_finite") == 0
            finally:
                await rt.upstreams.stop()


async def test_a_dripping_page_is_abandoned_at_the_time_bound_and_counted() -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    slow = DrippingPage()
    seen: list[tuple[str, EngineFigures | None]] = []
    async with running_server(good) as tts, running_server(slow) as other:
        rt = Runtime(two_pools(tts.http_url, other.http_url), clock=clock)
        rt.upstreams.on_scrape(lambda pool, replica, figures: seen.append((replica, figures)))
        await rt.upstreams.start()
        try:
            await slow.started.wait()
            await until(lambda: seen == [("gpu0", (0.0, 2.0, 0.25))])
            # the slow scrape's bound is due before the next pass: only it ends
            assert ENGINE_METRICS_TIMEOUT_S < INTERVAL_S
            clock.advance(ENGINE_METRICS_TIMEOUT_S)
            await until(lambda: len(seen) == 2)
            assert seen[1] == ("gpu1", None)
            assert errors(rt, "gpu1", "timeout") == 1 and good.requests == 1
            assert rt.upstreams.scraping
        finally:
            slow.release.set()
            await rt.upstreams.stop()


async def test_a_listener_that_raises_is_logged_and_counted_and_the_scrape_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    other = Page(vllm_page("0", "0"))
    async with running_server(good) as tts, running_server(other) as o:
        rt = Runtime(two_pools(tts.http_url, o.http_url), clock=clock)

        def broken(pool: str, replica: str, figures: object) -> None:
            raise RuntimeError("a listener's bug")

        rt.upstreams.on_scrape(broken)
        scraped = count_scrapes(rt)  # told after the broken one
        with caplog.at_level(logging.WARNING, logger="headroom.upstreams"):
            await rt.upstreams.start()
            try:
                for n in (1, 2, 3):
                    if n > 1:
                        await until(lambda: clock.pending_timers >= 2)
                        clock.advance(INTERVAL_S)
                    await until(lambda: scraped == {"gpu0": n, "gpu1": n})  # noqa: B023
                assert cap(rt) == CAP - 2  # the runtime's own listener ran each time
                assert errors(rt, "gpu0", "listener") == errors(rt, "gpu1", "listener") == 3
            finally:
                await rt.upstreams.stop()
    logged = [r for r in caplog.records if "listener" in r.message]
    assert len(logged) == 2  # once per replica
    assert all(r.exc_info and "a listener's bug" in str(r.exc_info[1]) for r in logged)


async def test_a_killed_scrape_task_is_started_again_after_one_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    other = Page(vllm_page("0", "0"))
    async with running_server(good) as tts, running_server(other) as o:
        rt = Runtime(two_pools(tts.http_url, o.http_url), clock=clock)
        scraped = count_scrapes(rt)
        await rt.upstreams.start()
        try:
            await until(lambda: scraped == {"gpu0": 1, "gpu1": 1} and clock.pending_timers >= 2)
            killed = rt.upstreams._scrapers[("tts", "gpu0")]
            with caplog.at_level(logging.ERROR, logger="headroom.upstreams"):
                killed.cancel()
                await until(
                    lambda: rt.upstreams._scrapers.get(("tts", "gpu0")) not in (None, killed)
                )
            assert any("tts/gpu0 was cancelled" in r.message for r in caplog.records)
            clock.advance(INTERVAL_S)
            await until(lambda: scraped == {"gpu0": 2, "gpu1": 2})
            await until(lambda: clock.pending_timers >= 2)
            clock.advance(INTERVAL_S)
            await until(lambda: scraped == {"gpu0": 3, "gpu1": 3})
        finally:
            await rt.upstreams.stop()
        assert not rt.upstreams.scraping and rt.upstreams._scrapers == {}


async def test_the_age_of_each_replicas_figures_grows_while_its_scrapes_fail() -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    other = Page("not_vllm 1\n")  # an engine without vLLM figures: no age, no error
    async with running_server(good) as tts, running_server(other) as o:
        settings = two_pools(tts.http_url, o.http_url)
        rt = Runtime(settings, clock=clock)
        scraped = count_scrapes(rt)
        await rt.upstreams.start()
        try:
            await until(lambda: scraped == {"gpu0": 1, "gpu1": 1})
            assert age(rt, "gpu0") == 0.0 and age(rt, "gpu1") is None
            good.page = "garbage{\n"
            for n in (2, 3):
                await until(lambda: clock.pending_timers >= 2)
                clock.advance(INTERVAL_S)
                await until(lambda: scraped == {"gpu0": n, "gpu1": n})  # noqa: B023
            assert age(rt, "gpu0") == 2 * INTERVAL_S
            assert errors(rt, "gpu0", "unparseable") == 2
            assert errors(rt, "gpu1", "unparseable") == 0
            assert ("tts", "gpu0") not in rt.upstreams.engine
            good.page = vllm_page("0", "1")
            clock.advance(INTERVAL_S)
            await until(lambda: scraped["gpu0"] == 4)
            assert age(rt, "gpu0") == 0.0
            off = settings.model_copy(
                update={"health": settings.health.model_copy(
                    update={"engine_metrics_interval_s": 0})}
            )  # fmt: skip
            rt.upstreams.apply(off)
            assert age(rt, "gpu0") is None  # scraping off: no figures to age
        finally:
            await rt.upstreams.stop()


async def test_a_replica_that_leaves_stops_being_scraped_without_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    good = Page(vllm_page("0", "2"))
    other = Page(vllm_page("0", "1"))
    async with running_server(good) as tts, running_server(other) as o:
        rt = Runtime(two_pools(tts.http_url, o.http_url), clock=clock)
        scraped = count_scrapes(rt)
        await rt.upstreams.start()
        try:
            await until(lambda: scraped == {"gpu0": 1, "gpu1": 1})
            assert set(rt.upstreams.engine) == {("tts", "gpu0"), ("other", "gpu1")}
            left = rt.upstreams._scrapers[("other", "gpu1")]
            with caplog.at_level(logging.ERROR, logger="headroom.upstreams"):
                rt.upstreams.apply(one_pool(tts.http_url))
                await until(left.done)
                await asyncio.sleep(0)
            assert set(rt.upstreams._scrapers) == {("tts", "gpu0")}
            assert set(rt.upstreams.engine) == {("tts", "gpu0")}
            assert age(rt, "gpu1") is None and caplog.records == []
            await until(lambda: clock.pending_timers >= 1)
            clock.advance(INTERVAL_S)
            await until(lambda: scraped == {"gpu0": 2, "gpu1": 1})
        finally:
            await rt.upstreams.stop()


def test_the_reconciler_takes_a_figure_that_is_not_finite_as_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = Runtime(two_pools("http://127.0.0.1:9", "http://127.0.0.1:9"), clock=FakeClock())
    for _ in range(2):
        rt.reconcile.observe("tts", "gpu0", 2.0)
    assert cap(rt) == CAP - 2
    with caplog.at_level(logging.WARNING, logger="headroom.reconcile"):
        for value in (float("nan"), float("inf")):
            rt.reconcile.observe("tts", "gpu0", value)
            rt.reconcile.observe("other", "gpu1", value)
    assert rt.reconcile.unadmitted("tts", "gpu0") is None
    assert cap(rt) == CAP - 2  # as after a failed scrape: held until the hold time ends
    assert sum("not a finite number" in r.message for r in caplog.records) == 4
