"""Drive one :class:`~proxy.sim.engine.Engine` in real time: one asyncio task per GPU.

The task steps the engine, sleeps until the step's end, then hands each emission to
the stream it belongs to (an ``asyncio.Queue`` per open stream: O(1) per chunk, no
per-stream tasks, no per-token work). When the engine has nothing to do the task
waits on an event that :meth:`Runner.open`, :meth:`SeqStream.extend` and
:meth:`SeqStream.close_input` set.

If the event loop wakes late (a loaded host), the next step starts at the previous
step's nominal end as long as the lag is under ``max_lag_s``, so the simulated GPU
keeps its speed instead of silently slowing with the host.

Contract: a :class:`SeqStream` yields :class:`~proxy.sim.engine.Emission` values until
one with ``final=True``; :meth:`SeqStream.next` raises :class:`EngineStopped` if the
runner stops first. Whoever opens a stream must :meth:`SeqStream.cancel` it when done
(idempotent; a finished stream is already gone from the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable

from proxy.sim.chunks import ChunkSchedule
from proxy.sim.engine import Emission, Engine, Step

__all__ = ["EngineStopped", "Runner", "SeqStream"]

log = logging.getLogger("proxy.sim")


class EngineStopped(Exception):
    """The simulated GPU shut down while a stream was open."""


_STOP = object()


class SeqStream:
    """One engine sequence as seen by a protocol handler."""

    __slots__ = ("_queue", "_runner", "done", "seq_id")

    def __init__(self, runner: Runner, seq_id: int) -> None:
        self._runner = runner
        self.seq_id = seq_id
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.done = False

    async def next(self) -> Emission:
        """The next chunk; raises :class:`EngineStopped` if the GPU shut down."""
        item = await self._queue.get()
        if item is _STOP:
            self._queue.put_nowait(_STOP)
            raise EngineStopped("the simulated GPU is shutting down")
        assert isinstance(item, Emission)
        if item.final:
            self.done = True
        return item

    def extend(self, tokens: int) -> None:
        """Release ``tokens`` more tokens of a gated stream (its input grew)."""
        if tokens > 0 and not self.done:
            self._runner.engine.extend_input(self.seq_id, tokens)
            self._runner.wake()

    def close_input(self) -> None:
        if not self.done:
            self._runner.engine.close_input(self.seq_id)
            self._runner.wake()

    def cancel(self) -> None:
        """Leave the engine (client gone or stream abandoned). Idempotent."""
        self._runner.forget(self.seq_id)

    def _deliver(self, item: object) -> None:
        self._queue.put_nowait(item)


class Runner:
    """The step loop of one simulated GPU."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_step: Callable[[Step], None] | None = None,
        max_lag_s: float = 0.1,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._max_lag_s = max_lag_s
        self._streams: dict[int, SeqStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._timer_keys = itertools.count()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def start(self, name: str = "sim-gpu") -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)
            self._task.add_done_callback(self._on_exit)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        # A crashed step loop must not leave streams waiting forever.
        if not task.cancelled() and task.exception() is not None:
            log.error("simulated GPU step loop failed", exc_info=task.exception())
            self._stopped = True
            for stream in list(self._streams.values()):
                stream._deliver(_STOP)
            self._streams.clear()

    async def stop(self) -> None:
        """Stop stepping; every open stream's :meth:`SeqStream.next` raises."""
        self._stopped = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for stream in list(self._streams.values()):
            stream._deliver(_STOP)
        self._streams.clear()
        if self._task is not None:
            self._task.cancel()
            # A crash was already logged by _on_exit; stopping must not raise it again.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def open(
        self,
        *,
        prompt_tokens: int,
        output_tokens: int | None,
        first_chunk_tokens: int = 0,
        chunk_tokens: int = 0,
        schedule: ChunkSchedule | None = None,
    ) -> SeqStream:
        """Submit a sequence now (see :meth:`Engine.submit`); ``ValueError`` if it can
        never fit, :class:`EngineStopped` after :meth:`stop`."""
        if self._stopped:
            raise EngineStopped("the simulated GPU is shutting down")
        loop = asyncio.get_running_loop()
        seq_id = self.engine.submit(
            now=loop.time(),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            first_chunk_tokens=first_chunk_tokens,
            chunk_tokens=chunk_tokens,
            schedule=schedule,
        )
        stream = SeqStream(self, seq_id)
        self._streams[seq_id] = stream
        self.wake()
        return stream

    def forget(self, seq_id: int) -> None:
        self._streams.pop(seq_id, None)
        self.engine.cancel(seq_id)

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        next_start = loop.time()
        while True:
            if not engine.has_work():
                self._publish(engine.drain_codec())
                self._wake.clear()
                await self._wake.wait()
                next_start = loop.time()
                continue
            start = max(next_start, loop.time() - self._max_lag_s)
            step = engine.step(start)
            if self._on_step is not None:
                self._on_step(step)
            delay = step.ends_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            next_start = step.ends_at
            self._publish(step.emissions)

    def _publish(self, emissions: Iterable[Emission]) -> None:
        """Hand each emission to its stream at its ``at`` (now if that has passed; a
        codec stage makes chunks visible after the step that made them)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for em in emissions:
            if em.at <= now:
                self._deliver(em)
            else:
                key = next(self._timer_keys)
                self._timers[key] = loop.call_at(em.at, self._deliver_later, key, em)

    def _deliver_later(self, key: int, em: Emission) -> None:
        self._timers.pop(key, None)
        self._deliver(em)

    def _deliver(self, em: Emission) -> None:
        stream = self._streams.get(em.seq_id)
        if stream is not None:
            stream._deliver(em)
            if em.final:
                del self._streams[em.seq_id]

    def __repr__(self) -> str:
        return f"<Runner streams={len(self._streams)} {self.engine!r}>"
