"""Rolling per-replica signals: the worst-1% delivery ratio and the p99 gap of recent
chunks, and how recent streams started (stalls at their first seam, time to first audio).

Pure: no clock reads, no asyncio; every call takes ``now`` (monotonic seconds).

Quantile method. Values go into a log-bucket histogram (:class:`LogHistogram`):
bucket ``k`` holds ``(GAMMA**(k-1), GAMMA**k]`` and reports ``2*GAMMA**k/(GAMMA+1)``, so
every quantile it returns is within ``(GAMMA-1)/(GAMMA+1)`` = 1.96 % (relative) of a value
whose rank is the requested one (nearest-rank definition: the value at rank
``ceil(q*n)`` of the sorted samples). Values are clamped to ``[1e-6, 1e6]``; zero and
negative values share one exact zero bucket. Memory is bounded by the clamp range
(at most ~710 buckets), whatever the number of samples.

Rolling window (:class:`ReplicaSignals`): samples land in the open ``slice_s`` time slice
(1 s); a running total gets each slice added when it closes and subtracted when it falls
out of the window, so ``observe`` is O(1) (two list increments) and a query merges the
total with the open slice, one pass over their (few dozen) buckets. The window
is rounded up to whole slices, ``W = ceil(window_s / slice_s) * slice_s``: a sample
stays in it for between ``W`` and ``W + slice_s`` seconds (30 to 31 s by default).

Start-up signals (the guard's second and third inputs, :class:`StartupSignals`): each
stream's *first seam* -- its second audio chunk, where the listener's modelled playback
(:class:`proxy.playback.PlaybackBuffer`) either still had audio or ran dry, the
``headroom_playback_first_chunk_underruns_total`` case -- and each session's time to
first audio, in the same slices and window as the ratios.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass
from math import ceil, log  # compiled: C calls; interpreted: one global lookup each
from typing import Final

__all__ = [
    "GAMMA", "LogHistogram", "QuantileSketch", "ReplicaSignals", "SparseLogHistogram",
    "StartupSignals",
]  # fmt: skip

#: Bucket growth factor: quantile error <= (GAMMA-1)/(GAMMA+1) = 1.96 %.
GAMMA: Final = 1.04
# Final: compiled, these are C constants rather than lookups in the module's namespace.
_INV_LOG_GAMMA: Final = 1.0 / math.log(GAMMA)
_MIN: Final = 1e-6
_MAX: Final = 1e6
_ZERO: Final = -(10**9)  # bucket key of values <= 0 (reported as 0.0); sorts first


def _value(key: int) -> float:
    return 0.0 if key == _ZERO else 2.0 * GAMMA**key / (GAMMA + 1.0)


def _rank(q: float, n: int) -> int:
    """Nearest rank (1-based) of quantile ``q`` among ``n`` samples."""
    return min(max(math.ceil(q * n - 1e-9), 1), n)


class LogHistogram:
    """Log-bucket histogram; see the module docstring for its error bound.

    The counts of the buckets from the lowest to the highest key seen are a list (a
    window that widens to take a new key), so an insertion is an index, not a hash
    lookup; values of one stream fill a few neighbouring buckets, and the clamp range
    bounds the window at about 710 counts. Zero and below are counted apart."""

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


class SparseLogHistogram:
    """The buckets of :class:`LogHistogram`, kept in a dict of the occupied ones: a
    session's histogram, where a list from its lowest to its highest key would span the
    back-to-back arrivals and the late ones, mostly empty. Insertion and quantiles only."""

    __slots__ = ("buckets", "count")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0

    def add(self, value: float) -> None:
        # The key of LogHistogram.add, computed the same way (tests/unit/test_signals.py
        # checks both against one reference).
        if value > 0.0:
            key = ceil(
                log(_MIN if value < _MIN else _MAX if value > _MAX else value) * _INV_LOG_GAMMA
            )
        else:  # zero, negative, NaN
            key = _ZERO
        buckets = self.buckets
        buckets[key] = buckets.get(key, 0) + 1
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (0 < q <= 1), or None when empty."""
        if self.count <= 0:
            return None
        rank = _rank(q, self.count)
        seen = 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen >= rank:
                return _value(key)
        return _value(max(self.buckets))  # unreachable unless counts drifted

    def __repr__(self) -> str:
        return f"<SparseLogHistogram n={self.count} buckets={len(self.buckets)}>"


class QuantileSketch:
    """Exact quantiles for the first ``exact_limit`` samples, then a
    :class:`SparseLogHistogram`.

    A short session's own p99 is exact (the default limit is ten seconds of 40 ms chunks);
    a long one costs at most the histogram's bounded memory, with its 1.96 % error. The
    exact samples are C doubles in an ``array('d')`` (8 bytes each, against 32 for a list
    of floats): 2 KB at the default limit, per sketch, and a meter has two. Memory the
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


@dataclass(frozen=True, slots=True)
class StartupSignals:
    """How the streams of a window started: ``seams`` first seams (a stream's second
    audio chunk), ``stalled`` of them after the modelled playback ran dry, ``ttfas``
    sessions' times to first audio and their nearest-rank p99 (None without any)."""

    seams: int = 0
    stalled: int = 0
    ttfas: int = 0
    ttfa_p99: float | None = None

    @property
    def stalled_share(self) -> float | None:
        """``stalled / seams``; None without a seam."""
        return self.stalled / self.seams if self.seams else None


