"""Gang reservations keep every rule a session keeps (issue 26), on both backends (the
in-process gate; the shared gate on a real redis-server, over two gateways): the key's
``max_sessions`` counts held and claimed slots, the key's class decides against the
pool's reserves, ``hold_s`` and live reservations per key are bounded, a DELETE with
another key is answered like an unknown token, and on Redis any gateway claims any
token -- once, taking the lease over -- while the token appears in no log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.admission import Reserve
from proxy.admission.auth import TenantQuotas
from proxy.admission.interface import TenantQuota
from proxy.admission.reservations import (
    BadReservation,
    ReservationExpired,
    ReservationPool,
    Reservations,
    ReservationUnknown,
    parse_request,
)
from proxy.admission.session_lease import Lease
from proxy.admission.shared_gate import SharedGate
from proxy.errors import Refused, TenantLimitRefused
from proxy.settings import ApiKeySettings, ReservationSettings
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import Backend, seed_generation

AGENT = ApiKeySettings(name="agent", sha256="a" * 64, max_sessions=3)
GOLD = ApiKeySettings(name="gold", sha256="b" * 64, priority=10)
PLAIN = ApiKeySettings(name="plain", sha256="c" * 64)


@pytest.fixture
async def shared() -> AsyncIterator[Backend]:
    """Two gateways need the redis backend."""
    server = RedisServer()
    await seed_generation(server.url)
    env = Backend("redis", server.url)
    try:
        yield env
    finally:
        for gate in env.made:
            with contextlib.suppress(Exception):
                await gate.stop()
        server.stop()


async def gateways(backend: Backend, caps: tuple[int, ...] = (8,), **options: Any) -> list[Any]:
    """One gate in process; two gateways on one Redis."""
    made = [await backend.gate(caps, **options)]
    if backend.kind == "redis":
        made.append(await backend.gate(caps, **options))
    return made


def stores(
    backend: Backend, gates: list[Any], limits: ReservationSettings | None = None
) -> list[Reservations]:
    quotas = TenantQuotas()  # one gateway's (in process: the only one)
    return [Reservations(g, backend.clock, g.metrics.registry, quotas=quotas,
                         limits=(lambda: limits) if limits else None)
            for g in gates]  # fmt: skip


async def session(store: Reservations, token: str, key: ApiKeySettings) -> Lease:
    """A stage connection claiming its slot, counted as Runtime.authorize counts it (in
    process: the session's own count, unenforced, replaces the slot's)."""
    if store.quotas is not None and not isinstance(store.gate, SharedGate):
        store.quotas.reserve(key, "tts", 1.0, enforce=False)
    return await store.claim(token, "tts", key)


async def test_held_and_claimed_slots_count_against_max_sessions(backend: Backend) -> None:
    """A key with max_sessions 3 reserving alternately on two gateways, each token
    claimed on the other gateway: 3 slots, then 429 tenant_limit for a fourth
    reservation and for a plain session; a slot whose session ended makes room."""
    gates = await gateways(backend)
    here = stores(backend, gates)
    claimed: list[Lease] = []
    for i in range(3):
        r = await here[i % len(here)].reserve(["tts"], 30.0, AGENT)
        claimed.append(await session(here[(i + 1) % len(here)], r.token, AGENT))
    for store in here:
        with pytest.raises(TenantLimitRefused) as info:
            await store.reserve(["tts"], 30.0, AGENT)
        assert info.value.reason == "tenant_limit" and info.value.pool == "tts"
    if backend.kind == "redis":  # a plain session of the key, counted over every gateway
        with pytest.raises(TenantLimitRefused):
            await gates[1].admit("tts", quota=TenantQuota(AGENT.name, 3))
    held = await here[0].reserve(["tts"], 30.0, PLAIN)  # other keys are not affected
    assert await here[-1].release(held.token, PLAIN) == ["tts"]
    claimed.pop().release()
    if backend.kind == "memory":
        assert here[0].quotas is not None
        here[0].quotas.release(AGENT.name)  # (what the session's end releases)
    await backend.settle()
    again = await here[-1].reserve(["tts"], 30.0, AGENT)
    assert await here[0].release(again.token, AGENT) == ["tts"]
    for lease in claimed:
        lease.release()


async def test_a_reservation_takes_its_slots_in_the_keys_class(backend: Backend) -> None:
    """Only the slot kept for priority >= 10 is free: a priority-10 key's reservation
    takes it, a lower key's is refused pool_full, as their plain sessions would be."""
    gates = await gateways(backend, caps=(2,), reserves=(Reserve(10, slots=1),))
    here = stores(backend, gates)
    plain = await gates[0].acquire("tts")  # class 0 takes the one unreserved slot
    with pytest.raises(Refused) as info:
        await here[-1].reserve(["tts"], 5.0, PLAIN)
    assert info.value.reason == "pool_full"
    gold = await here[-1].reserve(["tts"], 5.0, GOLD)
    lease = await here[0].claim(gold.token, "tts", GOLD)
    assert lease.tenant is not None and lease.tenant.priority == 10
    lease.release()
    plain.release()
    await backend.settle()


