"""Shared admission on a real Redis Cluster (three primaries, three replicas, from
Debian's redis-server: tests/redis_cluster_support.py): pools spread over the shards,
sessions churning through several gateways, and the cap held through a primary killed
and its replica promoted, a slot migrated while sessions run (ASK, TRYAGAIN, MOVED),
and a shard partitioned from one gateway, whose renewals wait for that shard alone.

Every test waits for states (polling, events), never for a duration; each is bounded
by ``_BOUND_S``. The engines' stand-in (``cluster_load.Engines``) counts the streams on
each replica at every start and every 10 ms."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission, TickResult
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock
from tests.redis_cluster_support import (
    LocalCluster,
    Partition,
    pool_slot,
    pools_on_primaries,
    remap_through,
)
from tests.shared_admission.cluster_load import Fleet, seed_generations

pytestmark = pytest.mark.xdist_group("redis_cluster")

_BOUND_S = 60.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until it holds; fails after ``_BOUND_S`` (a bound, not a
    measurement)."""
    deadline = time.monotonic() + _BOUND_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {_BOUND_S:g} s")
        await asyncio.sleep(0.01)


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    made = await asyncio.to_thread(LocalCluster)
    try:
        yield made
    finally:
        await asyncio.to_thread(made.stop)


async def _fleet(cluster: LocalCluster, **options: object) -> tuple[Fleet, list[str]]:
    pools = await asyncio.to_thread(pools_on_primaries, cluster, 3)
    await asyncio.to_thread(seed_generations, cluster.url, pools)
    fleet = Fleet(cluster.url, pools, **options)  # type: ignore[arg-type]
    await fleet.start()
    return fleet, pools


async def test_pools_spread_over_shards_hold_their_caps(cluster: LocalCluster) -> None:
    fleet, pools = await _fleet(cluster, gateways=3)
    try:
        owners = {await asyncio.to_thread(cluster.slot_owner, pool_slot(p)) for p in pools}
        assert len(owners) == 3  # one pool per primary
        fleet.churn(clients=4)
        await until(lambda: all(fleet.total_admitted(p) >= 40 for p in pools), "churn")
        # Each pool's caps are full (2 + 2 over 3 gateways x 4 clients): the queue
        # hands slots over across gateways through their wake lists.
        assert all(fleet.engines.worst[(p, r)] == 2 for p in pools for r in ("gpu0", "gpu1"))
    finally:
        await fleet.stop()
    assert fleet.engines.over == 0


async def test_primary_killed_replica_promoted_sessions_kept(cluster: LocalCluster) -> None:
    fleet, pools = await _fleet(cluster, gateways=2, lease_ttl_s=15.0, caps=(3, 3))
    victim_pool, others = pools[0], pools[1:]
    slot = pool_slot(victim_pool)
    primary = await asyncio.to_thread(cluster.slot_owner, slot)
    try:
        fleet.churn(clients=3)
        await until(lambda: fleet.total_admitted() >= 60, "churn before the kill")
        # Long sessions on the victim's shard: stop its churn, let its sessions end,
        # hold four of its six slots, and wait until the replica has every write (a
        # grant the replica never saw is found gone after the promotion and fenced:
        # the safe side, covered by the load before and after).
        fleet.pause(victim_pool)
        await until(lambda: not any(s.pool == victim_pool for s in fleet.streams), "drained")
        long = []
        for g in (0, 1):
            for _ in range(2):
                s = await fleet.open(g, victim_pool)
                assert s is not None
                long.append(s)
        acked = await asyncio.to_thread(cluster.call, primary, "WAIT", 1, 5000, timeout_s=8.0)
        assert acked == 1, f"the replica did not acknowledge the writes within 5 s ({acked})"
        before = {p: fleet.total_admitted(p) for p in others}
        t0 = time.monotonic()
        await asyncio.to_thread(cluster.kill, primary)
        promoted = await asyncio.to_thread(cluster.wait_owner_change, slot, primary)
        t_promoted = time.monotonic() - t0
        fleet.resume(victim_pool)
        admitted = fleet.total_admitted(victim_pool)
        await until(lambda: fleet.total_admitted(victim_pool) > admitted, "admission resumes")
        t_first = time.monotonic() - t0
        await until(
            lambda: (
                all(not s.fenced and s in fleet.streams for s in long)
                and fleet.total_admitted(victim_pool) > admitted + 20
            ),
            "sessions kept and churn after the promotion",
        )
        assert all(fleet.total_admitted(p) > before[p] for p in others)  # other shards served
        print(
            f"\nfailover: promoted {promoted} after {t_promoted:.2f} s, first admission "
            f"{t_first:.2f} s after the kill; long sessions kept {len(long)}/{len(long)}; "
            f"fences {dict(fleet.fences)}; samples {fleet.engines.samples}, over cap "
            f"{fleet.engines.over}"
        )
    finally:
        await fleet.stop()
    assert fleet.engines.over == 0
    assert not any(s.fenced for s in long)
    assert fleet.fences[(0, victim_pool)] == fleet.fences[(1, victim_pool)] == 0


