"""LoopWatch on a fake monotonic clock: the loop-side beat observes its lateness, the
thread-side check logs a stall once while it lasts and once when it ends."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from proxy.clock import FakeClock
from proxy.metering.loop_lateness import LoopWatch


def test_a_stall_is_logged_once_while_it_lasts_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    registry = CollectorRegistry()
    watch = LoopWatch(registry, interval_s=0.25, stall_s=1.0, monotonic=clock.now)
    watch.beat()
    caplog.set_level(logging.WARNING, "headroom.loop")
    clock.advance(1.0)  # 0.75 s late: not yet a stall
    watch.check()
    assert caplog.records == []
    for _ in range(8):  # blocked for a few seconds: one line, one count
        clock.advance(0.5)
        watch.check()
    assert [r.getMessage().startswith("event loop blocked") for r in caplog.records] == [True]
    assert registry.get_sample_value("headroom_event_loop_stalls_total") == 1
    watch.beat()  # the loop runs again
    assert registry.get_sample_value("headroom_event_loop_lag_seconds_count") == 2
    assert registry.get_sample_value("headroom_event_loop_lag_seconds_bucket", {"le": "5.0"}) == 2
    assert registry.get_sample_value("headroom_event_loop_lag_seconds_bucket", {"le": "2.5"}) == 1
    watch.check()
    assert caplog.records[-1].getMessage() == "event loop ran again after a stall of 4.8 s"
    assert watch.stalls == 1


async def test_start_and_stop_on_a_running_loop() -> None:
    """Started on the loop, the beat keeps observing until stop(); ordering by polling
    the histogram, not by durations."""
    registry = CollectorRegistry()
    watch = LoopWatch(registry, interval_s=0.01, stall_s=10.0)
    watch.start()

    def beats() -> float:
        return registry.get_sample_value("headroom_event_loop_lag_seconds_count") or 0.0

    for _ in range(10_000):
        if beats() >= 3:
            break
        await asyncio.sleep(0.01)
    assert beats() >= 3
    watch.stop()
    stopped = beats()
    for _ in range(5):
        await asyncio.sleep(0.02)
    assert beats() == stopped