async def test_a_full_queue_of_a_lower_class_does_not_keep_a_reservation_out(
    backend: Backend,
) -> None:
    """The queue is full of a class-0 waiter and only the slot kept for priority >= 10 is
    free: a priority-10 key's reservation takes that slot on both backends, as its plain
    session would (the in-process gate used to refuse it pool_full for the full queue)."""
    gates = await gateways(backend, caps=(2,), depth=1, reserves=(Reserve(10, slots=1),))
    here = stores(backend, gates)
    plain = await gates[0].acquire("tts")  # class 0 takes the one unreserved slot
    waiting = asyncio.ensure_future(gates[0].acquire("tts"))  # class 0 waits: queue full
    for _ in range(200):
        if sum(s.queue_depth for s in gates[0].statistics().values()) == 1:
            break
        await asyncio.sleep(0.005)
    gold = await here[-1].reserve(["tts"], 5.0, GOLD)
    lease = await here[0].claim(gold.token, "tts", GOLD)
    assert lease.tenant is not None and lease.tenant.priority == 10
    lease.release()
    plain.release()
    (await waiting).release()  # the waiter is served by the first slot freed
    await backend.settle()


async def test_hold_s_and_live_reservations_per_key_are_bounded(backend: Backend) -> None:
    limits = ReservationSettings(max_hold_s=20, default_hold_s=4, max_per_key=2)
    with pytest.raises(BadReservation):
        parse_request({"pools": ["tts"], "hold_s": 21}, ["tts"], limits)
    assert parse_request({"pools": ["tts"]}, ["tts"], limits) == (["tts"], 4.0)
    gates = await gateways(backend)
    here = stores(backend, gates, limits)
    live = [await here[i % len(here)].reserve(["tts"], 20.0, PLAIN) for i in range(2)]
    for store in here:  # over every gateway
        with pytest.raises(TenantLimitRefused) as info:
            await store.reserve(["tts"], 20.0, PLAIN)
        assert "max_per_key" in info.value.message
    other = await here[0].reserve(["tts"], 20.0, GOLD)  # a limit per key
    lease = await here[-1].claim(live[0].token, "tts", PLAIN)  # fully used: no longer live
    renewed = await here[0].reserve(["tts"], 20.0, PLAIN)
    for r, key in ((live[1], PLAIN), (other, GOLD), (renewed, PLAIN)):
        assert await here[-1].release(r.token, key) == ["tts"]
    lease.release()
    await backend.settle()


async def test_delete_with_another_key_is_answered_as_an_unknown_token(
    backend: Backend,
) -> None:
    gates = await gateways(backend)
    here = stores(backend, gates)
    r = await here[0].reserve(["tts"], 5.0, AGENT)
    for store in here:
        assert await store.release(r.token, PLAIN) is None  # exists, not this key's
        assert await store.release("never-issued", PLAIN) is None
        assert await store.release(r.token, None) is None
    lease = await here[-1].claim(r.token, "tts", AGENT)  # untouched by the attempts
    for store in here:  # ended: [] for its key only
        assert await store.release(r.token, PLAIN) is None
        assert await store.release(r.token, AGENT) == []
    lease.release()
    await backend.settle()


async def test_any_gateway_claims_once_and_owns_the_lease(shared: Backend) -> None:
    backend = shared
    a, b = await gateways(backend, caps=(2,))
    store_a, store_b = stores(backend, [a, b])
    r = await store_a.reserve(["tts"], 5.0, AGENT)
    results = await asyncio.gather(
        store_a.claim(r.token, "tts", AGENT), store_b.claim(r.token, "tts", AGENT),
        return_exceptions=True,
    )  # fmt: skip
    won = [x for x in results if isinstance(x, Lease)]
    assert len(won) == 1  # never a double claim
    assert all(isinstance(x, ReservationExpired | ReservationPool) for x in results
               if x not in won)  # fmt: skip
    (lease,) = won
    owner, other = (a, b) if lease in a.store.pools["tts"].leases.values() else (b, a)
    assert other.active == 0 and owner.active == 1
    await other.stop()  # the gateway that did not claim goes away: nothing changes
    await owner.renew()  # the claiming gateway renews it; nothing is lost
    assert owner.active == 1 and owner.store.pools["tts"].held == {"gpu0": 1}
    with pytest.raises(ReservationExpired):
        await (store_a if owner is a else store_b).claim(r.token, "tts", AGENT)
    lease.release()
    await backend.settle()
    await owner.renew()
    assert owner.store.pools["tts"].held == {"gpu0": 0}


