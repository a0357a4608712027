"""The two gates agree: the same history of sessions -- arrivals, releases after given
lengths, waits in the queue, queue timeouts, on an injected clock -- gives the same
admissions, queue positions, refusals (reason) and Retry-After on the in-process
:class:`~proxy.admission.gate.Gate` and on the :class:`~proxy.admission.shared_gate.SharedGate`
over a real redis-server.

Both estimate session lengths with one :class:`~proxy.admission.retry_after.SessionLengths`
per pool and give Retry-After by one rule
(:func:`~proxy.admission.retry_after.refusal_estimate_s`, then
:func:`~proxy.admission.retry_after.retry_after_s` with a per-pool jitter seeded alike),
so even the jitter matches draw for draw. The shared gate's forecast counts the
sessions held over every gateway as of its last renewal: the history renews it after
every step, as its loop does. Histories are drawn from a seeded generator (a bounded,
deterministic set); each step waits for both gates to settle (bounded, no timed
assertion).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.session_lease import Lease, Waiting
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock
from proxy.errors import Refused
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import eventually, seed_generation

ESTIMATE_S = 10.0
WAIT_S = 6.0


@dataclass
class Side:
    """One gate under the history, and what it answered."""

    gate: Any
    clock: FakeClock
    held: list[Lease] = field(default_factory=list)
    waiting: list[asyncio.Task[Lease]] = field(default_factory=list)
    said: list[tuple[Any, ...]] = field(default_factory=list)

    async def arrive(self) -> None:
        try:
            entry = await self.gate.admit("tts")
        except Refused as refused:
            self.said.append(("refused", refused.reason, refused.retry_after_s))
            return
        if isinstance(entry, Lease):
            self.held.append(entry)
            self.said.append(("admitted", entry.replica))
            return
        assert isinstance(entry, Waiting)
        self.said.append(("queued", entry.position))
        self.waiting.append(asyncio.ensure_future(entry.wait()))

    def release(self, index: int) -> None:
        self.held.pop(index).release()

    def collect(self) -> None:
        """Take the outcomes of the waits that ended, in the order they were queued."""
        for task in [t for t in self.waiting if t.done()]:
            self.waiting.remove(task)
            try:
                lease = task.result()
            except Refused as refused:
                self.said.append(("wait refused", refused.reason, refused.retry_after_s))
            else:
                self.held.append(lease)
                self.said.append(("wait admitted", lease.replica))


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    server = RedisServer()
    await seed_generation(server.url)
    try:
        yield server.url
    finally:
        server.stop()


def _replicas(caps: tuple[int, ...]) -> list[ReplicaSpec]:
    return [ReplicaSpec(f"gpu{i}", cap) for i, cap in enumerate(caps)]


async def _settle(memory: Side, shared: Side) -> None:
    """Let both gates finish what the step started: the memory gate decides in the
    step; the shared gate's wake-ups, deadlines and releases go through Redis."""
    for _ in range(5):
        await asyncio.sleep(0)
    expect = (memory.gate.active, memory.gate.queued, len([t for t in memory.waiting if t.done()]))

    def same() -> bool:
        done = len([t for t in shared.waiting if t.done()])
        return (shared.gate.active, shared.gate.queued, done) == expect

    await eventually(same, "the shared gate settled as the in-process one")
    await shared.gate.quiesce()
    await shared.gate.renew()
    memory.collect()
    shared.collect()


@pytest.mark.parametrize("seed", range(8))
async def test_one_history_gives_the_same_answers_on_both_gates(redis_url: str, seed: int) -> None:
    rng = random.Random(seed)
    caps = rng.choice([(2,), (1, 2), (3,)])
    depth = rng.choice([2, 3])
    queue = QueuePolicy(depth, WAIT_S)
    memory = Side(Gate([PoolCore("tts", _replicas(caps), queue, session_estimate_s=ESTIMATE_S)],
                       clock=FakeClock()), FakeClock())  # fmt: skip
    memory.clock = memory.gate.clock
    clock = FakeClock()
    store = RedisAdmission(redis_url, gateway_id="gw0", lease_ttl_s=1000.0,
                           heartbeat_ttl_s=1000.0,
                           clock_ms=lambda: round(clock.now() * 1000))  # fmt: skip
    gate = SharedGate([SharedPoolSpec("tts", tuple(_replicas(caps)), queue, None, ESTIMATE_S)],
                      backend=store, clock=clock, lease_ttl_s=1000.0)  # fmt: skip
    shared = Side(gate, clock)
    await gate.start()
    try:
        for _ in range(30):
            step = rng.random()
            if step < 0.6:
                await memory.arrive()
                await shared.arrive()
            elif step < 0.8 and memory.held:
                index = rng.randrange(len(memory.held))
                memory.release(index)
                shared.release(index)
            else:
                seconds = rng.choice([0.75, 1.5, 3.0, 7.0])
                memory.clock.advance(seconds)
                shared.clock.advance(seconds)
            await _settle(memory, shared)
            assert shared.said == memory.said
        kinds = {said[0] for said in memory.said}
        assert {"admitted", "queued", "refused"} <= kinds  # the history exercised them
    finally:
        for side in (memory, shared):
            for task in side.waiting:
                task.cancel()
            for lease in side.held:
                lease.release()
        await gate.stop()
