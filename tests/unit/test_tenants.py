"""The tenant scheduler (proxy/admission/tenants.py) through the pure PoolCore: priority
classes, reserves, weighted fair share of session-seconds, FIFO within a key, shedding,
max_queued, positions. Hypothesis stateful test of the invariants, long-run fairness
simulated on the injected clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from proxy.admission import (
    Admit,
    Enqueue,
    PoolCore,
    QueuePolicy,
    Reject,
    ReplicaSpec,
    Reserve,
    TenantSpec,
)
from proxy.admission.tenants import reserved_above
from tests.hypothesis_profiles import examples

GOLD = TenantSpec("gold", priority=1, weight=1.0)
A = TenantSpec("a", priority=0, weight=1.0)
B = TenantSpec("b", priority=0, weight=2.0)
PLAIN = TenantSpec("plain")  # no weight: the shared FIFO lane of class 0
FREE = TenantSpec("free", priority=-1, weight=1.0, max_queued=3)
BATCH = TenantSpec("batch", priority=-2)
TENANTS = (GOLD, A, B, PLAIN, FREE, BATCH)


def _core(caps: list[int], depth: int = 10, wait: float = 30.0, **kw: object) -> PoolCore:
    return PoolCore(
        "p",
        [ReplicaSpec(f"r{i}", c) for i, c in enumerate(caps)],
        QueuePolicy(depth, wait),
        session_estimate_s=10.0,
        seed=3,
        **kw,  # type: ignore[arg-type]
    )


# -- examples ---------------------------------------------------------------------------


def test_keys_without_fields_share_one_fifo_like_today() -> None:
    core = _core([1])
    x, y = TenantSpec("x"), TenantSpec("y")
    first = core.arrive(0.0, x)
    assert isinstance(first, Admit)
    order = [core.arrive(1.0 + i, t) for i, t in enumerate([y, x, y, None, x])]
    assert [d.position for d in order if isinstance(d, Enqueue)] == [1, 2, 3, 4, 5]
    served = []
    ticket = first.ticket
    for step in range(5):
        (admit,) = core.release(ticket, 10.0 + step)
        served.append(admit.ticket)
        ticket = admit.ticket
    assert served == [d.ticket for d in order]


def test_higher_class_is_served_first_and_fifo_within_a_key() -> None:
    core = _core([1])
    holder = core.arrive(0.0, A)
    assert isinstance(holder, Admit)
    low = [core.arrive(1.0, FREE), core.arrive(2.0, FREE)]
    mid = core.arrive(3.0, A)
    high = core.arrive(4.0, GOLD)
    assert isinstance(high, Enqueue) and high.position == 1
    assert core.waiting(4.0) == [high.ticket, mid.ticket, low[0].ticket, low[1].ticket]
    served = []
    ticket = holder.ticket
    for step in range(4):
        (admit,) = core.release(ticket, 5.0 + step)
        served.append(admit.ticket)
        ticket = admit.ticket
    assert served == [high.ticket, mid.ticket, low[0].ticket, low[1].ticket]


def test_reserve_gives_a_high_class_a_slot_at_once_during_a_flood() -> None:
    core = _core([2, 2], reserves=[Reserve(priority=1, per_replica=1)])
    admitted = [core.arrive(0.0, A) for _ in range(4)]
    assert [type(d) for d in admitted] == [Admit, Admit, Enqueue, Enqueue]
    assert core.free_slots() == 2
    gold = core.arrive(1.0, GOLD)
    assert isinstance(gold, Admit)  # no wait: the reserve had room, despite 2 waiters
    assert isinstance(core.arrive(1.0, GOLD), Admit)
    assert isinstance(core.arrive(1.0, GOLD), Enqueue)  # the reserve is used up


def test_a_reserve_in_use_does_not_shrink_the_lower_classes_cap_further() -> None:
    core = _core([4], reserves=[Reserve(priority=1, slots=2)])
    assert [type(core.arrive(0.0, GOLD)) for _ in range(2)] == [Admit, Admit]
    # gold holds its 2 reserved slots: class 0 still has the other 2
    assert [type(core.arrive(0.0, A)) for _ in range(3)] == [Admit, Admit, Enqueue]
    assert isinstance(core.arrive(0.0, GOLD), Enqueue)  # the pool is full


def test_pool_wide_reserve_nests_by_class() -> None:
    core = _core([4], reserves=[Reserve(priority=1, slots=1), Reserve(priority=0, slots=1)])
    assert [type(core.arrive(0.0, FREE)) for _ in range(3)] == [Admit, Admit, Enqueue]
    assert isinstance(core.arrive(0.0, A), Admit)  # class 0 may use the class-0 reserve
    assert isinstance(core.arrive(0.0, A), Enqueue)
    assert isinstance(core.arrive(0.0, GOLD), Admit)


def test_sheddable_waiter_is_refused_at_once_when_a_higher_class_needs_its_place() -> None:
    core = _core([1], depth=2)
    holder = core.arrive(0.0, A)
    assert isinstance(holder, Admit)
    old = core.arrive(1.0, BATCH)
    new = core.arrive(2.0, BATCH)
    assert isinstance(old, Enqueue) and isinstance(new, Enqueue)
    refused = core.arrive(3.0, BATCH)  # same class: nobody to displace
    assert isinstance(refused, Reject) and refused.reason == "queue_full"
    came = core.arrive(4.0, A)
    assert isinstance(came, Enqueue)
    (shed,) = came.displaced
    assert shed.ticket == new.ticket and shed.reason == "preempted_in_queue"
    assert shed.waited_s == 2.0 and shed.retry_after_s >= 1
    assert core.waiting(4.0) == [came.ticket, old.ticket]
    # a non-sheddable class is never displaced: a full queue of class 0 refuses gold
    assert isinstance(core.arrive(5.0, A), Enqueue)  # displaces the other batch waiter
    full = core.arrive(6.0, GOLD)
    assert isinstance(full, Reject) and full.reason == "queue_full"


def test_max_queued_is_the_tenants_own_limit() -> None:
    core = _core([1])
    assert isinstance(core.arrive(0.0, A), Admit)
    for i in range(3):
        assert isinstance(core.arrive(1.0 + i, FREE), Enqueue)
    over = core.arrive(5.0, FREE)
    assert isinstance(over, Reject) and over.reason == "tenant_limit"
    assert isinstance(core.arrive(5.0, BATCH), Enqueue)  # others are unaffected


def test_position_and_retry_after_reflect_the_tenants_own_lane() -> None:
    core = _core([1])
    assert isinstance(core.arrive(0.0, A), Admit)
    flood = [core.arrive(1.0, A) for _ in range(6)]
    assert [d.position for d in flood if isinstance(d, Enqueue)] == [1, 2, 3, 4, 5, 6]
    other = core.arrive(2.0, TenantSpec("c", weight=1.0))
    # lane c is lifted to lane a's virtual time, so it interleaves instead of standing
    # behind all six of a's waiters
    assert isinstance(other, Enqueue) and other.position <= 2


# -- long-run fairness on the injected clock ----------------------------------------------


def _simulate(
    tenants: list[TenantSpec], lengths: dict[str, float], cap: int, horizon: float, seed: int
) -> dict[str, float]:
    """Every tenant keeps its waiters queued (one new session per session it ends);
    sessions last lengths[name] x U(0.5, 1.5). Returns each tenant's session-seconds held
    inside [horizon/5, horizon] (the first fifth is warm-up)."""
    rng = random.Random(seed)
    core = _core([cap], depth=10_000, wait=1e9)
    ends: dict[int, float] = {}
    began: dict[int, float] = {}
    owner: dict[int, TenantSpec] = {}
    held = dict.fromkeys((t.name for t in tenants), 0.0)
    lo = horizon / 5

    def record(d: Admit | Enqueue | Reject, t: TenantSpec, now: float) -> None:
        owner[d.ticket] = t
        if isinstance(d, Admit):
            began[d.ticket] = now
            ends[d.ticket] = now + lengths[t.name] * rng.uniform(0.5, 1.5)

    for t in tenants:
        for _ in range(2 * cap):
            record(core.arrive(0.0, t), t, 0.0)
    while True:
        ticket = min(ends, key=ends.__getitem__)
        now = ends.pop(ticket)
        if now > horizon:
            break
        t = owner[ticket]
        held[t.name] += max(0.0, now - max(lo, began.pop(ticket)))
        for admit in core.release(ticket, now):
            record(admit, owner[admit.ticket], now)
        record(core.arrive(now, t), t, now)
    for ticket in ends:  # sessions still running at the horizon
        held[owner[ticket].name] += max(0.0, horizon - max(lo, began[ticket]))
    return held


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@settings(max_examples=examples(15), deadline=None)
@given(
    seed=st.integers(0, 10_000),
    la=st.sampled_from([2.0, 10.0, 40.0]),
    lb=st.sampled_from([2.0, 10.0, 40.0]),
)
def test_equal_weights_share_session_seconds_whatever_the_session_lengths(
    seed: int, la: float, lb: float
) -> None:
    held = _simulate([A, TenantSpec("b2", weight=1.0)], {"a": la, "b2": lb}, 6, 4000.0, seed)
    assert jain(list(held.values())) >= 0.97, held


@settings(max_examples=examples(15), deadline=None)
@given(seed=st.integers(0, 10_000), wb=st.sampled_from([2.0, 3.0]), la=st.sampled_from([3, 20]))
def test_weights_are_respected_in_the_long_run(seed: int, wb: float, la: float) -> None:
    b = TenantSpec("b", weight=wb)
    held = _simulate([A, b], {"a": float(la), "b": 8.0}, 6, 4000.0, seed)
    assert held["b"] / held["a"] == pytest.approx(wb, rel=0.15), held


# -- stateful -----------------------------------------------------------------------------


class TenantMachine(RuleBasedStateMachine):
    """Random arrivals of six tenants (three classes, weights, a shared FIFO lane, a
    sheddable key with max_queued), releases, abandons, expiries, against the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core: PoolCore | None = None
        self.reserves: list[Reserve] = []
        self.caps: list[int] = []
        self.tenant: dict[int, TenantSpec] = {}
        self.arrived: dict[int, int] = {}  # ticket -> arrival number
        self.deadline: dict[int, float] = {}
        self.waiting: set[int] = set()
        self.leases: set[int] = set()
        self.gone: set[int] = set()
        self.last_served: dict[tuple[int, str], int] = {}
        self.n = 0
        self.depth = 0

    @initialize(
        caps=st.lists(st.integers(1, 3), min_size=1, max_size=3),
        depth=st.integers(1, 6),
        wait=st.sampled_from([1.0, 4.0]),
        gold_slots=st.integers(0, 2),
        zero_per_replica=st.integers(0, 1),
    )
    def start(
        self, caps: list[int], depth: int, wait: float, gold_slots: int, zero_per_replica: int
    ) -> None:
        self.reserves = [Reserve(1, slots=gold_slots), Reserve(0, per_replica=zero_per_replica)]
        self.caps, self.depth = caps, depth
        self.core = _core(caps, depth=depth, wait=wait, reserves=self.reserves)

    def _served(self, admits: list[Admit], direct: bool = False) -> None:
        classes = []
        for a in admits:
            assert a.ticket not in self.gone and a.ticket not in self.leases
            if not direct:
                assert a.ticket in self.waiting
                self.waiting.discard(a.ticket)
                assert self.deadline[a.ticket] >= self.now  # never served after its deadline
            t = self.tenant[a.ticket]
            lane = t.lane
            # FIFO within a lane
            assert self.arrived[a.ticket] > self.last_served.get(lane, -1)
            self.last_served[lane] = self.arrived[a.ticket]
            self.leases.add(a.ticket)
            classes.append(t.priority)
        # class first: within one event, classes never rise, and nobody of a higher class
        # than the last one served is left waiting
        assert classes == sorted(classes, reverse=True)
        if classes and not direct:
            assert all(self.tenant[w].priority <= classes[-1] for w in self.waiting)

    def _refused(self, r: Reject) -> None:
        assert 1 <= r.retry_after_s <= 60
        self.waiting.discard(r.ticket)
        self.gone.add(r.ticket)

    @rule(idx=st.integers(0, len(TENANTS) - 1), dt=st.sampled_from([0.0, 0.3]))
    def arrive(self, idx: int, dt: float) -> None:
        assert self.core is not None
        self.now += dt
        self._expire()
        t = TENANTS[idx]
        full_before = len(self.waiting) >= self.depth
        d = self.core.arrive(self.now, t)
        self.n += 1
        self.tenant[d.ticket] = t
        self.arrived[d.ticket] = self.n
        if isinstance(d, Admit):
            assert not any(self.tenant[w].priority >= t.priority for w in self.waiting)
            self._served([d], direct=True)
        elif isinstance(d, Enqueue):
            for shed in d.displaced:
                assert full_before and shed.reason == "preempted_in_queue"
                victim = self.tenant[shed.ticket]
                assert victim.priority < 0 and victim.priority < t.priority
                assert shed.ticket in self.waiting
                self._refused(shed)
            self.waiting.add(d.ticket)
            self.deadline[d.ticket] = d.deadline
            assert 1 <= d.position <= len(self.waiting)
        else:
            self._refused(d)
            if d.reason == "queue_full":
                assert full_before
            elif d.reason == "tenant_limit":
                assert t.max_queued is not None

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.core is not None
        if not self.leases:
            return
        ticket = data.draw(st.sampled_from(sorted(self.leases)))
        self.now += 0.2
        self._expire()
        self.leases.discard(ticket)
        self.gone.add(ticket)
        self._served(self.core.release(ticket, self.now))

    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        assert self.core is not None
        if not self.waiting:
            return
        ticket = data.draw(st.sampled_from(sorted(self.waiting)))
        self.waiting.discard(ticket)
        self.gone.add(ticket)
        self._served(self.core.abandon(ticket, self.now))

    @rule(dt=st.sampled_from([0.5, 2.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._expire()

    def _expire(self) -> None:
        assert self.core is not None
        for r in self.core.expire(self.now):
            assert r.reason == "queue_timeout" and self.deadline[r.ticket] <= self.now
            self._refused(r)
        # nobody starves: every waiter still queued is within its deadline
        assert all(self.deadline[w] > self.now for w in self.waiting)

    @invariant()
    def caps_reserves_and_limits(self) -> None:
        core = self.core
        if core is None:
            return
        stats = core.statistics()
        assert all(r.active <= r.cap for r in stats.replicas)
        assert core.active == len(self.leases)
        assert sorted(core.waiting(self.now)) == sorted(self.waiting)
        assert core.queue_depth <= self.depth
        total = sum(self.caps)
        for c in (-2, -1, 0, 1):
            below = sum(1 for t in self.leases if self.tenant[t].priority <= c)
            assert below <= max(0, total - reserved_above(self.reserves, c, len(self.caps)))
        for t in TENANTS:
            if t.max_queued is not None:
                assert sum(1 for w in self.waiting if self.tenant[w] == t) <= t.max_queued
        # work-conserving: the highest class waiting could take no slot -- none is free,
        # or one more of its class would put the classes below some reserve above
        # their smaller cap
        if self.waiting:
            top = max(self.tenant[w].priority for w in self.waiting)
            blocked = core.free_slots() == 0 or any(
                sum(1 for t in self.leases if self.tenant[t].priority < r.priority)
                >= total - reserved_above(self.reserves, r.priority - 1, len(self.caps))
                for r in self.reserves
                if r.priority > top
            )
            assert blocked


TenantMachine.TestCase.settings = settings(
    max_examples=examples(150),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTenantMachine = TenantMachine.TestCase


def test_tenant_wait_is_until_one_of_its_own_sessions_ends() -> None:
    core = _core([4])
    mine = core.arrive(0.0, A)
    assert isinstance(mine, Admit)
    for _ in range(3):
        assert isinstance(core.arrive(9.0, B), Admit)
    # a's only session is 9 s into a ~10 s mean; b's three have just started
    own = core.tenant_wait("a", 9.0)
    assert own is not None and own < core.tenant_wait("b", 9.0)  # type: ignore[operator]
    assert core.tenant_wait("c", 9.0) is None and core.tenant_wait("", 9.0) is None


def test_session_seconds_never_decrease_and_count_running_sessions() -> None:
    core = _core([2])
    first = core.arrive(0.0, A)
    second = core.arrive(1.0, A)
    assert isinstance(first, Admit) and isinstance(second, Admit)
    assert core.session_seconds(3.0) == {A: 3.0 + 2.0}
    core.release(first.ticket, 3.0)
    assert core.session_seconds(3.0) == {A: 5.0}  # the finished one moved, not lost
    core.release(second.ticket, 4.0)
    assert core.session_seconds(10.0) == {A: 6.0}


def test_a_full_queues_retry_after_follows_the_refused_keys_own_place() -> None:
    core = _core([1], depth=6)
    assert isinstance(core.arrive(0.0, A), Admit)
    for _ in range(6):
        assert isinstance(core.arrive(0.0, A), Enqueue)
    flood = core.arrive(1.0, A)  # behind its own six waiters: about 7 sessions away
    other = core.arrive(1.0, TenantSpec("c", weight=1.0))  # its turn comes second
    assert isinstance(flood, Reject) and isinstance(other, Reject)
    assert flood.reason == other.reason == "queue_full"
    assert other.retry_after_s < flood.retry_after_s
