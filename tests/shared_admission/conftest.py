"""One behavioural suite, two admission backends: the in-process gate and the shared
gate on a real redis-server. A test that takes ``backend`` runs on both."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec, Reserve
from proxy.admission.gate import Gate
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import FakeClock
from proxy.errors import FallbackHint
from proxy.metering.series import Metrics
from tests.redis_support import RedisServer

__all__ = ["Backend", "eventually", "seed_generation"]


async def seed_generation(url: str, pool: str = "tts", prefix: str = "headroom:") -> None:
    """Mark the data generation as long established, so grants are not blocked for one
    TTL as they are after a data loss (or on a brand-new Redis)."""
    client = aioredis.from_url(url)
    await client.hset(f"{prefix}{{{pool}}}:gen", mapping={"id": "seed", "since": 0})
    await client.aclose()


async def eventually(predicate: Callable[[], bool], what: str = "condition") -> None:
    """Let the loop (and Redis round trips) run until ``predicate`` holds; bounded, so a
    broken test fails instead of hanging, but never asserts on how long it took."""
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{what} never became true")


@dataclass
class Backend:
    """Makes gates of one kind; ``gate(...)`` for a second gateway on the same store."""

    kind: str
    url: str | None
    clock: FakeClock = field(default_factory=FakeClock)
    made: list[Any] = field(default_factory=list)

    async def gate(
        self,
        caps: tuple[int, ...] = (1,),
        depth: int = 3,
        wait: float = 5.0,
        **options: Any,
    ) -> Any:
        metrics = Metrics()
        replicas = [ReplicaSpec(f"gpu{i}", c) for i, c in enumerate(caps)]
        queue = QueuePolicy(depth, wait)
        hint = FallbackHint(voice="lite")
        reserves: tuple[Reserve, ...] = tuple(options.pop("reserves", ()))
        # fake_time: the scripts read the test's FakeClock (ms) instead of Redis TIME, so
        # session-seconds (fair share) are the same on both backends.
        fake_time = options.pop("fake_time", False)
        gate: Gate | SharedGate
        if self.kind == "memory":
            core = PoolCore("tts", replicas, queue, session_estimate_s=10.0, reserves=reserves)
            # (each gate binds its own tenant gauges)
            gate = Gate([core], clock=self.clock, metrics=metrics, fallbacks={"tts": hint})
        else:
            assert self.url is not None
            clock = self.clock
            # On the test's clock, leases and heartbeats outlast any advance of it (the
            # renewals run on the event loop's clock).
            ttl = options.pop("lease_ttl_s", 1000.0 if fake_time else 10.0)
            store = RedisAdmission(self.url, gateway_id=f"gw{len(self.made)}", lease_ttl_s=ttl,
                                   heartbeat_ttl_s=ttl if fake_time else 3.0,
                                   clock_ms=(lambda: round(clock.now() * 1000)) if fake_time
                                   else None)  # fmt: skip
            gate = SharedGate(
                [SharedPoolSpec("tts", tuple(replicas), queue, hint, 10.0, reserves)],
                backend=store, clock=self.clock, metrics=metrics,
                lease_ttl_s=store.ttl_ms / 1000, **options,
            )  # fmt: skip
            await gate.start()
        self.made.append(gate)
        return gate

    async def settle(self) -> None:
        if self.kind == "memory":
            for _ in range(10):
                await asyncio.sleep(0)
        else:
            for gate in self.made:
                await gate.quiesce()


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    server: RedisServer | None = None
    if request.param == "redis":
        server = RedisServer()
        await seed_generation(server.url)
    env = Backend(request.param, server.url if server else None)
    try:
        yield env
    finally:
        for gate in env.made:
            if isinstance(gate, SharedGate):
                with contextlib.suppress(Exception):
                    await gate.stop()
        if server is not None:
            server.stop()
