"""Gang reservations (issue 19, proxy/admission/reservations.py) on both admission backends: the
in-process gate and the shared gate on a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.reservations import (
    ReservationExpired,
    ReservationPool,
    Reservations,
    ReservationUnknown,
)
from proxy.admission.session_lease import Lease
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock
from proxy.errors import FallbackHint, Refused
from proxy.metering.series import Metrics
from proxy.settings import ApiKeySettings
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

#: Two stages with different free slots: ASR 2 + 1, TTS 2.
CAPS = {"asr": (2, 1), "tts": (2,)}
#: A key other than the reservation's (None: auth off).
OTHER_KEY = ApiKeySettings(name="someone-else", sha256="0" * 64)


@dataclass
class Env:
    kind: str
    url: str | None
    clock: FakeClock = field(default_factory=FakeClock)
    gates: list[Any] = field(default_factory=list)

    async def gate(self, depth: int = 4) -> Gate | SharedGate:
        metrics = Metrics()
        queue = QueuePolicy(depth, 5.0)
        specs = {p: [ReplicaSpec(f"{p}{i}", c) for i, c in enumerate(caps)]
                 for p, caps in CAPS.items()}  # fmt: skip
        gate: Gate | SharedGate
        if self.kind == "memory":
            cores = [PoolCore(p, r, queue, session_estimate_s=10.0) for p, r in specs.items()]
            gate = Gate(cores, clock=self.clock, metrics=metrics,
                        fallbacks={"tts": FallbackHint(voice="lite")})  # fmt: skip
        else:
            assert self.url is not None
            store = RedisAdmission(self.url, gateway_id=f"gw{len(self.gates)}")
            gate = SharedGate(
                [SharedPoolSpec(p, tuple(r), queue, FallbackHint(voice="lite"), 10.0)
                 for p, r in specs.items()],
                backend=store, clock=self.clock, metrics=metrics,
                lease_ttl_s=store.ttl_ms / 1000,
            )  # fmt: skip
            await gate.start()
        self.gates.append(gate)
        return gate

    async def settle(self) -> None:
        for _ in range(10):
            await asyncio.sleep(0)
        for gate in self.gates:
            if isinstance(gate, SharedGate):
                await gate.quiesce()


@pytest.fixture(params=["memory", "redis"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    server: RedisServer | None = None
    if request.param == "redis":
        server = RedisServer()
        for pool in CAPS:
            await seed_generation(server.url, pool)
    made = Env(request.param, server.url if server else None)
    try:
        yield made
    finally:
        for gate in made.gates:
            if isinstance(gate, SharedGate):
                with contextlib.suppress(Exception):
                    await gate.stop()
        if server is not None:
            server.stop()


async def free_slots(env: Env, store: Reservations, pool: str) -> int:
    """How many slots ``pool`` gives now (taken without queueing, then given back)."""
    await env.settle()
    taken: list[Lease] = []
    with contextlib.suppress(Refused):
        while len(taken) < 10:
            taken.append(await store.gate.take_now(pool, None))
    for lease in taken:
        lease.release()
    await env.settle()
    return len(taken)


def slots(gate: Gate | SharedGate, outcome: str, pool: str) -> float:
    value = gate.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "headroom_reservation_slots_total", {"pool": pool, "outcome": outcome}
    )
    return value or 0.0


async def test_concurrent_reservations_take_all_or_nothing(env: Env) -> None:
    """Twelve reservations at once, over two gateways on the redis backend: exactly as
    many as the tighter stage (TTS, 2) are granted, each holding one slot in both;
    every refused one holds nothing; nobody queued; after release every slot is free."""
    gates = [await env.gate()]
    if env.kind == "redis":
        gates.append(await env.gate())
    stores = [Reservations(g, env.clock, None) for g in gates]
    outcomes = await asyncio.gather(
        *(stores[i % len(stores)].reserve(["tts", "asr"], 5.0) for i in range(12)),
        return_exceptions=True,
    )
    granted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(granted) == 2
    assert all(isinstance(r, Refused) and r.reason == "pool_full" for r in refused)
    assert all(r.pools == ("asr", "tts") for r in granted)
    assert sum(g.queued for g in gates) == 0
    probe = stores[0]
    assert await free_slots(env, probe, "asr") == 1  # 3 - 2: refused ones kept nothing
    assert await free_slots(env, probe, "tts") == 0
    for i, r in enumerate(granted):  # on Redis, any gateway releases any reservation
        assert await stores[-1 - i % len(stores)].release(r.token, None) == ["asr", "tts"]
    assert await free_slots(env, probe, "asr") == 3
    assert await free_slots(env, probe, "tts") == 2


async def test_a_refused_stage_is_named_and_the_other_slot_is_given_back(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, None)
    holders = [await store.gate.take_now("tts", None) for _ in range(2)]
    with pytest.raises(Refused) as info:
        await store.reserve(["asr", "tts"], 5.0)
    assert info.value.pool == "tts" and info.value.reason == "pool_full"
    assert info.value.fallback is not None and info.value.retry_after_s >= 1
    assert await free_slots(env, store, "asr") == 3
    for lease in holders:
        lease.release()


async def test_a_pool_with_waiters_refuses_a_reservation_no_barging(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, None)
    holders = [await gate.acquire("tts") for _ in range(2)]
    waiter = asyncio.ensure_future(gate.acquire("tts"))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if gate.queued == 1:
            break
    holders.pop().release()  # the waiter is handed this slot, not the reservation
    with pytest.raises(Refused):
        await store.reserve(["tts"], 5.0)
    lease = await waiter
    lease.release()
    for h in holders:
        h.release()


async def test_unused_slots_expire_after_hold_s(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, gate.metrics.registry)
    reservation = await store.reserve(["asr", "tts"], 5.0)
    asr = await store.claim(reservation.token, "asr", None)  # ASR connected in time
    env.clock.advance(4.9)
    await env.settle()
    assert slots(gate, "expired_unused", "tts") == 0
    env.clock.advance(0.2)
    await env.settle()
    with pytest.raises(ReservationExpired):
        await store.claim(reservation.token, "tts", None)
    assert await free_slots(env, store, "tts") == 2  # the unused TTS slot is free
    assert await free_slots(env, store, "asr") == 2  # the claimed ASR slot is not
    assert slots(gate, "expired_unused", "tts") == 1 and slots(gate, "used", "asr") == 1
    asr.release()  # the stage connection ended
    assert await free_slots(env, store, "asr") == 3


async def test_claims_refuse_every_token_without_a_slot_for_the_pool(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, None)
    reservation = await store.reserve(["tts"], 5.0)
    with pytest.raises(ReservationUnknown):
        await store.claim("not-a-token", "tts", None)
    with pytest.raises(ReservationUnknown):  # bound to its key
        await store.claim(reservation.token, "tts", OTHER_KEY)
    with pytest.raises(ReservationPool):
        await store.claim(reservation.token, "asr", None)
    lease = await store.claim(reservation.token, "tts", None)
    with pytest.raises(ReservationExpired):  # fully used: ended
        await store.claim(reservation.token, "tts", None)
    assert await store.release(reservation.token, None) == []
    assert await store.release("not-a-token", None) is None
    lease.release()
    assert await free_slots(env, store, "tts") == 2


async def test_release_and_shutdown_free_the_unclaimed_slots(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, gate.metrics.registry)
    first = await store.reserve(["asr", "tts"], 5.0)
    tts = await store.claim(first.token, "tts", None)
    assert await store.release(first.token, None) == ["asr"]
    with pytest.raises(ReservationExpired):
        await store.claim(first.token, "asr", None)
    second = await store.reserve(["asr"], 5.0)
    store.close()
    if env.kind == "memory":  # released at shutdown
        assert store.get(second.token) is None
    else:  # on Redis it outlives the gateway that issued it: another one claims it
        assert await free_slots(env, store, "asr") == 2
        other = Reservations(await env.gate(), env.clock, None)
        (await other.claim(second.token, "asr", None)).release()
    assert await free_slots(env, store, "asr") == 3
    assert await free_slots(env, store, "tts") == 1
    tts.release()
    assert await free_slots(env, store, "tts") == 2
    assert slots(gate, "released", "asr") == 1
    assert slots(gate, "closed", "asr") == (1 if env.kind == "memory" else 0)
    assert env.clock.pending_timers == 0 or env.kind == "redis"  # (fence timers)


async def test_a_reservation_cancelled_midway_holds_nothing(env: Env) -> None:
    gate = await env.gate()
    store = Reservations(gate, env.clock, None)
    task = asyncio.ensure_future(store.reserve(["asr", "tts"], 5.0))
    for _ in range(3):  # cancel once it has started (the memory gate takes both at once)
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        await store.release(task.result().token, None)
    assert await free_slots(env, store, "asr") == 3
    assert await free_slots(env, store, "tts") == 2
