"""The lease keeper's bookkeeping, with a stand-in for the Redis script (a pure unit:
the script itself is tested on a real redis-server in
tests/shared_admission/test_loop_stall.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from proxy.admission.lease_keeper import LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable
from proxy.clock import FakeClock


class Store:
    """What keep.lua answers: the ids it was not holding, or None for a new generation."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.generation = "g1"
        self.down = False
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.during: list[object] = []

    def keep(self, pool: str, generation: str, ids: Sequence[str]) -> tuple[str, ...] | None:
        self.calls.append((pool, tuple(ids)))
        for action in self.during:
            action()  # type: ignore[operator]
        if self.down:
            raise BackendUnavailable("down")
        if generation != self.generation:
            return None
        return tuple(i for i in ids if i in self.gone)


def make() -> tuple[LeaseKeeper, Store, FakeClock]:
    store, clock = Store(), FakeClock()
    return LeaseKeeper(store.keep, interval_s=1.0, monotonic=clock.now), store, clock


def test_it_renews_what_is_held_and_records_the_send_time() -> None:
    keeper, store, clock = make()
    keeper.hold("tts", "a")
    keeper.hold("tts", "b")
    keeper.drop("tts", "a")
    keeper.set_generation("tts", "g1")
    keeper.keep_once()
    assert store.calls == [("tts", ("b",))]
    clock.advance(0.4)
    assert keeper.kept_age("tts") == pytest.approx(0.4)


def test_nothing_is_sent_before_the_generation_is_known_or_when_nothing_is_held() -> None:
    keeper, store, _ = make()
    keeper.hold("tts", "a")
    keeper.set_generation("asr", "g1")
    keeper.keep_once()
    assert store.calls == []
    assert keeper.kept_age("tts") is None


@pytest.mark.parametrize("fault", ["gone", "generation", "down"])
def test_a_renewal_that_does_not_prove_every_lease_proves_nothing(fault: str) -> None:
    keeper, store, _ = make()
    keeper.hold("tts", "a")
    keeper.set_generation("tts", "g1")
    if fault == "gone":
        store.gone.add("a")
    elif fault == "generation":
        store.generation = "g2"
    else:
        store.down = True
    keeper.keep_once()
    assert keeper.kept_age("tts") is None


def test_a_lease_released_while_the_call_was_in_flight_is_not_a_lost_one() -> None:
    keeper, store, _ = make()
    keeper.hold("tts", "a")
    keeper.hold("tts", "b")
    keeper.set_generation("tts", "g1")
    store.gone.add("a")
    store.during.append(lambda: keeper.drop("tts", "a"))
    keeper.keep_once()
    assert keeper.kept_age("tts") == 0.0


def test_a_pool_the_loop_renewed_recently_is_left_to_the_loop() -> None:
    keeper, store, clock = make()
    keeper.hold("tts", "a")
    keeper.set_generation("tts", "g1")
    keeper.ticked("tts")
    clock.advance(0.5)
    keeper.keep_once()
    assert store.calls == []
    clock.advance(0.5)  # the tick is now late
    keeper.keep_once()
    assert store.calls == [("tts", ("a",))]


def test_the_thread_starts_renews_and_stops() -> None:
    """The daemon thread calls keep_once every interval and stop() joins it; ordering
    is by events, not durations."""
    import threading

    renewed = threading.Event()
    store = Store()
    store.during.append(renewed.set)
    closed: list[bool] = []
    keeper = LeaseKeeper(store.keep, interval_s=0.01, close=lambda: closed.append(True))
    keeper.hold("tts", "a")
    keeper.set_generation("tts", "g1")
    keeper.start()
    assert renewed.wait(30)
    keeper.stop()
    assert closed == [True]
    assert "running=False" in repr(keeper)


def test_a_stopped_tick_is_covered_within_one_interval_then_about_once_an_interval() -> None:
    """The keeper looks several times an interval: a pool whose tick stopped is renewed
    once its last renewal is late, and the keeper's own renewal then counts as the last
    one, so it does not renew at every look (nor retry a failed call at every look)."""
    keeper, store, clock = make()
    keeper.hold("tts", "a")
    keeper.set_generation("tts", "g1")
    keeper.ticked("tts")
    looks = 0

    def look() -> None:
        nonlocal looks
        clock.advance(keeper.check_period_s)
        looks += 1
        keeper.keep_once()

    while not store.calls:
        look()
    assert keeper.check_period_s < keeper.interval_s
    assert looks * keeper.check_period_s <= keeper.interval_s  # within one interval
    first = looks
    while len(store.calls) < 2:
        look()
    assert 1 < looks - first <= round(keeper.interval_s / keeper.check_period_s)
    store.down = True
    while len(store.calls) < 3:
        look()
    failed_at = looks
    while len(store.calls) < 4:
        look()
    assert looks - failed_at > 1  # a failed call is retried at the pace of a renewal
    keeper.ticked("tts")  # the loop runs again: the keeper leaves the pool to it
    calls = len(store.calls)
    for _ in range(2):
        look()
    assert len(store.calls) == calls
