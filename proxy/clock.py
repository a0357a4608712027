"""Injectable clocks.

Everything that needs the time takes a :class:`Clock`. Production code uses
:class:`LoopClock` (the running asyncio loop's monotonic clock); tests use
:class:`FakeClock`, whose time only moves when the test calls
:meth:`FakeClock.advance`, so timeout tests never sleep.

A clock offers two things: ``now()`` (seconds, monotonic, arbitrary origin) and
``call_at(when, callback)`` returning a :class:`TimerHandle` that can be
cancelled. Callbacks run on the event loop thread (``FakeClock`` runs them
inside ``advance``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

__all__ = ["Clock", "FakeClock", "LoopClock", "TimerHandle", "clock_timeout"]


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...


class LoopClock:
    """The running event loop's monotonic clock (``loop.time()``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        #: ``now()`` is the loop's own bound ``time()`` once the loop is known: a call
        #: into the loop, no Python frame (it runs for every relayed chunk); until then
        #: a method that finds the running loop and puts its ``time`` here.
        self.now: Callable[[], float] = loop.time if loop is not None else self._first_now

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop given, or the running loop on first use (RuntimeError outside one)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _first_now(self) -> float:
        time = self.now = self.loop.time
        return time()

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        return self.loop.call_at(when, callback)

    def __repr__(self) -> str:
        return "<LoopClock>"


class _FakeTimer:
    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when told to. Timers fire inside :meth:`advance`, in
    deadline order, each seeing ``now()`` equal to its own deadline."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        timer = _FakeTimer(when, callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, firing every timer that falls due."""
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback()
        self._now = target

    @property
    def pending_timers(self) -> int:
        """Timers neither fired nor cancelled."""
        return sum(1 for _, _, t in self._timers if not t.cancelled)

    def __repr__(self) -> str:
        return f"<FakeClock now={self._now:.3f} timers={self.pending_timers}>"


class clock_timeout:
    """Like ``asyncio.timeout(seconds)`` but on ``clock``: raises TimeoutError if the
    block is still running when the clock reaches now + seconds.

    ``async with clock_timeout(clock, seconds): ...``. A small class rather than an
    ``asynccontextmanager`` generator: every WebSocket session enters two of these
    (the handshake deadline and the TCP connect), so they are on the session set-up
    path, where a generator's frame and its machinery cost more than two methods."""

    __slots__ = ("_clock", "_fired", "_handle", "_seconds", "_task")

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock = clock
        self._seconds = seconds
        self._fired = False
        self._task: asyncio.Task[object] | None = None
        self._handle: TimerHandle | None = None

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        clock = self._clock
        self._handle = clock.call_at(clock.now() + self._seconds, self._fire)

    def _fire(self) -> None:
        self._fired = True
        assert self._task is not None
        self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, handle = self._task, self._handle
        assert task is not None and handle is not None
        handle.cancel()
        self._task = self._handle = None
        if (
            exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
            and self._fired
            and task.uncancel() == 0
        ):
            raise TimeoutError from None
