"""Quantiles of a stream of values in bounded memory: log-bucket histograms (a
replica's rolling windows, :mod:`proxy.metering.rolling`) and a session's sketch
(:class:`QuantileSketch`, :mod:`proxy.metering.session_meter`).

Quantile method. Values go into a log-bucket histogram (:class:`LogHistogram`):
bucket ``k`` holds ``(GAMMA**(k-1), GAMMA**k]`` and reports ``2*GAMMA**k/(GAMMA+1)``, so
every quantile it returns is within ``(GAMMA-1)/(GAMMA+1)`` (relative) of a value
whose rank is the requested one (nearest-rank definition: the value at rank
``ceil(q*n)`` of the sorted samples). Values are clamped to ``[1e-6, 1e6]``; zero and
negative values share one exact zero bucket. Memory is bounded by the clamp range,
whatever the number of samples (docs/performance.md gives the figures).
"""

from __future__ import annotations

import math
from array import array
from math import ceil, log  # compiled: C calls; interpreted: one global lookup each
from typing import Final

__all__ = ["GAMMA", "LogHistogram", "QuantileSketch", "SparseLogHistogram"]

#: Bucket growth factor: the relative quantile error is at most (GAMMA-1)/(GAMMA+1).
GAMMA: Final = 1.04
# Final: compiled, these are C constants rather than lookups in the module's namespace.
_INV_LOG_GAMMA: Final = 1.0 / math.log(GAMMA)
_MIN: Final = 1e-6
_MAX: Final = 1e6
_ZERO: Final = -(10**9)  # bucket key of values <= 0 (reported as 0.0); sorts first


def _value(key: int) -> float:
    return 0.0 if key == _ZERO else 2.0 * GAMMA**key / (GAMMA + 1.0)


def _key(value: float) -> int:
    """The bucket key of a positive ``value`` (the insertions compute it inline)."""
    return ceil(log(_MIN if value < _MIN else _MAX if value > _MAX else value) * _INV_LOG_GAMMA)


def _rank(q: float, n: int) -> int:
    """Nearest rank (1-based) of quantile ``q`` among ``n`` samples."""
    return min(max(math.ceil(q * n - 1e-9), 1), n)


