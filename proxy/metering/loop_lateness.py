"""How late the event loop runs: a metric from the loop, a log line from a thread.

Everything a gateway does for its sessions -- relaying frames, admitting, renewing
leases from the loop -- waits while the event loop is blocked. :class:`LoopWatch`
measures it two ways:

* on the loop, a callback scheduled every ``interval_s`` observes how late it ran in
  ``headroom_event_loop_lag_seconds`` (a histogram: the slow tail is what matters);
* on a daemon thread, which does not need the loop, a stall that has lasted
  ``stall_s`` is logged at WARNING while it lasts and counted in
  ``headroom_event_loop_stalls_total``, and its end is logged with its length.

The lease keeper (:mod:`proxy.admission.lease_keeper`) keeps the admission leases alive
meanwhile; this module only tells the operator.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["LAG_BUCKETS", "LoopWatch"]

log = logging.getLogger("headroom.loop")

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
               30.0)  # fmt: skip


class LoopWatch:
    """Watches one event loop; :meth:`start` on the loop, :meth:`stop` when done."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        *,
        interval_s: float = 0.25,
        stall_s: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or stall_s <= 0:
            raise ValueError("interval_s and stall_s must be > 0")
        self.interval_s = interval_s
        self.stall_s = stall_s
        self._monotonic = monotonic
        self.lag_histogram: Histogram | None = None
        self.stall_counter: Counter | None = None
        if registry is not None:
            self.lag_histogram = Histogram(
                "headroom_event_loop_lag_seconds",
                "How late a callback scheduled on the event loop ran (every session's "
                "frames wait this long)",
                buckets=LAG_BUCKETS,
                registry=registry,
            )
            self.stall_counter = Counter(
                "headroom_event_loop_stalls_total",
                "Times the event loop was blocked for longer than the stall threshold",
                registry=registry,
            )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        #: When the loop-side callback last ran (``monotonic``): the next is due
        #: ``interval_s`` later.
        self._beat = monotonic()
        self._stalled_since: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.stalls = 0

    def start(self) -> None:
        """Start both sides; call it from the running loop."""
        self._loop = asyncio.get_running_loop()
        self._beat = self._monotonic()
        self._handle = self._loop.call_later(self.interval_s, self.beat)
        self._thread = threading.Thread(target=self._run, name="headroom-loop-watch",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def beat(self) -> None:
        """The loop-side callback: observe its own lateness, schedule the next one."""
        now = self._monotonic()
        if self.lag_histogram is not None:
            self.lag_histogram.observe(max(0.0, now - self._beat - self.interval_s))
        self._beat = now
        if self._loop is not None and not self._stopping.is_set():
            self._handle = self._loop.call_later(self.interval_s, self.beat)

    def check(self) -> None:
        """The thread's look at the loop: log a stall that has lasted ``stall_s`` (once
        per stall), and its end."""
        silent = self._monotonic() - self._beat - self.interval_s
        if silent >= self.stall_s:
            if self._stalled_since is None:
                self._stalled_since = self._beat + self.interval_s
                self.stalls += 1
                if self.stall_counter is not None:
                    self.stall_counter.inc()
                log.warning("event loop blocked for %.1f s so far: no frame is relayed and "
                            "nothing is admitted until it runs again", silent)  # fmt: skip
        elif self._stalled_since is not None:
            length = self._beat - self._stalled_since
            self._stalled_since = None
            log.warning("event loop ran again after a stall of %.1f s", length)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self.check()

    def stop(self) -> None:
        """Stop both sides without waiting: the thread ends within ``interval_s``."""
        self._stopping.set()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._thread = None

    def __repr__(self) -> str:
        return f"<LoopWatch stalls={self.stalls} stalled={self._stalled_since is not None}>"
