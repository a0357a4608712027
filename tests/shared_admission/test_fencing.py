"""Self-fencing on the injected clock: a gateway that cannot renew ends its sessions
before last renewal + TTL - margin, unless told to keep them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock
from proxy.errors import Refused
from proxy.metering.series import Metrics
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


def make(url: str, clock: FakeClock, keep: bool = False) -> tuple[SharedGate, Metrics]:
    metrics = Metrics()
    gate = SharedGate(
        [SharedPoolSpec("tts", (ReplicaSpec("gpu0", 2),), QueuePolicy(0, 1))],
        backend=RedisAdmission(url, gateway_id="gw", lease_ttl_s=10, timeout_s=0.2),
        clock=clock, metrics=metrics, lease_ttl_s=10, renew_interval_s=2, fence_margin_s=1,
        on_backend_loss="keep" if keep else "close",
    )  # fmt: skip
    return gate, metrics


@pytest.mark.parametrize("keep", [False, True])
async def test_fence_fires_before_the_lease_could_lapse(server: RedisServer, keep: bool) -> None:
    clock = FakeClock()
    gate, metrics = make(server.url, clock, keep)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(pool))
    try:
        lease = await gate.acquire("tts")
        await gate.renew()  # proof at t0
        clock.advance(5)
        server.stop()
        await gate.renew()  # fails: the proof stays at t0
        assert not gate.available
        clock.advance(3.9)  # t0 + 8.9 < t0 + TTL - margin
        assert fenced == []
        clock.advance(0.2)  # t0 + 9.1: past TTL - margin, before the TTL
        assert fenced == ([] if keep else ["tts"])
        closes = metrics.registry.get_sample_value(
            "headroom_lease_loss_closes_total", {"pool": "tts"}
        )
        assert closes == 1
        with pytest.raises(Refused) as info:
            await gate.acquire("tts")
        assert info.value.reason == "backend_unavailable"
        lease.release()  # retried in the background until the lease would have lapsed
    finally:
        await gate.stop()


async def test_a_renewal_that_finds_a_lease_gone_fences_at_once(server: RedisServer) -> None:
    clock = FakeClock()
    gate, _ = make(server.url, clock)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    try:
        lease = await gate.acquire("tts")
        server.flush()  # as if the lease had expired while this gateway was paused
        await seed_generation(server.url)
        await gate.renew()
        assert fenced and "expired" in fenced[0]
        lease.release()
    finally:
        await gate.stop()


async def test_a_lease_released_during_the_renewal_call_is_not_lost(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session ends while the renewal is in flight and its release lands in Redis
    before the renewal's script runs: Redis no longer knows the lease, which is not a
    lost lease (its session is over); the other session must keep running."""
    clock = FakeClock()
    gate, metrics = make(server.url, clock)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    try:
        ending = await gate.acquire("tts")
        staying = await gate.acquire("tts")
        tick = gate.backend.tick

        async def release_lands_first(*args: object, **kwargs: object) -> object:
            ending.release()  # after the renewal took its list of leases
            await gate.quiesce()  # the release has landed in Redis
            return await tick(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(gate.backend, "tick", release_lands_first)
        await gate.renew()
        assert fenced == []
        assert metrics.registry.get_sample_value(
            "headroom_lease_loss_closes_total", {"pool": "tts"}
        ) in (None, 0)
        monkeypatch.setattr(gate.backend, "tick", tick)
        await gate.renew()  # the other lease is renewed as usual
        assert fenced == []
        staying.release()
    finally:
        await gate.stop()


async def test_a_fence_acts_once_per_set_of_lost_leases(server: RedisServer) -> None:
    """A fenced session still ending (its lease still found gone at each renewal) does
    not fence again: a session admitted after the fence keeps running; a lease of that
    later session being lost fences once more."""
    clock = FakeClock()
    gate, metrics = make(server.url, clock)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))

    def closes() -> float | None:
        return metrics.registry.get_sample_value(
            "headroom_lease_loss_closes_total", {"pool": "tts"}
        )

    try:
        old = await gate.acquire("tts")
        server.flush()  # the lease lapsed while this gateway could not renew
        await seed_generation(server.url)
        await gate.renew()
        assert len(fenced) == 1  # old's session is told to close; it has not ended yet
        new = await gate.acquire("tts")  # admitted after the fence
        await gate.renew()
        await gate.renew()
        assert len(fenced) == 1 and closes() == 1  # old's leftovers do not close new
        server.flush()  # now new's lease is lost too
        await seed_generation(server.url)
        await gate.renew()
        assert len(fenced) == 2 and closes() == 2
        await gate.renew()
        assert len(fenced) == 2
        old.release()
        new.release()
    finally:
        await gate.stop()


async def test_the_deadline_fence_does_not_repeat_for_sessions_already_fenced(
    server: RedisServer,
) -> None:
    """Renewals fail past TTL - margin: the fence fires; when Redis answers again and
    finds those leases gone, the sessions already told to close do not fence again."""
    clock = FakeClock()
    gate, metrics = make(server.url, clock)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    try:
        lease = await gate.acquire("tts")
        await gate.renew()
        server.stop()
        clock.advance(9.1)  # past TTL - margin
        assert len(fenced) == 1
        server.start()  # an empty Redis: the lease is gone
        await seed_generation(server.url)
        await gate.renew()
        assert len(fenced) == 1
        later = await gate.acquire("tts")
        await gate.renew()
        assert len(fenced) == 1
        assert (
            metrics.registry.get_sample_value("headroom_lease_loss_closes_total", {"pool": "tts"})
            == 1
        )
        lease.release()
        later.release()
    finally:
        await gate.stop()
