"""How long a refused (or queued) session should expect to wait: the Retry-After estimate.

Pure functions of what an admission backend knows plus ``now``; no clock, no I/O, no
randomness of their own (the jitter's uniform draw is passed in). Both backends use
them, one :class:`SessionLengths` per pool and one rule for a refusal's estimate
(:func:`refusal_estimate_s`): the in-process :class:`~proxy.admission.PoolCore` and the
shared gate's :class:`~proxy.admission.shared_state.PoolState`, so the same history of
sessions gives the same Retry-After on either (tests/shared_admission/test_gate_differential.py).

The model. Session lengths are lognormal with the observed mean and coefficient of
variation (:class:`SessionLengths`, an EWMA seeded with the pool's
``session_estimate_s`` and no spread, so before any session has ended a session is
taken to last about that long). A running session of age ``a`` ends within ``t`` with
probability ``F(t | a) = 1 - S(a + t) / S(a)``: with little spread a session ends
about ``mean - a`` from now (fixed lengths: exactly); with a wide spread an old session
is not taken to be about to end. The ``k``-th slot to free is expected when the
expected count of usable releases within ``t`` reaches ``k - 1/3`` (about the median
of the ``k``-th release); a freed slot goes to the head waiter, so a client that would
stand at queue position ``p`` waits for the ``p``-th. The waiters ahead that are
handed a slot meanwhile can end within ``t`` too (counted for variable lengths by a
renewal term); past one round of the ``n`` usable slots each later round adds a mean
length: the ``p``-th frees at ``t[(p-1) % n] + mean * ((p-1) // n)``. Each position is
found by bisection over at most 24 age bins per replica group, and the core reuses a
forecast for half a second while nothing changes, so a refusal storm stays cheap.

``Retry-After`` is integer seconds: :func:`retry_after_s` rounds the estimate up,
clamps it to [:data:`RETRY_AFTER_MIN_S`, :data:`RETRY_AFTER_MAX_S`] and spreads clients
*upward* over ``max(JITTER_MIN_S, JITTER_FRACTION * estimate)`` whole seconds, so
clients refused in the same instant come back spread out even at the 1 s floor, and
none is told to come back before the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "JITTER_FRACTION",
    "JITTER_MIN_S",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "SessionLengths",
    "SlotForecast",
    "next_recheck_s",
    "refusal_estimate_s",
    "retry_after_s",
    "slot_wait_s",
]

RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
#: Upward jitter: spread over max(JITTER_MIN_S, JITTER_FRACTION x estimate) whole seconds.
JITTER_MIN_S = 2
JITTER_FRACTION = 0.2

_EWMA_ALPHA = 0.1
_MIN_MEAN_S = 0.05
_MIN_CV = 0.01  # as good as fixed-length
_MAX_CV = 3.0
#: A session whose log survival at its age is below this is as good as ended.
_MAX_HAZARD_LOG = 690.0
_LN2 = math.log(2.0)
_RESOLUTION_S = 0.1
#: The k-th release is expected when the expected count reaches k - 1/3: for releases
#: at a steady rate (a Poisson count), about the median of the k-th arrival.
_TARGET = 2.0 / 3.0


class SessionLengths:
    """EWMA of observed session lengths: mean and variance (West's incremental form).

    Seeded with ``seed_s`` and zero variance: until sessions end, a session is taken to
    last about the configured ``session_estimate_s``."""

    __slots__ = ("mean", "variance")

    def __init__(self, seed_s: float) -> None:
        if seed_s <= 0:
            raise ValueError("session_estimate_s must be > 0")
        self.mean = seed_s
        self.variance = 0.0

    def observe(self, duration_s: float) -> None:
        """Fold in one ended session's length (seconds; negative counts as 0). The mean is kept
        above a small floor."""
        delta = max(0.0, duration_s) - self.mean
        self.mean = max(_MIN_MEAN_S, self.mean + _EWMA_ALPHA * delta)
        self.variance = (1.0 - _EWMA_ALPHA) * (self.variance + _EWMA_ALPHA * delta * delta)

    @property
    def cv(self) -> float:
        """Coefficient of variation (standard deviation / mean)."""
        return math.sqrt(self.variance) / self.mean

    def forecast(
        self, replicas: Iterable[tuple[Sequence[float], int]], free_now: int = 0
    ) -> SlotForecast:
        """A :class:`SlotForecast` of ``replicas`` with these lengths' mean and spread."""
        return SlotForecast(replicas, mean_s=self.mean, cv=self.cv, free_now=free_now)

    def __repr__(self) -> str:
        return f"<SessionLengths mean={self.mean:.2f}s cv={self.cv:.2f}>"


class _LengthModel:
    """Lognormal session lengths with a given mean and coefficient of variation: their
    log survival function ``log P(length > x)``, -inf where it underflows."""

    __slots__ = ("_mu", "_sigma_sqrt2")

    def __init__(self, mean: float, cv: float) -> None:
        cv = min(_MAX_CV, max(_MIN_CV, cv))
        sigma2 = math.log1p(cv * cv)
        self._mu = math.log(mean) - sigma2 / 2.0
        self._sigma_sqrt2 = math.sqrt(2.0 * sigma2)

    def log_survival(self, x: float) -> float:
        """``log P(length > x)`` for ``x`` seconds: 0 at or below 0, -inf where the tail
        underflows."""
        if x <= 0.0:
            return 0.0
        tail = math.erfc((math.log(x) - self._mu) / self._sigma_sqrt2)  # in [0, 2]
        # log(tail / 2), not log(0.5 * tail): half the smallest subnormal is 0.
        return math.log(tail) - _LN2 if tail > 0.0 else -math.inf


_MAX_BINS = 24  # running sessions per group are summarised in this many age bins


class SlotForecast:
    """When the usable slots of a pool are expected to free, from one snapshot.

    ``replicas`` gives, per replica whose freed slots can be used, the ages (seconds)
    of its running sessions and how many of them must end before one frees a slot
    (the excess over a lowered cap, else 0). ``free_now`` slots are free already
    (held back, e.g. by the guard, but counted as the first to come). Lengths have
    mean ``mean_s`` and coefficient of variation ``cv``.

    Build one per state and ask :meth:`wait_s` for any number of positions (each is
    found by bisection, to 2 % or 0.1 s, and remembered). Ages are summarised in at
    most 24 equal-count bins per group, so the cost does not grow with the number of
    sessions beyond sorting their ages."""

    __slots__ = ("_bins", "_memo", "_model", "free_now", "mean_s", "slots")

    def __init__(
        self,
        replicas: Iterable[tuple[Sequence[float], int]],
        *,
        mean_s: float,
        cv: float,
        free_now: int = 0,
    ) -> None:
        self.mean_s = mean_s
        self.free_now = free_now
        self._model = model = _LengthModel(mean_s, cv)
        # Groups without an excess are pooled: only their total count matters.
        pooled: list[float] = []
        grouped: list[tuple[list[float], int]] = []
        running = 0
        for ages, excess in replicas:
            if len(ages) <= excess:
                continue
            running += len(ages) - excess
            if excess:
                grouped.append((list(ages), excess))
            else:
                pooled.extend(ages)
        if pooled:
            grouped.append((pooled, 0))
        self.slots = free_now + running
        # (weights, ages, log survival at those ages, sessions as good as ended, excess)
        self._bins: list[tuple[list[int], list[float], list[float], int, int]] = []
        for ages_s, excess in grouped:
            weights, reps = _bin(sorted(ages_s))
            kept_w: list[int] = []
            kept: list[float] = []
            logs: list[float] = []
            done = 0
            for w, r in zip(weights, reps, strict=True):
                log_s = model.log_survival(r)
                if log_s < -_MAX_HAZARD_LOG:  # far past any plausible length: ending now
                    done += w
                else:
                    kept_w.append(w)
                    kept.append(r)
                    logs.append(log_s)
            self._bins.append((kept_w, kept, logs, done, excess))
        self._memo: dict[int, float] = {}

    def wait_s(self, position: int) -> float:
        """Expected seconds until the ``position``-th usable slot frees (1 = next).
        ``mean_s * position`` when nothing runs at all."""
        if position < 1:
            raise ValueError("position must be >= 1")
        if self.slots == 0:
            return self.mean_s * position
        cached = self._memo.get(position)
        if cached is not None:
            return cached
        rounds, index = divmod(position - 1, self.slots)
        extra = self.mean_s * rounds  # the waiters admitted meanwhile each hold a slot
        target = index + _TARGET - self.free_now
        wait = extra if target < 0 else extra + self._first_round(index, target)
        self._memo[position] = wait
        return wait

    def _first_round(self, index: int, target: float) -> float:
        def short(t: float) -> bool:
            return _total(*self._curve(t), index) < target

        # Bracket by halving or doubling from half a session, then bisect to 2 %.
        lo, hi = 0.0, 0.5 * self.mean_s
        if short(hi):
            lo, hi = hi, 2.0 * hi
            while short(hi):
                if hi > 64.0 * self.mean_s:
                    return hi
                lo, hi = hi, 2.0 * hi
        else:
            while hi > _RESOLUTION_S and not short(hi / 2.0):
                hi /= 2.0
            lo = hi / 2.0 if hi > _RESOLUTION_S else 0.0
        while hi - lo > max(_RESOLUTION_S, 0.02 * hi):
            mid = (lo + hi) / 2.0
            if short(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def _curve(self, t: float) -> tuple[float, float]:
        """(expected usable releases of the running sessions within ``t``, the mean
        over [0, t] of the probability that a session started then has ended)."""
        log_survival = self._model.log_survival
        ended_total = 0.0
        for weights, ages, logs, done, excess in self._bins:
            ended = float(done)
            for w, a, log_s in zip(weights, ages, logs, strict=True):
                ended -= w * math.expm1(log_survival(a + t) - log_s)
            ended_total += max(0.0, ended - excess)
        g = (
            4.0 * -math.expm1(log_survival(0.25 * t))
            + 2.0 * -math.expm1(log_survival(0.5 * t))
            + 4.0 * -math.expm1(log_survival(0.75 * t))
            - math.expm1(log_survival(t))
        ) / 12.0  # composite Simpson, F(0) = 0
        return ended_total, g


def _total(ended: float, g: float, index: int) -> float:
    """Releases within the time ``ended`` and ``g`` were taken at, counting the waiters
    ahead (at most ``index``) whose own sessions end in time too: with releases spread
    evenly over [0, t] each starts a session that ends in time with probability ``g``,
    and the renewal series ``ended * (g + g^2 + ...)`` is exact for exponential lengths."""
    if g <= 0.0:
        return ended
    renewed = ended * g / (1.0 - g) if g < 1.0 else math.inf
    return ended + min(float(index), renewed)


def _bin(ages: list[float]) -> tuple[list[int], list[float]]:
    """Sorted ages as (counts, mean ages) of at most ``_MAX_BINS`` equal-count bins."""
    n = len(ages)
    if n <= _MAX_BINS:
        return [1] * n, ages
    weights: list[int] = []
    reps: list[float] = []
    for b in range(_MAX_BINS):
        lo, hi = n * b // _MAX_BINS, n * (b + 1) // _MAX_BINS
        weights.append(hi - lo)
        reps.append(sum(ages[lo:hi]) / (hi - lo))
    return weights, reps


def slot_wait_s(
    position: int,
    replicas: Iterable[tuple[Sequence[float], int]],
    *,
    mean_s: float,
    cv: float,
    free_now: int = 0,
) -> float:
    """Expected seconds until the ``position``-th usable slot frees (one-off
    :class:`SlotForecast`)."""
    return SlotForecast(replicas, mean_s=mean_s, cv=cv, free_now=free_now).wait_s(position)


def next_recheck_s(ejected_for: Iterable[float], interval_s: float) -> float | None:
    """Seconds until the next health re-check of the replica checked soonest, given how
    long each has been ejected; re-checks run every ``interval_s`` after ejection.
    None when nothing is ejected."""
    soonest: float | None = None
    for age in ejected_for:
        age = max(0.0, age)
        wait = interval_s * max(1, math.ceil(age / interval_s)) - age
        if wait <= 0.0:  # exactly on a tick: that check is happening now
            wait = interval_s
        soonest = wait if soonest is None else min(soonest, wait)
    return soonest


def refusal_estimate_s(
    reason: str,
    wait_s: Callable[[], float],
    ejected_for: Iterable[float],
    recheck_interval_s: float | None,
) -> float:
    """The estimate behind a refusal's ``Retry-After`` (before :func:`retry_after_s`):
    for ``no_healthy_replica``, until the next health re-check of an ejected replica
    (``ejected_for``: how long each has been ejected) when ``recheck_interval_s`` is
    known and one is ejected; otherwise ``wait_s()``, when the slot the client would
    have been handed frees."""
    if reason == "no_healthy_replica" and recheck_interval_s is not None:
        recheck = next_recheck_s(ejected_for, recheck_interval_s)
        if recheck is not None:
            return recheck
    return wait_s()


def retry_after_s(estimate_s: float, u: float) -> float:
    """The ``Retry-After`` to give: whole seconds, never below the estimate (rounded
    up) or :data:`RETRY_AFTER_MIN_S`, at most :data:`RETRY_AFTER_MAX_S`, spread upward
    over ``max(JITTER_MIN_S, JITTER_FRACTION * estimate)`` seconds by ``u`` in [0, 1).
    Near the cap the window slides down so that it still spreads."""
    floor_s, cap_s = int(RETRY_AFTER_MIN_S), int(RETRY_AFTER_MAX_S)
    if not math.isfinite(estimate_s):
        estimate_s = cap_s
    base = min(cap_s, max(floor_s, math.ceil(round(estimate_s, 3))))
    spread = max(JITTER_MIN_S, int(JITTER_FRACTION * base))
    base = min(base, cap_s - spread)
    offset = min(spread, int(u * (spread + 1)))
    return float(base + offset)
