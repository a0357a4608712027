"""Rolling per-replica signals: the worst-1% delivery ratio and the p99 gap of recent
chunks, and how recent streams started (stalls at their first seam, time to first audio).

Pure: no clock reads, no asyncio; every call takes ``now`` (monotonic seconds).

Quantiles come from log-bucket histograms (:class:`proxy.metering.sketches.LogHistogram`, whose
error bound its module states).

Rolling window (:class:`ReplicaSignals`): samples land in the open ``slice_s`` time slice
(1 s); a running total gets each slice added when it closes and subtracted when it falls
out of the window, so ``observe`` is O(1) (two list increments) and a query merges the
total with the open slice, one pass over their (few dozen) buckets. The window
is rounded up to whole slices, ``W = ceil(window_s / slice_s) * slice_s``: a sample
stays in it for between ``W`` and ``W + slice_s`` seconds (30 to 31 s by default).

Start-up signals (the guard's second and third inputs, :class:`StartupSignals`): each
stream's *first seam* -- its second audio chunk, where the listener's modelled playback
(:class:`proxy.metering.playback.PlaybackBuffer`) either still had audio or ran dry, the
``headroom_playback_first_chunk_underruns_total`` case -- and each session's time to
first audio, in the same slices and window as the ratios.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from proxy.metering.sketches import LogHistogram

__all__ = ["DELIVERY_THRESHOLD", "ReplicaSignals", "StartupSignals"]

#: The delivery ratio (audio seconds per wall second) of its worst hundredth of chunks
#: that a replica keeps to stay in placement (the guard's default) and a load level
#: keeps to count (the probe's and the simulator's ceiling): the margin above realtime
#: that listeners need.
DELIVERY_THRESHOLD: Final = 1.2


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