async def test_slot_migrated_while_sessions_run(cluster: LocalCluster) -> None:
    fleet, pools = await _fleet(cluster, gateways=2)
    moving = pools[0]
    slot = pool_slot(moving)
    target = await asyncio.to_thread(cluster.slot_owner, pool_slot(pools[1]))
    try:
        fleet.churn(clients=3)
        await until(lambda: fleet.total_admitted() >= 60, "churn before the move")
        t0 = time.monotonic()
        source = await asyncio.to_thread(cluster.begin_migration, slot, target)
        # Half-open: the slot migrates, the pool's calls are redirected (ASK) and
        # answered TRYAGAIN, none runs on a half-moved pool.
        during = fleet.total_admitted(moving)
        moved = await asyncio.to_thread(cluster.move_keys, slot, source, target)
        await asyncio.to_thread(cluster.finish_migration, slot, target)
        t_moved = time.monotonic() - t0
        after = fleet.total_admitted(moving)
        await until(lambda: fleet.total_admitted(moving) > after + 40, "admission after")
        t_first = time.monotonic() - t0
        refused = {k: n for k, n in fleet.refused.items() if k[1] == moving}
        print(
            f"\nmigration: slot {slot} {source} -> {target}, {moved} keys, "
            f"{t_moved:.2f} s; admissions during it {after - during}; "
            f"{t_first:.2f} s to 40 admissions after; refusals {refused}; "
            f"samples {fleet.engines.samples}, over cap {fleet.engines.over}"
        )
        assert await asyncio.to_thread(cluster.slot_owner, slot) == target
        assert moved >= 5
    finally:
        await fleet.stop()
    assert fleet.engines.over == 0
    assert sum(fleet.fences.values()) == 0


async def test_shard_partitioned_from_one_gateway(cluster: LocalCluster) -> None:
    proxies = {n.port: Partition(("127.0.0.1", n.port)) for n in cluster.nodes}
    for proxy in proxies.values():
        await proxy.start()
    try:
        fleet, pools = await _fleet(
            cluster, gateways=2, lease_ttl_s=4.0, renew_interval_s=0.5, fence_margin_s=1.0,
            timeout_s=0.3, remaps={0: remap_through(proxies)},
        )  # fmt: skip
        cut_pool = pools[0]
        primary = await asyncio.to_thread(cluster.slot_owner, pool_slot(cut_pool))
        try:
            fleet.churn(clients=3, hold_s=(0.05, 30.0))
            # A session of gateway 0 on the pool that only a fence ends: the cut must
            # find a lease there to prove (a churned one may end just before it).
            deadline, held = time.monotonic() + _BOUND_S, None
            while held is None:
                assert time.monotonic() < deadline, "gateway 0 got no session of the pool"
                held = await asyncio.wait_for(fleet.open(0, cut_pool), _BOUND_S)
            proxies[primary].cut()
            # Gateway 0 cannot prove its leases of that pool: it fences them before
            # they lapse; gateway 1 then gets those slots.
            await until(lambda: fleet.fences[(0, cut_pool)] >= 1, "gateway 0 fenced")
            await until(
                lambda: fleet.refused[(0, cut_pool, "backend_unavailable")] >= 1,
                "gateway 0 refuses backend_unavailable",
            )
            on_others = {p: fleet.admitted[(0, p)] for p in pools[1:]}
            by_one = fleet.admitted[(1, cut_pool)]
            await until(
                lambda: (
                    all(fleet.admitted[(0, p)] > on_others[p] for p in pools[1:])
                    and fleet.admitted[(1, cut_pool)] > by_one
                ),
                "gateway 0 serves its other pools; gateway 1 the cut one",
            )
            proxies[primary].heal()
            cut_admitted = fleet.admitted[(0, cut_pool)]
            await until(lambda: fleet.admitted[(0, cut_pool)] > cut_admitted, "healed")
            print(
                f"\npartition: fences {dict(fleet.fences)}, refused "
                f"{ {k: n for k, n in fleet.refused.items() if k[0] == 0} }, samples "
                f"{fleet.engines.samples}, over cap {fleet.engines.over}"
            )
        finally:
            for proxy in proxies.values():  # the teardown's releases reach every shard
                proxy.heal()
            await fleet.stop()
        assert held.fenced
        assert fleet.engines.over == 0
        assert fleet.fences[(1, cut_pool)] == 0
    finally:
        for proxy in proxies.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proxy.stop(), 10.0)