async def test_unclaimed_slots_expire_and_a_late_claim_is_refused(backend: Backend) -> None:
    gates = await gateways(backend, caps=(1,))
    here = stores(backend, gates)
    r = await here[0].reserve(["tts"], 5.0, PLAIN)
    backend.clock.advance(5.1)  # the issuing gateway's timer gives the slot back
    await backend.settle()
    with pytest.raises(ReservationExpired):
        await here[-1].claim(r.token, "tts", PLAIN)
    lease = await gates[-1].acquire("tts")  # the held slot is free again
    lease.release()
    await backend.settle()


async def test_no_token_in_any_log_line(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gates = await gateways(backend, caps=(1,))
    here = stores(backend, gates)
    tokens = []
    r = await here[0].reserve(["tts"], 5.0, PLAIN)
    tokens.append(r.token)
    with pytest.raises(Refused):
        await here[-1].reserve(["tts"], 5.0, PLAIN)
    with pytest.raises(ReservationUnknown):
        await here[-1].claim(r.token, "tts", GOLD)
    lease = await here[-1].claim(r.token, "tts", PLAIN)
    lease.release()
    await backend.settle()
    r = await here[-1].reserve(["tts"], 5.0, PLAIN)
    tokens.append(r.token)
    backend.clock.advance(6)  # expires (logged)
    await backend.settle()
    assert "reservation expired" in caplog.text
    for token in tokens:
        assert token not in caplog.text
    if backend.kind == "redis":  # Redis holds only its digest
        import redis.asyncio as aioredis

        assert backend.url is not None
        client = aioredis.from_url(backend.url)
        try:
            keys = [k.decode() for k in await client.keys("*")]
            for key in keys:
                kind = (await client.type(key)).decode()
                dump = await client.dump(key) if kind else b""
                assert all(t.encode() not in (dump or b"") for t in tokens)
            assert all(t not in k for t in tokens for k in keys)
        finally:
            await client.aclose()


async def test_a_gateway_that_stops_leaves_its_reservations_claimable(
    shared: Backend,
) -> None:
    backend = shared
    a, b = await gateways(backend, caps=(1,))
    store_a, store_b = stores(backend, [a, b])
    r = await store_a.reserve(["tts"], 5.0, PLAIN)
    store_a.close()
    await a.stop()
    lease = await store_b.claim(r.token, "tts", PLAIN)
    assert isinstance(b, SharedGate) and b.active == 1
    lease.release()
    await backend.settle()


async def test_a_reservation_whose_gateway_is_gone_lapses_at_its_deadline(
    shared: Backend,
) -> None:
    """Nobody renews unclaimed slots: with the issuing gateway gone, Redis gives them
    back at the reservation's deadline (its own clock), and a late claim is refused."""
    a, b = await gateways(shared, caps=(1,), depth=0)  # refused at once until then
    store_a, store_b = stores(shared, [a, b])
    r = await store_a.reserve(["tts"], 0.2, PLAIN)
    store_a.close()
    await a.stop()
    lease: Lease | None = None
    for _ in range(400):  # bounded: Redis's clock passes the deadline
        try:
            lease = await b.acquire("tts")
            break
        except Refused:
            await asyncio.sleep(0.01)
    assert lease is not None
    with pytest.raises(ReservationExpired):
        await store_b.claim(r.token, "tts", PLAIN)
    lease.release()
    await shared.settle()


async def test_without_auth_there_is_no_key_to_bound(backend: Backend) -> None:
    """max_per_key bounds a key's reservations; with authentication off (no key) many
    concurrent calls each hold one, as before."""
    limits = ReservationSettings(max_per_key=1)
    gates = await gateways(backend)
    here = stores(backend, gates, limits)
    held = [await here[i % len(here)].reserve(["tts"], 5.0, None) for i in range(3)]
    for r in held:
        assert await here[0].release(r.token, None) == ["tts"]
    await backend.settle()
