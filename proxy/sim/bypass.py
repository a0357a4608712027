"""Streams that reach a simulated GPU without passing any gateway.

In a sidecar deployment the engine's port often stays reachable: a batch job, a health
checker that synthesises, a client that was never repointed. :class:`BypassStreams`
runs ``N`` such streams inside one simulated GPU: each submits an utterance of
``audio_s`` seconds of audio (default 600: a long batch job, so the count of requests in
the engine stays put), reads it to its end and at once submits the next, so the
engine's ``vllm:num_requests_running`` carries them like any other request and they
slow the batch like any other. Setting the count lower ends the extra streams at once
(their sequences leave the engine); 0 ends them all.

``POST /sim/bypass[?gpu=N] {"streams": K[, "audio_s": S]}`` sets the count (and the
length of the utterances started from then on), ``GET`` reads it, ``DELETE`` sets it to
0 (:mod:`proxy.sim.gpu_app`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from proxy.sim.engine_runner import EngineStopped, SeqStream
from proxy.sim.presets import TEXT_TOKENS_PER_AUDIO_S

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["DEFAULT_AUDIO_S", "MAX_AUDIO_S", "MAX_BYPASS_STREAMS", "BypassStreams"]

#: The most bypass streams one simulated GPU runs (a bound on the admin input).
MAX_BYPASS_STREAMS = 1024
#: Seconds of audio in each bypass utterance, by default and at most.
DEFAULT_AUDIO_S = 600.0
MAX_AUDIO_S = 3600.0


class BypassStreams:
    """Closed-loop streams on one simulated GPU that no gateway admitted."""

    def __init__(self, gpu: SimGpu) -> None:
        self._gpu = gpu
        self._tasks: list[asyncio.Task[None]] = []
        #: Each running task's sequence, so an ended stream leaves the engine at once.
        self._streams: dict[asyncio.Task[None], SeqStream] = {}
        self.audio_s = DEFAULT_AUDIO_S

    @property
    def count(self) -> int:
        """Bypass streams running now."""
        return len(self._tasks)

    def set_count(self, streams: int, audio_s: float | None = None) -> int:
        """Run ``streams`` bypass streams: start the missing ones, end the extra ones
        (newest first, at once); ``audio_s`` sets the length of the utterances started
        from now on. Returns the count."""
        if not 0 <= streams <= MAX_BYPASS_STREAMS:
            raise ValueError(f"streams must be 0..{MAX_BYPASS_STREAMS}, got {streams}")
        if audio_s is not None:
            if not 0 < audio_s <= MAX_AUDIO_S:
                raise ValueError(f"audio_s must be in (0, {MAX_AUDIO_S:g}], got {audio_s}")
            self.audio_s = float(audio_s)
        while len(self._tasks) > streams:
            task = self._tasks.pop()
            task.cancel()
            stream = self._streams.pop(task, None)
            if stream is not None:
                stream.cancel()
        while len(self._tasks) < streams:
            n = len(self._tasks)
            task = asyncio.get_running_loop().create_task(
                self._stream(), name=f"sim-gpu{self._gpu.index}-bypass{n}"
            )
            self._tasks.append(task)
        return len(self._tasks)

    async def stop(self) -> None:
        """End every bypass stream and wait for them to leave the engine."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        self._streams.clear()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, EngineStopped):
                await task

    async def _stream(self) -> None:
        preset = self._gpu.preset
        rate = preset.token_rate_hz
        task = asyncio.current_task()
        assert task is not None
        while True:
            audio_s = self.audio_s
            text = 0 if preset.kind == "asr" else round(audio_s * TEXT_TOKENS_PER_AUDIO_S)
            stream = self._gpu.open_stream(
                prompt_tokens=preset.prompt_overhead_tokens + text,
                output_tokens=max(1, round(audio_s * rate)),
            )
            self._streams[task] = stream
            try:
                while not (await stream.next()).final:
                    pass
            except EngineStopped:
                return
            finally:
                stream.cancel()
                self._streams.pop(task, None)
