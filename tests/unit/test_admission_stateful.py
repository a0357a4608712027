"""Hypothesis stateful test of the pure admission core against a simple model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from proxy.admission import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    Admit,
    Enqueue,
    PoolCore,
    QueuePolicy,
    Reject,
    ReplicaSpec,
)
from tests.hypothesis_profiles import examples

REPLICAS = ("a", "b", "c")


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.core: PoolCore | None = None
        self.caps: dict[str, int] = {}
        self.healthy: dict[str, bool] = {}
        self.guarded: dict[str, bool] = {}
        self.active: dict[str, int] = {}
        self.leases: dict[int, str] = {}
        self.released: set[int] = set()
        self.queue: list[int] = []  # model FIFO, arrival order
        self.deadlines: dict[int, float] = {}
        self.gone: set[int] = set()  # abandoned, expired or refused: must never be admitted
        self.draining = False
        self.max_depth = 0
        self.max_wait = 0.0

    # -- set-up ---------------------------------------------------------------

    @initialize(
        caps=st.lists(st.integers(1, 3), min_size=1, max_size=3),
        depth=st.integers(0, 4),
        wait=st.sampled_from([0.0, 1.0, 5.0]),
    )
    def start(self, caps: list[int], depth: int, wait: float) -> None:
        names = REPLICAS[: len(caps)]
        self.core = PoolCore(
            "p",
            [ReplicaSpec(n, c) for n, c in zip(names, caps, strict=True)],
            QueuePolicy(depth, wait),
            session_estimate_s=5.0,
            seed=1,
        )
        self.caps = dict(zip(names, caps, strict=True))
        self.healthy = dict.fromkeys(names, True)
        self.guarded = dict.fromkeys(names, False)
        self.active = dict.fromkeys(names, 0)
        self.max_depth, self.max_wait = depth, wait

    # -- helpers --------------------------------------------------------------

    def _eligible(self) -> list[str]:
        return [
            n
            for n in self.caps
            if self.healthy[n] and not self.guarded[n] and self.active[n] < self.caps[n]
        ]

    def _apply_admits(self, admits: list[Admit]) -> None:
        for admit in admits:
            assert admit.ticket not in self.gone, "an abandoned/expired waiter was admitted"
            assert self.queue and admit.ticket == self.queue[0], "waiters out of FIFO order"
            self.queue.pop(0)
            self._take(admit)

    def _take(self, admit: Admit) -> None:
        r = admit.replica
        assert self.healthy[r] and not self.guarded[r], f"admitted to ineligible {r}"
        assert self.active[r] < self.caps[r], f"cap exceeded on {r}"
        # least-loaded placement
        best = min(self.active[n] / self.caps[n] for n in self._eligible())
        assert self.active[r] / self.caps[r] == best
        self.active[r] += 1
        self.leases[admit.ticket] = r
        # after any assignment, if waiters remain there must be no eligible slot
        assert admit.waited_s >= 0

    def _check_no_idle_slot_with_waiters(self) -> None:
        if self.queue and not self.draining:
            assert not self._eligible(), "a free slot sits idle while sessions wait"

    # -- rules ------------------------------------------------------------------

    @precondition(lambda self: self.core is not None)
    @rule(dt=st.sampled_from([0.0, 0.1, 0.5]), burst=st.integers(1, 4))
    def arrive(self, dt: float, burst: int) -> None:
        self.now += dt
        for _ in range(burst):
            self._arrive_one()

    def _arrive_one(self) -> None:
        assert self.core is not None
        had_waiters = bool(self.queue)
        eligible = self._eligible()
        d = self.core.arrive(self.now)
        if isinstance(d, Admit):
            assert not self.draining
            assert not had_waiters, "newcomer barged past a waiter"
            self._take(d)
        elif isinstance(d, Enqueue):
            assert not self.draining
            assert not eligible or had_waiters
            assert self.max_depth > 0 and self.max_wait > 0
            assert len(self.queue) < self.max_depth
            self.queue.append(d.ticket)
            assert d.position == len(self.queue)
            self.deadlines[d.ticket] = d.deadline
        else:
            assert isinstance(d, Reject)
            assert RETRY_AFTER_MIN_S <= d.retry_after_s <= RETRY_AFTER_MAX_S
            self.gone.add(d.ticket)
            if self.draining:
                assert d.reason == "draining"
            elif not any(self.healthy.values()):
                assert d.reason == "no_healthy_replica"
            else:
                assert not eligible or had_waiters
                if self.max_depth > 0 and self.max_wait > 0:
                    assert d.reason == "queue_full"
                    assert len(self.queue) == self.max_depth
                else:
                    assert d.reason in ("pool_full", "guard")
                    guard_blocks = any(
                        self.guarded[n] and self.healthy[n] and self.active[n] < self.caps[n]
                        for n in self.caps
                    )
                    assert (d.reason == "guard") == guard_blocks

    @precondition(lambda self: self.core is not None and bool(self.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.core is not None
        ticket = data.draw(st.sampled_from(sorted(self.leases)))
        replica = self.leases.pop(ticket)
        self.active[replica] -= 1
        self.released.add(ticket)
        self._apply_admits(self.core.release(ticket, self.now))

    @precondition(lambda self: self.core is not None and bool(self.leases))
    @rule(data=st.data())
    def failover(self, data: st.DataObject) -> None:
        """The lease's replica failed before the first byte: eject it, move the lease."""
        assert self.core is not None
        ticket = data.draw(st.sampled_from(sorted(self.leases)))
        failed = self.leases[ticket]
        self.healthy[failed] = False
        self._apply_admits(self.core.set_healthy(failed, False, self.now))
        self.active[failed] -= 1
        del self.leases[ticket]
        candidates = self._eligible()
        moved = self.core.relocate(ticket, self.now)
        if moved is None:
            assert not candidates
            self.active[failed] += 1
            self.leases[ticket] = failed
        else:
            assert moved.ticket == ticket and moved.replica != failed
            self._take(moved)

    @precondition(lambda self: self.core is not None and bool(self.released))
    @rule(data=st.data())
    def double_release_fails(self, data: st.DataObject) -> None:
        assert self.core is not None
        ticket = data.draw(st.sampled_from(sorted(self.released)))
        with pytest.raises(LookupError):
            self.core.release(ticket, self.now)

    @precondition(lambda self: self.core is not None and bool(self.queue))
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        assert self.core is not None
        ticket = data.draw(st.sampled_from(self.queue))
        self.queue.remove(ticket)
        self.gone.add(ticket)
        self._apply_admits(self.core.abandon(ticket, self.now))

    @precondition(lambda self: self.core is not None)
    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def advance_and_expire(self, dt: float) -> None:
        assert self.core is not None
        self.now += dt
        rejects = self.core.expire(self.now)
        expected = [t for t in self.queue if self.deadlines[t] <= self.now]
        assert [r.ticket for r in rejects] == expected
        for r in rejects:
            assert r.reason == "queue_timeout"
            assert r.waited_s >= self.max_wait - 1e-9
            self.queue.remove(r.ticket)
            self.gone.add(r.ticket)

    @precondition(lambda self: self.core is not None)
    @rule(idx=st.integers(0, 2), cap=st.integers(1, 4))
    def set_cap(self, idx: int, cap: int) -> None:
        assert self.core is not None
        name = list(self.caps)[idx % len(self.caps)]
        self.caps[name] = cap
        self._apply_admits(self.core.set_cap(name, cap, self.now))

    @precondition(lambda self: self.core is not None)
    @rule(idx=st.integers(0, 2), healthy=st.booleans())
    def set_healthy(self, idx: int, healthy: bool) -> None:
        assert self.core is not None
        name = list(self.caps)[idx % len(self.caps)]
        self.healthy[name] = healthy
        self._apply_admits(self.core.set_healthy(name, healthy, self.now))

    @precondition(lambda self: self.core is not None)
    @rule(idx=st.integers(0, 2), guarded=st.booleans())
    def set_guarded(self, idx: int, guarded: bool) -> None:
        assert self.core is not None
        name = list(self.caps)[idx % len(self.caps)]
        self.guarded[name] = guarded
        self._apply_admits(self.core.set_guarded(name, guarded, self.now))

    @precondition(lambda self: self.core is not None and not self.draining)
    @rule()
    def drain(self) -> None:
        assert self.core is not None
        rejects = self.core.drain(self.now)
        assert [r.ticket for r in rejects] == self.queue
        assert all(r.reason == "draining" for r in rejects)
        self.gone.update(self.queue)
        self.queue.clear()
        self.draining = True

    # -- invariants ---------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        if self.core is None:
            return
        stats = self.core.statistics()
        assert stats.queue_depth == len(self.queue) <= self.max_depth
        assert self.core.waiting() == self.queue
        for r in stats.replicas:
            assert r.active == self.active[r.name]
            assert r.cap == self.caps[r.name]
        assert self.core.active == len(self.leases)
        self._check_no_idle_slot_with_waiters()

    def teardown(self) -> None:
        if self.core is None:
            return
        for ticket in list(self.queue):
            assert self.core.abandon(ticket, self.now) == []
        for ticket in list(self.leases):
            assert self.core.release(ticket, self.now) == []
        stats = self.core.statistics()
        assert stats.active == 0
        assert stats.queue_depth == 0


AdmissionMachine.TestCase.settings = settings(
    max_examples=examples(400),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdmission = AdmissionMachine.TestCase
