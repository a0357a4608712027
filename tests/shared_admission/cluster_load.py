"""Sessions against real shared gates on a Redis Cluster, for the cluster tests: every
gateway is a :class:`~proxy.admission.shared_gate.SharedGate` with its own
:class:`~proxy.admission.redis_backend.RedisAdmission` (its own connections, leases,
renewals and wake-up loops), and a stand-in for the engines counts the streams that
run on each replica at every start and at every sample, against the replica's cap.

A session runs from its admission until it ends or its gateway fences its pool (the
gateway's ``on_fence``: the engine stream stops then, before the leases lapse).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock
from proxy.errors import Refused

__all__ = ["STOP_BOUND_S", "Engines", "Fleet", "Stream", "cancel_all", "seed_generations"]


def seed_generations(url: str, pools: list[str], prefix: str = "headroom:") -> None:
    """Mark each pool's data generation as long established (grants are not blocked for
    one TTL as on a brand-new Redis)."""
    from redis.cluster import ClusterNode, RedisCluster

    host, port = url.split("://")[1].split(",")[0].rsplit(":", 1)
    client: Any = RedisCluster(startup_nodes=[ClusterNode(host, int(port))],
                               socket_timeout=5.0, socket_connect_timeout=5.0)  # fmt: skip
    try:
        for pool in pools:
            client.hset(f"{prefix}{{{pool}}}:gen", mapping={"id": "seed", "since": 0})
    finally:
        client.close()


@dataclass(eq=False)
class Stream:
    """One running session: its gateway, pool and replica, ended once."""

    gate: int
    pool: str
    replica: str
    lease: Any
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    fenced: bool = False


@dataclass
class Engines:
    """The engines' view: streams running per (pool, replica), checked against the
    caps at every start and by :meth:`sample`."""

    caps: dict[str, int]
    running: Counter[tuple[str, str]] = field(default_factory=Counter)
    samples: int = 0
    over: int = 0
    worst: dict[tuple[str, str], int] = field(default_factory=dict)

    def start(self, pool: str, replica: str) -> None:
        self.running[(pool, replica)] += 1
        self._check()

    def stop(self, pool: str, replica: str) -> None:
        self.running[(pool, replica)] -= 1

    def _check(self) -> None:
        self.samples += 1
        for (pool, replica), n in self.running.items():
            self.worst[(pool, replica)] = max(self.worst.get((pool, replica), 0), n)
            if n > self.caps[replica]:
                self.over += 1

    async def sample(self, every_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


@dataclass
class Fleet:
    """``gateways`` shared gates over ``pools`` (each with ``caps``), on ``url``."""

    url: str
    pools: list[str]
    gateways: int = 2
    caps: tuple[int, ...] = (2, 2)
    lease_ttl_s: float = 10.0
    renew_interval_s: float = 1.0
    fence_margin_s: float = 1.0
    timeout_s: float = 0.5
    remaps: dict[int, Callable[[tuple[str, int]], tuple[str, int]]] = field(default_factory=dict)
    gates: list[SharedGate] = field(default_factory=list)
    engines: Engines = field(init=False)
    streams: set[Stream] = field(default_factory=set)
    #: (gateway, pool) -> admissions, refusals by reason, fences
    admitted: Counter[tuple[int, str]] = field(default_factory=Counter)
    refused: Counter[tuple[int, str, str]] = field(default_factory=Counter)
    fences: Counter[tuple[int, str]] = field(default_factory=Counter)
    #: (gateway, pool) -> the number of the last admission and the loop time of it
    last_admit: dict[tuple[int, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engines = Engines({f"gpu{i}": c for i, c in enumerate(self.caps)})
        self._tasks: list[asyncio.Task[None]] = []
        self._churn: dict[str, asyncio.Event] = {p: asyncio.Event() for p in self.pools}
        for event in self._churn.values():
            event.set()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        for g in range(self.gateways):
            store = RedisAdmission(
                self.url, gateway_id=f"gw{g}", lease_ttl_s=self.lease_ttl_s,
                heartbeat_ttl_s=self.renew_interval_s * 2.5, timeout_s=self.timeout_s,
                address_remap=self.remaps.get(g),
            )  # fmt: skip
            replicas = tuple(ReplicaSpec(f"gpu{i}", c) for i, c in enumerate(self.caps))
            gate = SharedGate(
                [SharedPoolSpec(p, replicas, QueuePolicy(50, 5.0), None, 1.0, ())
                 for p in self.pools],
                backend=store, clock=LoopClock(), renew_interval_s=self.renew_interval_s,
                fence_margin_s=self.fence_margin_s, lease_ttl_s=self.lease_ttl_s,
            )  # fmt: skip
            gate.on_fence(lambda pool, _why, g=g: self._fence(g, pool))
            await gate.start()
            self.gates.append(gate)
        self._tasks.append(asyncio.ensure_future(self.engines.sample(0.01, self._stop)))

    def _fence(self, g: int, pool: str) -> None:
        self.fences[(g, pool)] += 1
        for s in list(self.streams):
            if s.gate == g and s.pool == pool:
                s.fenced = True
                self._end(s)

    def _end(self, s: Stream) -> None:
        if s in self.streams:
            self.streams.discard(s)
            self.engines.stop(s.pool, s.replica)
            s.lease.release()
            s.ended.set()

    async def open(self, g: int, pool: str) -> Stream | None:
        """One session: admitted (it may wait in the queue) or None (refused)."""
        try:
            lease = await self.gates[g].acquire(pool)
        except Refused as exc:
            self.refused[(g, pool, exc.reason)] += 1
            return None
        s = Stream(g, pool, lease.replica, lease)
        self.streams.add(s)
        self.engines.start(pool, lease.replica)
        self.admitted[(g, pool)] += 1
        self.last_admit[(g, pool)] = asyncio.get_running_loop().time()
        return s

    def close(self, s: Stream) -> None:
        self._end(s)

    def churn(self, clients: int, hold_s: tuple[float, float] = (0.02, 0.2), seed: int = 1
              ) -> None:  # fmt: skip
        """``clients`` session loops per gateway and pool: open, hold, close, again.
        :meth:`pause` and :meth:`resume` stop and restart a pool's loops."""
        rng = random.Random(seed)
        for g in range(self.gateways):
            for pool in self.pools:
                for _ in range(clients):
                    self._tasks.append(asyncio.ensure_future(self._loop(g, pool, hold_s, rng)))

    async def _loop(self, g: int, pool: str, hold_s: tuple[float, float],
                    rng: random.Random) -> None:  # fmt: skip
        while not self._stop.is_set():
            await self._churn[pool].wait()
            s = await self.open(g, pool)
            if s is None:
                await asyncio.sleep(0.05)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(s.ended.wait(), rng.uniform(*hold_s))
            self._end(s)

    def pause(self, pool: str) -> None:
        self._churn[pool].clear()

    def resume(self, pool: str) -> None:
        self._churn[pool].set()

    def total_admitted(self, pool: str | None = None) -> int:
        return sum(n for (_, p), n in self.admitted.items() if pool is None or p == pool)

    async def stop(self) -> None:
        self._stop.set()
        for pool in self.pools:
            self.resume(pool)
        await cancel_all(self._tasks, "the fleet's session loops")
        for s in list(self.streams):
            self._end(s)
        # Every step bounded: a step that overruns fails the test by name (after every
        # gate is stopped) rather than hanging its worker.
        overran: list[str] = []
        for g, gate in enumerate(self.gates):
            for step, work in (("quiesce", gate.quiesce), ("stop", gate.stop)):
                try:
                    await asyncio.wait_for(work(), STOP_BOUND_S)
                except TimeoutError:
                    overran.append(f"gateway {g}'s {step}")
        if overran:
            raise AssertionError(f"over {STOP_BOUND_S:g} s: {', '.join(overran)}")


#: How long one teardown step (a loop's end, a gate's quiesce or stop) may take.
STOP_BOUND_S = 20.0


async def cancel_all(tasks: list[asyncio.Task[None]], what: str) -> None:
    """Cancel ``tasks`` until every one has ended (on Python 3.11 a cancel that lands as
    redis-py sends a command is lost: CPython gh-86296); fails after
    :data:`STOP_BOUND_S`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STOP_BOUND_S
    pending = {t for t in tasks if not t.done()}
    while pending:
        if loop.time() > deadline:
            raise AssertionError(f"{what}: {len(pending)} not ended {STOP_BOUND_S:g} s "
                                 "after being cancelled")  # fmt: skip
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    await asyncio.gather(*tasks, return_exceptions=True)