class LogHistogram:
    """Log-bucket histogram; see the module docstring for its error bound.

    The counts of the buckets from the lowest to the highest key seen are a list (a
    window that widens to take a new key), so an insertion is an index, not a hash
    lookup; values of one stream fill a few neighbouring buckets, and the clamp range
    bounds the window. Zero and below are counted apart."""

    __slots__ = ("_counts", "_low", "_zeros", "count")

    def __init__(self) -> None:
        self._counts: list[int] = []  # the count of bucket ``_low + i`` at ``i``
        self._low = 0
        self._zeros = 0
        self.count = 0

    @property
    def buckets(self) -> dict[int, int]:
        """The occupied buckets' counts by key (``_ZERO``: the zero bucket)."""
        low = self._low
        occupied = {low + i: n for i, n in enumerate(self._counts) if n}
        if self._zeros:
            occupied[_ZERO] = self._zeros
        return occupied

    def add(self, value: float) -> None:
        # The bucket key, computed here rather than in a function of its own: every
        # audio chunk makes two to four of these insertions (replica signals, and a
        # long session's sketches).
        self.count += 1
        if not value > 0.0:  # zero, negative, NaN
            self._zeros += 1
            return
        key = ceil(  # min(max(value, _MIN), _MAX), without the two builtin calls
            log(_MIN if value < _MIN else _MAX if value > _MAX else value) * _INV_LOG_GAMMA
        )
        counts = self._counts
        i = key - self._low
        if 0 <= i < len(counts):
            counts[i] += 1
        else:
            self._widen(key, key)
            self._counts[key - self._low] += 1

    def _widen(self, low: int, high: int) -> None:
        """Make the window cover the keys ``low`` to ``high``."""
        counts = self._counts
        if not counts:
            self._counts = [0] * (high - low + 1)
            self._low = low
            return
        if low < self._low:
            self._counts = counts = [0] * (self._low - low) + counts
            self._low = low
        top = self._low + len(counts) - 1
        if high > top:
            counts.extend([0] * (high - top))

    def merge(self, other: LogHistogram) -> None:
        theirs = other._counts
        if theirs:
            low = other._low
            self._widen(low, low + len(theirs) - 1)
            counts = self._counts
            offset = low - self._low
            for i, n in enumerate(theirs):
                if n:
                    counts[offset + i] += n
        self._zeros += other._zeros
        self.count += other.count

    def subtract(self, other: LogHistogram) -> None:
        """Remove ``other``'s samples (which must have been merged in before)."""
        counts = self._counts
        low = self._low
        top = low + len(counts) - 1
        for i, n in enumerate(other._counts):
            key = other._low + i
            if n and low <= key <= top:
                left = counts[key - low] - n
                counts[key - low] = left if left > 0 else 0
        self._zeros = max(self._zeros - other._zeros, 0)
        self.count = max(self.count - other.count, 0)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (0 < q <= 1), or None when empty."""
        if self.count <= 0:
            return None
        rank = _rank(q, self.count)
        seen = self._zeros
        if seen >= rank:
            return 0.0
        low = self._low
        last = 0.0
        for i, n in enumerate(self._counts):
            if n:
                seen += n
                last = _value(low + i)
                if seen >= rank:
                    return last
        return last  # unreachable unless counts drifted

    def __repr__(self) -> str:
        return f"<LogHistogram n={self.count} buckets={len(self.buckets)}>"


#: The run of neighbouring keys a :class:`SparseLogHistogram` may count in its list:
#: a factor of ``GAMMA**_SPAN`` from the lowest to the highest value it holds.
_SPAN: Final = 64
#: The count at which a bucket in a session histogram's list carries (CPython shares its
#: int objects up to 256).
_CARRY: Final = 256


class SparseLogHistogram:
    """The buckets of :class:`LogHistogram` for one session: insertion and quantiles only.

    The keys around the stream's usual values are counted in a list, as in
    :class:`LogHistogram` (a window that widens to take a new key), but only within a
    range of :data:`_SPAN` keys fixed once: around the first value counted, or the value
    given to :meth:`center` before any. A key outside that range, and zero and below,
    is counted in a dict made at the first such key. A session's values cluster (its
    chunk gaps and delivery ratios) with a few far off (back-to-back arrivals, stalls):
    the cluster costs an index, not a hash lookup, and holds a list only as wide as the
    cluster; the far ones cost no empty counts between them.

    A count in the list stays below :data:`_CARRY`: when it would reach it, it goes back
    to zero and a second list of the same width, made at the first carry, counts the
    carries. CPython shares its int objects up to 256, so an insertion into the list
    allocates no int and reads no object outside the list: a relay holds many sessions'
    histograms, and a count object last touched a chunk earlier is a cache miss."""

    __slots__ = ("_carries", "_counts", "_far", "_floor", "_low", "count")

    def __init__(self) -> None:
        self._counts: list[int] = []  # the count of bucket ``_low + i`` at ``i``
        self._carries: list[int] | None = None  # its carries at ``i``, once there is one
        self._low = 0
        self._floor = _ZERO  # the list's range is _floor to _floor + _SPAN - 1 (once set)
        self._far: dict[int, int] | None = None
        self.count = 0

    @property
    def buckets(self) -> dict[int, int]:
        """The occupied buckets' counts by key (``_ZERO``: the zero bucket)."""
        low = self._low
        counts = self._counts
        carries = self._carries
        if carries is not None:
            counts = [n + carries[i] * _CARRY for i, n in enumerate(counts)]
        occupied = {low + i: n for i, n in enumerate(counts) if n}
        if self._far is not None:
            occupied.update(self._far)
        return occupied

    def add(self, value: float) -> None:
        # The key of LogHistogram.add, computed the same way (tests/unit/test_signals.py
        # checks both against one reference).
        self.count += 1
        if value > 0.0:
            key = ceil(
                log(_MIN if value < _MIN else _MAX if value > _MAX else value) * _INV_LOG_GAMMA
            )
            counts = self._counts
            i = key - self._low
            if 0 <= i < len(counts):
                n = counts[i] + 1
                if n < _CARRY:
                    counts[i] = n
                    return
                counts[i] = 0
                carries = self._carries
                if carries is None:
                    carries = self._carries = [0] * len(counts)
                carries[i] += 1
                return
            if self._widen(key):
                self._counts[key - self._low] += 1
                return
        else:  # zero, negative, NaN
            key = _ZERO
        far = self._far
        if far is None:
            far = self._far = {}
        far[key] = far.get(key, 0) + 1

    def center(self, value: float) -> None:
        """Before the first value: the list's range is the :data:`_SPAN` keys around
        ``value``'s (a sketch's median, when it turns to this histogram)."""
        if self.count or not value > 0.0:
            return
        self._floor = _key(value) - _SPAN // 2

    def _widen(self, key: int) -> bool:
        """Make the list take ``key`` if it is in the list's range."""
        floor = self._floor
        if floor == _ZERO:
            floor = self._floor = key - _SPAN // 2
        if not floor <= key < floor + _SPAN:
            return False
        counts = self._counts
        carries = self._carries  # kept as wide as the counts
        if not counts:
            self._counts = [0]
            self._low = key
        elif key < self._low:
            self._counts = [0] * (self._low - key) + counts
            if carries is not None:
                self._carries = [0] * (self._low - key) + carries
            self._low = key
        else:
            more = key - self._low - len(counts) + 1
            counts.extend([0] * more)
            if carries is not None:
                carries.extend([0] * more)
        return True

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (0 < q <= 1), or None when empty."""
        if self.count <= 0:
            return None
        rank = _rank(q, self.count)
        buckets = self.buckets
        seen = 0
        for key in sorted(buckets):
            seen += buckets[key]
            if seen >= rank:
                return _value(key)
        return _value(max(buckets))  # unreachable unless counts drifted

    def __repr__(self) -> str:
        return f"<SparseLogHistogram n={self.count} buckets={len(self.buckets)}>"


class QuantileSketch:
    """Exact quantiles for the first ``exact_limit`` samples, then a
    :class:`SparseLogHistogram`.

    A short session's own p99 is exact; a long one costs at most the histogram's bounded
    memory, with its bounded error. The exact samples are C doubles in an ``array('d')``
    (8 bytes each, against 32 for a list of floats), and a meter has two sketches. Memory the
    samples held is freed when the histogram takes over, but the allocator keeps it for
    later sessions: the limit bounds what a relay's resident size carries per session."""

    __slots__ = ("_exact", "_hist", "_limit")

    def __init__(self, exact_limit: int = 256) -> None:
        self._limit = exact_limit
        self._exact: array[float] | None = array("d")
        self._hist: SparseLogHistogram | None = None

    @property
    def count(self) -> int:
        if self._exact is not None:
            return len(self._exact)
        assert self._hist is not None
        return self._hist.count

    def add(self, value: float) -> None:
        exact = self._exact
        if exact is not None:
            exact.append(value)
            if len(exact) > self._limit:
                hist = SparseLogHistogram()
                hist.center(self.quantile(0.5) or 0.0)
                for v in exact:
                    hist.add(v)
                self._hist, self._exact = hist, None
            return
        assert self._hist is not None
        self._hist.add(value)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile, or None with no samples."""
        exact = self._exact
        if exact is None:
            assert self._hist is not None
            return self._hist.quantile(q)
        if not exact:
            return None
        return sorted(exact)[_rank(q, len(exact)) - 1]