async def test_unreachable_shard_holds_only_its_own_renewals(cluster: LocalCluster) -> None:
    """A gateway renews each pool with a call of its own: while one shard does not answer,
    the other shards' pools are renewed, and the cut pool is tried again within the
    renewal interval, so it is renewed soon after its shard answers again (a promoted
    replica), not a whole interval later."""
    proxies = {n.port: Partition(("127.0.0.1", n.port)) for n in cluster.nodes}
    for proxy in proxies.values():
        await proxy.start()
    try:
        pools = await asyncio.to_thread(pools_on_primaries, cluster, 3)
        await asyncio.to_thread(seed_generations, cluster.url, pools)
        cut, others = pools[0], pools[1:]
        primary = await asyncio.to_thread(cluster.slot_owner, pool_slot(cut))
        store = RedisAdmission(cluster.url, gateway_id="gw0", lease_ttl_s=60.0,
                               heartbeat_ttl_s=50.0, timeout_s=0.5,
                               address_remap=remap_through(proxies))  # fmt: skip
        started: list[str] = []  # the pool of each renewal call, as it starts
        ended: list[tuple[str, bool]] = []  # (pool, renewed) as each call ends
        tick = store.tick

        async def recorded(pool: str, **call: Any) -> TickResult:
            started.append(pool)
            try:
                result = await tick(pool, **call)
            except BackendUnavailable:
                ended.append((pool, False))
                raise
            ended.append((pool, True))
            return result

        store.tick = recorded  # type: ignore[method-assign]
        # A round every 8 s; a pool whose renewal failed is tried again every 2 s between.
        gate = SharedGate(
            [SharedPoolSpec(p, (ReplicaSpec("gpu0", 2),), QueuePolicy(5, 1.0), None, 1.0, ())
             for p in pools],
            backend=store, clock=LoopClock(), renew_interval_s=8.0, fence_margin_s=1.0,
            lease_ttl_s=60.0,
        )  # fmt: skip
        await gate.start()
        try:
            await until(lambda: len(ended) == len(pools), "the first round")
            assert all(ok for _, ok in ended), ended
            proxies[primary].cut()
            await until(lambda: (cut, False) in ended, "the cut pool's renewal failed")
            # The other shards' pools were renewed in that round while the cut pool's call
            # waited out its attempts' timeouts.
            second = ended[len(pools) : ended.index((cut, False))]
            assert sorted(p for p, ok in second if ok) == sorted(others), ended
            proxies[primary].heal()
            await until(lambda: (cut, True) in ended[len(pools) :], "renewed after the heal")
            # By a retry of that pool alone: the other pools' third round has not started.
            assert [started.count(p) for p in others] == [2, 2], started
            assert started.count(cut) >= 3
        finally:
            for proxy in proxies.values():
                proxy.heal()
            await asyncio.wait_for(gate.stop(), _BOUND_S)
    finally:
        for proxy in proxies.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proxy.stop(), 10.0)
