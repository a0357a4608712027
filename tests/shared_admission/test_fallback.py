"""Fallback that does not wait for nothing (issue 26, item 8), on both backends.

An opted-in session whose pool has no slot now goes to the fallback pool at once when
that has one, rather than waiting in its own pool's queue (up to ``max_wait_s``) while
the fallback stands idle; with no slot in either it waits in its own pool's queue as
before, behind the sessions already waiting there (a newcomer never overtakes them).
The decision is :func:`proxy.relay.admit.enter`'s, over a real gate (in-process, or the
shared gate on a real redis-server).
"""

from __future__ import annotations

from typing import Any

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.session_lease import Lease, Waiting
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.client_request import ClientRequest
from proxy.errors import FallbackHint
from proxy.metering.series import Metrics
from proxy.relay.admit import enter
from proxy.settings import RouteSettings
from tests.shared_admission.conftest import Backend, seed_generation

OPTED_IN = ClientRequest.of(
    {"type": "http", "headers": [(b"x-headroom-allow-fallback", b"1")], "query_string": b""}
)
PLAIN = ClientRequest.of({"type": "http", "headers": [], "query_string": b""})
ROUTE = RouteSettings(path="/v1/speech", pool="tts", protocol="passthrough-http")


class _Services:
    """What :func:`enter` asks of the gateway for a session without a reservation token:
    the gate, and whether the key may use the fallback pool (no auth here: yes)."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate


async def two_pools(backend: Backend) -> Any:
    """``tts`` (1 slot, a queue of 3 waiting up to 10 s) falling back to ``lite`` (1 slot,
    no queue)."""
    tts = (ReplicaSpec("gpu0", 1),)
    lite = (ReplicaSpec("cpu0", 1),)
    hint = FallbackHint(voice="lite-1", pool="lite")
    gate: Gate | SharedGate
    if backend.kind == "memory":
        gate = Gate([PoolCore("tts", tts, QueuePolicy(3, 10.0), session_estimate_s=10.0),
                     PoolCore("lite", lite, QueuePolicy(0, 10.0), session_estimate_s=10.0)],
                    clock=backend.clock, metrics=Metrics(), fallbacks={"tts": hint})  # fmt: skip
    else:
        assert backend.url is not None
        await seed_generation(backend.url, "lite")
        store = RedisAdmission(backend.url, gateway_id="gw-fallback", lease_ttl_s=10.0,
                               heartbeat_ttl_s=3.0)  # fmt: skip
        gate = SharedGate(
            [SharedPoolSpec("tts", tts, QueuePolicy(3, 10.0), hint, 10.0),
             SharedPoolSpec("lite", lite, QueuePolicy(0, 10.0), None, 10.0)],
            backend=store, clock=backend.clock, metrics=Metrics(),
            lease_ttl_s=store.ttl_ms / 1000,
        )  # fmt: skip
        await gate.start()
    backend.made.append(gate)
    return gate


async def test_a_full_pool_sends_an_opted_in_session_to_a_free_fallback_at_once(
    backend: Backend,
) -> None:
    gate = await two_pools(backend)
    services = _Services(gate)
    own, pool = await enter(services, ROUTE, OPTED_IN)  # type: ignore[arg-type]
    assert isinstance(own, Lease) and pool is None  # a slot in its own pool: taken
    second, pool = await enter(services, ROUTE, OPTED_IN)  # type: ignore[arg-type]
    # tts is full and would queue it; lite has a slot: there, at once
    assert isinstance(second, Lease) and pool == "lite" and second.pool == "lite"
    assert gate.queued == 0
    # without the opt-in the same session waits in its own pool's queue
    plain, pool = await enter(services, ROUTE, PLAIN)  # type: ignore[arg-type]
    assert isinstance(plain, Waiting) and pool is None
    for entry in (own, second):
        entry.release()
    lease = await plain.wait()
    lease.release()
    await backend.settle()
    assert gate.active == 0 and gate.queued == 0


async def test_with_no_slot_anywhere_it_waits_behind_the_queue(backend: Backend) -> None:
    gate = await two_pools(backend)
    services = _Services(gate)
    holder, _ = await enter(services, ROUTE, PLAIN)  # type: ignore[arg-type]
    lite, _ = await enter(services, ROUTE, OPTED_IN)  # type: ignore[arg-type]
    assert isinstance(holder, Lease) and isinstance(lite, Lease) and lite.pool == "lite"
    first, _ = await enter(services, ROUTE, PLAIN)  # type: ignore[arg-type]
    newcomer, pool = await enter(services, ROUTE, OPTED_IN)  # type: ignore[arg-type]
    # neither pool has a slot: the newcomer queues in its own pool, after the first
    assert isinstance(first, Waiting) and isinstance(newcomer, Waiting) and pool is None
    holder.release()
    granted = await first.wait()  # the earlier waiter gets the slot ...
    assert granted.pool == "tts"
    await backend.settle()
    assert gate.queued == 1  # ... and the newcomer still waits
    lite.release()
    granted.release()
    (await newcomer.wait()).release()
    await backend.settle()
    assert gate.active == 0 and gate.queued == 0