class _Slice:
    __slots__ = ("gaps", "index", "ratios", "seams", "stalled", "ttfas")

    def __init__(self, index: int) -> None:
        self.index = index
        self.ratios = LogHistogram()
        self.gaps = LogHistogram()
        self.ttfas = LogHistogram()
        self.seams = 0
        self.stalled = 0

    def empty(self) -> bool:
        return not (self.ratios.count or self.gaps.count or self.ttfas.count or self.seams)


class ReplicaSignals:
    """The guard's inputs for one replica, over the last ``window_s`` seconds.

    ``observe`` takes one audio chunk's delivery ratio and gap; ``observe_gap`` a gap
    between gap-only events (ASR text, passthrough frames). Queries return None until the
    window holds ``min_samples`` samples of that kind. Time is expected to be monotonic;
    an older ``now`` is filed in the newest slice."""

    __slots__ = (
        "_closed",
        "_gaps",
        "_min",
        "_open",
        "_open_until",
        "_ratios",
        "_seams",
        "_slice_s",
        "_span",
        "_stalled",
        "_ttfas",
        "window_s",
    )

    def __init__(
        self, window_s: float = 30.0, *, slice_s: float = 1.0, min_samples: int = 20
    ) -> None:
        if not window_s > 0 or not slice_s > 0:
            raise ValueError("window_s and slice_s must be > 0")
        if min_samples < 1:
            raise ValueError("min_samples must be >= 1")
        self.window_s = window_s
        self._slice_s = slice_s
        self._span = math.ceil(window_s / slice_s)  # closed slices kept besides the open one
        self._min = min_samples
        self._open = _Slice(-(2**62))  # the slice being filled; replaced on first use
        self._open_until = -math.inf  # observations from here on go to a new slice
        self._closed: deque[_Slice] = deque()
        self._ratios = LogHistogram()  # running totals over the closed slices in the window
        self._gaps = LogHistogram()
        self._ttfas = LogHistogram()
        self._seams = 0
        self._stalled = 0

    def observe(self, now: float, ratio: float, gap: float) -> None:
        """One audio chunk: its delivery ratio and the gap since the previous chunk."""
        if now >= self._open_until:
            self._rotate(now)
        current = self._open
        current.ratios.add(ratio)
        current.gaps.add(gap)

    def observe_gap(self, now: float, gap: float) -> None:
        """One gap between gap-only events (no audio, so no ratio)."""
        if now >= self._open_until:
            self._rotate(now)
        self._open.gaps.add(gap)

    def observe_first_seam(self, now: float, stalled: bool) -> None:
        """A stream's second audio chunk arrived; ``stalled``: its modelled playback had
        run dry before it (a first-chunk underrun)."""
        if now >= self._open_until:
            self._rotate(now)
        self._open.seams += 1
        self._open.stalled += bool(stalled)

    def observe_ttfa(self, now: float, ttfa_s: float) -> None:
        """A session's time from admission to its first audio."""
        if now >= self._open_until:
            self._rotate(now)
        self._open.ttfas.add(ttfa_s)

    def startup(self, now: float) -> StartupSignals:
        """First seams, those that stalled, and TTFA p99 over the window (no minimum
        count: the guard applies its own)."""
        self._advance(now)
        current = self._open
        ttfas = LogHistogram()
        ttfas.merge(self._ttfas)
        ttfas.merge(current.ttfas)
        return StartupSignals(
            seams=self._seams + current.seams,
            stalled=self._stalled + current.stalled,
            ttfas=ttfas.count,
            ttfa_p99=ttfas.quantile(0.99),
        )

    def worst_ratio(self, now: float) -> float | None:
        """The 1st percentile of per-chunk delivery ratios in the window (the slow tail)."""
        self._advance(now)
        return self._quantile(self._ratios, self._open.ratios, 0.01)

    def p99_gap(self, now: float) -> float | None:
        """The 99th percentile of gaps in the window."""
        self._advance(now)
        return self._quantile(self._gaps, self._open.gaps, 0.99)

    def samples(self, now: float) -> int:
        """Delivery-ratio samples (audio chunks after a stream's first) in the window."""
        self._advance(now)
        return self._ratios.count + self._open.ratios.count

    def _quantile(self, closed: LogHistogram, current: LogHistogram, q: float) -> float | None:
        if closed.count + current.count < self._min:
            return None
        both = LogHistogram()
        both.merge(closed)
        both.merge(current)
        return both.quantile(q)

    def _advance(self, now: float) -> None:
        if now >= self._open_until:
            self._rotate(now)
        else:
            self._expire(math.floor(now / self._slice_s))

    def _rotate(self, now: float) -> None:
        """Close the open slice and open the one holding ``now``."""
        closing = self._open
        if not closing.empty():
            self._ratios.merge(closing.ratios)
            self._gaps.merge(closing.gaps)
            self._ttfas.merge(closing.ttfas)
            self._seams += closing.seams
            self._stalled += closing.stalled
            self._closed.append(closing)
        index = math.floor(now / self._slice_s)
        self._open = _Slice(index)
        self._open_until = (index + 1) * self._slice_s
        self._expire(index)

    def _expire(self, index: int) -> None:
        oldest = index - self._span
        closed = self._closed
        while closed and closed[0].index < oldest:
            gone = closed.popleft()
            self._ratios.subtract(gone.ratios)
            self._gaps.subtract(gone.gaps)
            self._ttfas.subtract(gone.ttfas)
            self._seams -= gone.seams
            self._stalled -= gone.stalled

    def __repr__(self) -> str:
        return (
            f"<ReplicaSignals window={self.window_s}s slices={len(self._closed) + 1} "
            f"ratios={self._ratios.count + self._open.ratios.count} "
            f"gaps={self._gaps.count + self._open.gaps.count}>"
        )
