"""Retry-After is honest: checked against simulated runs of the pure admission core.

Everything runs on a fake ``now``: arrivals and session lengths are drawn from seeded
distributions, the core is driven with plain calls, and the Retry-After given at each
refusal is compared with the time until a slot would actually have been handed to that
client: the ``p``-th slot freed after the refusal, for a client that would have stood
at queue position ``p`` (1 for a full pool without a queue, depth + 1 when the queue
is full, its own position when its wait expired).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest

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
from proxy.admission.gate import Gate
from proxy.admission.refusal import close_reason, error_event, http_error
from proxy.admission.retry_after import (
    JITTER_FRACTION,
    JITTER_MIN_S,
    SessionLengths,
    SlotForecast,
    next_recheck_s,
    retry_after_s,
)
from proxy.clock import FakeClock
from proxy.errors import CapacityRefused, Refused, TenantLimitRefused, refusal_for
from proxy.runtime import Runtime
from tests.conftest import proxy_settings


def spread(estimate_s: float) -> int:
    """The documented jitter window above a (rounded-up) estimate."""
    return max(JITTER_MIN_S, int(JITTER_FRACTION * max(1, math.ceil(estimate_s))))


def core_of(caps: tuple[int, ...], depth: int = 0, wait: float = 10.0, **kw: float) -> PoolCore:
    return PoolCore(
        "tts", [ReplicaSpec(f"gpu{i}", c) for i, c in enumerate(caps)], QueuePolicy(depth, wait),
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


# -- simulated runs -------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    at: float
    reason: str
    position: int
    retry_after_s: float
    estimate_s: float
    truth_s: float = math.nan


def simulate(core: PoolCore, arrivals: list[float], length: Callable[[], float]) -> list[Refusal]:
    """Drive ``core`` through ``arrivals`` (sorted times); every admitted session lasts
    ``length()`` seconds. Returns the refusals with the true wait filled in."""
    order = itertools.count()
    events: list[tuple[float, int, str, int]] = [(t, next(order), "arrive", 0) for t in arrivals]
    heapq.heapify(events)
    releases: list[float] = []
    refusals: list[Refusal] = []

    def admitted(admits: list[Admit], now: float) -> None:
        for a in admits:
            heapq.heappush(events, (now + length(), next(order), "release", a.ticket))

    def refused(r: Reject, position: int, now: float) -> None:
        refusals.append(
            Refusal(now, r.reason, position, r.retry_after_s, core.estimate_wait(position, now))
        )

    while events:
        now, _, kind, ticket = heapq.heappop(events)
        deadline = core.next_deadline()
        while deadline is not None and deadline <= now:
            for r in core.expire(deadline):
                assert r.queue_position is not None
                refused(r, r.queue_position, deadline)
            deadline = core.next_deadline()
        if kind == "arrive":
            position = core.queue_depth + 1
            decision = core.arrive(now)
            if isinstance(decision, Admit):
                admitted([decision], now)
            elif isinstance(decision, Reject):
                refused(decision, position, now)
        elif kind == "release":
            releases.append(now)
            admitted(core.release(ticket, now), now)
        deadline = core.next_deadline()
        if deadline is not None and (not events or events[0][0] > deadline):
            heapq.heappush(events, (deadline, next(order), "tick", 0))
    releases.sort()
    out = []
    for r in refusals:
        i = bisect.bisect_right(releases, r.at) + r.position - 1
        if i < len(releases):  # the run ended before that slot would have freed
            out.append(Refusal(**{**r.__dict__, "truth_s": releases[i] - r.at}))
    return out


def poisson(rng: random.Random, rate: float, n: int, start: float = 0.0) -> list[float]:
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def lognormal(rng: random.Random, mean: float, cv: float) -> Callable[[], float]:
    if cv == 0:
        return lambda: mean
    s2 = math.log(1 + cv * cv)
    mu = math.log(mean) - s2 / 2
    return lambda: rng.lognormvariate(mu, math.sqrt(s2))


def test_fixed_length_sessions_every_retry_after_is_when_the_slot_frees() -> None:
    """Fixed 8 s sessions, 8 slots, queue of 8 for 5 s, offered 1.5x capacity: the
    queue overflows (queue_full, position 9) and waits expire (queue_timeout, position
    1). Tolerance, per refusal: the estimate within 2 % + 0.15 s of the true wait;
    Retry-After no earlier than that and no later than it rounded up plus the jitter
    window. The old estimate (mean x position / slots, no ages) said 1-2 s for the
    queue_timeout refusals whose slot freed ~3-4 s later, and 9 s at position 9."""
    rng = random.Random(5)
    core = core_of((8,), depth=8, wait=5.0, session_estimate_s=8.0, seed=5)
    refusals = simulate(core, poisson(rng, 1.5 * 8 / 8.0, 1500), lambda: 8.0)
    reasons = Counter(r.reason for r in refusals)
    assert reasons["queue_timeout"] > 100 and reasons["queue_full"] > 100
    for r in refusals:
        tolerance = 0.02 * r.truth_s + 0.15
        assert abs(r.estimate_s - r.truth_s) <= tolerance, r
        latest = math.ceil(r.truth_s + tolerance) + spread(r.truth_s + tolerance)
        assert r.truth_s - tolerance <= r.retry_after_s <= latest, r


@pytest.mark.parametrize(
    ("caps", "depth", "mean", "cv", "load", "seed", "tolerance"),
    [
        # tolerance: the median |estimate - true wait| may be 0.5 s plus this fraction
        # of the median true wait (measured: 0.97 s of 4.2 s, 0.46 of 0.68, 1.31 of 4.3,
        # 0.50 of 0.69; whole-second Retry-After makes sub-second precision moot)
        pytest.param((4, 4), 4, 8.0, 0.5, 1.5, 2, 0.25, id="lognormal-cv0.5-queue"),
        pytest.param((4, 4), 0, 8.0, 0.3, 1.3, 3, 0.25, id="lognormal-cv0.3-no-queue"),
        pytest.param((4, 4), 4, 8.0, 1.0, 1.5, 7, 0.3, id="exponential-queue"),
        pytest.param((12, 12), 16, 30.0, 0.5, 1.2, 6, 0.25, id="lognormal-30s-timeouts"),
    ],
)
def test_variable_length_sessions_retry_after_is_close_to_the_true_wait(
    caps: tuple[int, ...],
    depth: int,
    mean: float,
    cv: float,
    load: float,
    seed: int,
    tolerance: float,
) -> None:
    """Seeded lognormal (or exponential) session lengths under overload. A single wait
    is as random as the lengths, so the check is on the run: the estimate's median
    error is within 0.5 s plus the tolerance (a fraction of the median true wait) and
    its median bias within 15 % of it either way; at most 1 client in 5 is told to come
    back more than 2 s early; and each Retry-After is that estimate rounded up and
    jittered up."""
    rng = random.Random(seed)
    slots = sum(caps)
    core = core_of(caps, depth=depth, wait=10.0, session_estimate_s=mean, seed=seed)
    refusals = simulate(core, poisson(rng, load * slots / mean, 2000), lognormal(rng, mean, cv))
    assert len(refusals) > 300
    typical = statistics.median(r.truth_s for r in refusals)
    errors = [r.estimate_s - r.truth_s for r in refusals]
    assert statistics.median(abs(e) for e in errors) <= 0.5 + tolerance * typical
    assert abs(statistics.median(errors)) <= 0.15 * typical
    early = [r for r in refusals if r.retry_after_s < r.truth_s - 2.0]
    assert len(early) <= 0.2 * len(refusals)
    for r in refusals:  # what the client is told: the estimate, rounded up, jittered up
        assert retry_after_s(r.estimate_s, 0.0) <= r.retry_after_s
        assert r.retry_after_s <= retry_after_s(r.estimate_s, 0.9999)


def test_first_refusal_without_history_waits_for_the_running_sessions() -> None:
    """No session has ended yet: the pool's session_estimate_s (20 s) and the ages of
    the running sessions say the first slot frees at 20 s, 17 s after this refusal
    (the old estimate, 20 s x 1 / 8 slots, said 3 s)."""
    core = core_of((8,), session_estimate_s=20.0)
    for _ in range(8):
        assert isinstance(core.arrive(0.0), Admit)
    refusal = core.arrive(3.0)
    assert isinstance(refusal, Reject) and refusal.reason == "pool_full"
    assert 17.0 <= refusal.retry_after_s <= 17.0 + spread(17.0)
    assert core.estimate_wait(1, 3.0) == pytest.approx(17.0, rel=0.03)


def test_queue_timeout_advises_when_the_slots_actually_free() -> None:
    """Sessions of 17 s all started together; a waiter's 10 s expires at 28 s while the
    slots free at 34 s: Retry-After says 6 s, not the floor."""
    core = core_of((4, 4), depth=4, wait=10.0, session_estimate_s=17.0)
    tickets = [a.ticket for a in (core.arrive(0.0) for _ in range(8)) if isinstance(a, Admit)]
    for ticket in tickets:  # a first round, so there is history: 17 s, no spread
        core.release(ticket, 17.0)
    for _ in range(8):
        assert isinstance(core.arrive(17.0), Admit)
    waiting = core.arrive(18.0)
    assert isinstance(waiting, Enqueue)
    assert waiting.eta_s == pytest.approx(16.0, rel=0.03)
    (timeout,) = core.expire(28.0)
    assert timeout.reason == "queue_timeout" and timeout.queue_position == 1
    assert 6.0 <= timeout.retry_after_s <= 6.0 + spread(6.0)


def test_jitter_spreads_clients_refused_at_the_floor() -> None:
    """Sessions end every fraction of a second, so the estimate is below the 1 s floor:
    200 clients refused in the same instant still come back spread over 1-3 s (the old
    +-10 % jitter vanished at the floor: every one was told 1 s)."""
    core = core_of((4,), session_estimate_s=0.4, seed=3)
    for _ in range(4):
        core.arrive(0.0)
    assert core.estimate_wait(1, 0.1) < RETRY_AFTER_MIN_S
    values = []
    for _ in range(200):
        refusal = core.arrive(0.1)
        assert isinstance(refusal, Reject)
        values.append(refusal.retry_after_s)
    counts = Counter(values)
    assert set(counts) == {1.0, 2.0, 3.0}
    assert max(counts.values()) <= 0.5 * len(values)


def test_jitter_only_ever_adds_whole_seconds_above_the_estimate() -> None:
    assert [retry_after_s(4.2, u) for u in (0.0, 0.34, 0.67, 0.999)] == [5.0, 6.0, 7.0, 7.0]
    assert [retry_after_s(30.0, u) for u in (0.0, 0.5, 0.999)] == [30.0, 33.0, 36.0]


@pytest.mark.parametrize(
    "estimate", [0.0, 0.2, 1.0, 1.001, 2.5, 9.9, 17.0, 45.0, 59.5, 60.0, 500.0]
)
def test_retry_after_is_whole_seconds_never_before_the_estimate(estimate: float) -> None:
    values = {retry_after_s(estimate, i / 100) for i in range(100)}
    assert all(v.is_integer() and RETRY_AFTER_MIN_S <= v <= RETRY_AFTER_MAX_S for v in values)
    expected = min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(estimate)))
    if expected < RETRY_AFTER_MAX_S - spread(estimate):
        assert min(values) == expected
        assert max(values) == expected + spread(estimate)
    assert len(values) >= JITTER_MIN_S + 1  # spread even at the floor and at the cap


def test_retry_after_of_an_infinite_estimate_is_the_cap_window() -> None:
    assert retry_after_s(math.inf, 0.0) == RETRY_AFTER_MAX_S - spread(RETRY_AFTER_MAX_S)


# -- the model's parts ----------------------------------------------------------------


def test_session_lengths_start_from_the_seed_without_spread_and_learn_it() -> None:
    lengths = SessionLengths(20.0)
    assert (lengths.mean, lengths.cv) == (20.0, 0.0)
    for d in [10.0, 30.0] * 40:
        lengths.observe(d)
    assert lengths.mean == pytest.approx(20.0, abs=1.5)
    assert lengths.cv == pytest.approx(0.5, abs=0.1)
    with pytest.raises(ValueError, match="session_estimate_s"):
        SessionLengths(0.0)


def test_forecast_of_widely_varying_lengths_is_the_release_rate() -> None:
    """Exponential lengths in steady state (ages exponential too): releases come at
    about rate n / mean (the waiters ahead that are admitted meanwhile finish early
    too), so the p-th of n busy slots frees after about (p - 1/3) x mean / n (the
    median of a Gamma(p) wait), to the 0.1 s resolution."""
    rng = random.Random(1)
    ages = [rng.expovariate(1 / 8.0) for _ in range(64)]
    forecast = SlotForecast([(ages, 0)], mean_s=8.0, cv=1.0)
    for p in (1, 2, 4, 8, 16, 32, 64):
        expected = (p - 1 / 3) * 8.0 / 64
        assert forecast.wait_s(p) == pytest.approx(expected, rel=0.1, abs=0.1), p


@pytest.mark.parametrize(
    ("cv", "low", "high"), [(0.0, 0.0, 0.2), (0.5, 4.0, 10.0), (1.0, 8.0, 30.0)]
)
def test_an_old_session_ends_soon_only_when_lengths_barely_vary(
    cv: float, low: float, high: float
) -> None:
    """One 8 s-mean session aged 50 s: with fixed lengths it is ending now; the more
    lengths vary, the less its age says it is about to end."""
    assert low <= SlotForecast([([50.0], 0)], mean_s=8.0, cv=cv).wait_s(1) <= high


@pytest.mark.parametrize("age", [0.0, 1e-9, 7.99, 8.0, 30.0, 1e6, 1e300])
@pytest.mark.parametrize("cv", [0.0, 1e-6, 0.3, 1.0, 3.0, 50.0])
def test_forecast_is_finite_at_extreme_ages_and_spreads(age: float, cv: float) -> None:
    """No overflow, no log of zero (the survival function underflows far past the
    mean): every wait is finite and not negative."""
    forecast = SlotForecast([([age, 0.5 * age, 1.0], 0)], mean_s=8.0, cv=cv)
    for p in (1, 2, 3, 4, 7):
        wait = forecast.wait_s(p)
        assert math.isfinite(wait) and wait >= 0.0, (p, wait)


def test_forecast_counts_only_slots_a_release_would_free() -> None:
    """A replica over a lowered cap frees nothing until it is back under it; free slots
    held back (guard) come first."""
    over = SlotForecast([([0.0, 1.0, 2.0], 2)], mean_s=10.0, cv=0.0)
    assert over.slots == 1
    assert over.wait_s(1) == pytest.approx(10.0, rel=0.03)  # the youngest session's end
    held = SlotForecast([([5.0], 0)], mean_s=10.0, cv=0.0, free_now=1)
    assert held.wait_s(1) == 0.0
    assert held.wait_s(2) == pytest.approx(5.0, rel=0.03)
    assert held.wait_s(3) == pytest.approx(10.0, rel=0.03)  # the first slot again
    idle = SlotForecast([], mean_s=10.0, cv=0.0)
    assert idle.wait_s(2) == 20.0
    with pytest.raises(ValueError, match="position"):
        idle.wait_s(0)


@pytest.mark.parametrize("cv", [0.0, 0.3, 1.0, 2.0])
@pytest.mark.parametrize("sessions", [3, 40, 1000])
def test_forecast_is_ordered_by_position(cv: float, sessions: int) -> None:
    """Later positions never wait less, with a few sessions or a thousand (binned)."""
    rng = random.Random(sessions)
    ages = [rng.uniform(0.0, 40.0) for _ in range(sessions)]
    forecast = SlotForecast([(ages, 0)], mean_s=25.0, cv=cv)
    waits = [forecast.wait_s(p) for p in range(1, 2 * sessions + 2)]
    assert all(w >= 0.0 and math.isfinite(w) for w in waits)
    assert waits == sorted(waits)


def test_the_estimate_follows_the_state_not_a_stale_forecast() -> None:
    """The forecast is reused while nothing changes (shifted by the time elapsed); an
    ejection, a cap change, a restore and a release each invalidate it, even in the same
    instant. Sessions of 10 s admitted at 0, 1, 2, 3 s on gpu0, gpu1, gpu0, gpu1."""
    core = core_of((2, 2), session_estimate_s=10.0)
    for t in (0.0, 1.0, 2.0, 3.0):
        assert isinstance(core.arrive(t), Admit)
    assert [core.lease_replica(t) for t in (1, 2, 3, 4)] == ["gpu0", "gpu1", "gpu0", "gpu1"]
    assert core.estimate_wait(1, 4.0) == pytest.approx(6.0, rel=0.03)  # ticket 1 ends at 10
    assert core.estimate_wait(1, 4.2) == pytest.approx(5.8, rel=0.03)  # reused, shifted
    core.set_healthy("gpu0", False, 4.2)
    assert core.estimate_wait(1, 4.2) == pytest.approx(6.8, rel=0.03)  # gpu1's ticket 2, at 11
    core.set_cap("gpu1", 1, 4.2)
    assert core.estimate_wait(1, 4.2) == pytest.approx(8.8, rel=0.03)  # gpu1 under cap at 13
    core.set_healthy("gpu0", True, 4.2)
    assert core.estimate_wait(1, 4.2) == pytest.approx(5.8, rel=0.03)
    core.release(1, 4.2)
    assert core.estimate_wait(1, 4.2) == 0.0  # gpu0 has a free slot


# -- no_healthy_replica: the health re-check --------------------------------------------


def test_next_recheck_counts_from_each_ejection() -> None:
    assert next_recheck_s([], 5.0) is None
    assert next_recheck_s([1.0], 5.0) == 4.0
    assert next_recheck_s([7.0], 5.0) == 3.0
    assert next_recheck_s([5.0], 5.0) == 5.0  # that check is running now
    assert next_recheck_s([7.0, 0.5], 5.0) == 3.0


def test_no_healthy_replica_advises_the_next_recheck() -> None:
    """Both replicas ejected at 0 s, re-checked every 5 s: a refusal at 1 s advises
    about 4 s, one at 7 s about 3 s (the 10 s re-check) -- not the 1 s floor or the
    20 s session estimate."""
    core = core_of((2, 2), session_estimate_s=20.0, recheck_interval_s=5.0)
    core.set_healthy("gpu0", False, 0.0)
    core.set_healthy("gpu1", False, 0.0)
    for now, wait in ((1.0, 4.0), (7.0, 3.0)):
        refusal = core.arrive(now)
        assert isinstance(refusal, Reject) and refusal.reason == "no_healthy_replica"
        assert wait <= refusal.retry_after_s <= wait + spread(wait)
    core.set_healthy("gpu1", True, 8.0)
    core.set_healthy("gpu1", False, 9.0)  # ejected again: its checks restart from 9 s
    refusal = core.arrive(12.0)
    assert isinstance(refusal, Reject)
    assert 2.0 <= refusal.retry_after_s <= 2.0 + spread(2.0)  # gpu1 at 14 s, gpu0 at 15 s


async def test_gate_plumbs_the_recheck_interval_into_every_pool() -> None:
    clock = FakeClock()
    gate = Gate([core_of((1,), session_estimate_s=20.0)], clock=clock, recheck_interval_s=30.0)
    gate.set_healthy("tts", "gpu0", False)
    with pytest.raises(CapacityRefused) as refused:
        gate.enter("tts")
    assert refused.value.reason == "no_healthy_replica"
    assert 30 <= int(refused.value.headers()["Retry-After"]) <= 30 + spread(30.0)
    gate.set_recheck_interval(5.0)
    gate.apply_pool("new", [ReplicaSpec("gpu9", 1)], QueuePolicy(), None)
    assert gate.core("new").recheck_interval_s == 5.0
    clock.advance(1.0)
    with pytest.raises(CapacityRefused) as refused:
        gate.enter("tts")
    assert 4.0 <= refused.value.retry_after_s <= 4.0 + spread(4.0)


def test_runtime_takes_the_interval_from_settings_and_reloads() -> None:
    routes = [{"path": "/s", "pool": "main", "protocol": "passthrough-ws"}]
    settings = proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 2)], routes, health={"recheck_interval_s": 12}
    )
    rt = Runtime(settings, clock=FakeClock())
    assert rt.gate.core("main").recheck_interval_s == 12
    rt.apply(proxy_settings(
        [("gpu0", "http://127.0.0.1:9", 2)], routes, health={"recheck_interval_s": 3}
    ))  # fmt: skip
    assert rt.gate.core("main").recheck_interval_s == 3


# -- one number everywhere ------------------------------------------------------------


@pytest.mark.parametrize("given", [0.2, 1.0, 2.2, 2.5, 3.5, 17.0, 59.01])
def test_message_header_and_body_say_the_same_number(given: float) -> None:
    """The header is whole seconds, rounded up; the body's retry_after_s and the
    message say that number too (the message used to round 2.5 to 2 and 3.5 to 4
    while the header said 3 and 4, and the body 2.5)."""
    for err in (
        refusal_for("queue_timeout", retry_after_s=given, pool="tts"),
        TenantLimitRefused("tenant_limit", retry_after_s=given, pool="tts"),
    ):
        expected = max(1, math.ceil(given))
        _status, headers, _body = http_error(err)
        assert dict(headers)[b"retry-after"] == str(expected).encode()
        body = err.body()["error"]
        assert body["retry_after_s"] == float(expected)
        assert f"Retry in about {expected} s" in body["message"]
        assert close_reason(err).endswith(f"retry after {expected} s")
        assert f'"retry_after_s":{float(expected)}' in error_event("vllm-realtime", err)


def test_a_core_refusal_reaches_the_client_unchanged() -> None:
    core = core_of((1,), session_estimate_s=20.0, seed=9)
    core.arrive(0.0)
    reject = core.arrive(2.5)
    assert isinstance(reject, Reject) and reject.retry_after_s.is_integer()
    err: Refused = refusal_for(reject.reason, retry_after_s=reject.retry_after_s, pool="tts")
    assert err.retry_after_s == reject.retry_after_s
    assert err.headers()["Retry-After"] == str(int(reject.retry_after_s))
