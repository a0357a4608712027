"""Self-fencing on the injected clock: a gateway that cannot renew ends its sessions
before last renewal + TTL - margin, unless told to keep them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.clock import FakeClock
from proxy.errors import Refused
from proxy.metrics import Metrics
from proxy.shared_gate import SharedGate, SharedPoolSpec
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
