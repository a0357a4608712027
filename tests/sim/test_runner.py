"""The real-time step loop: delivery, gating, cancel, stop and crash (no sockets)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from proxy.sim.engine import Engine, Step
from proxy.sim.engine_runner import EngineStopped, Runner, SeqStream
from tests.sim.conftest import FAST_TTS

SPEC = replace(FAST_TTS.engine, jitter_p95=1.0)


async def spans(stream: SeqStream) -> list[tuple[int, int, bool]]:
    out = []
    while not stream.done:
        em = await asyncio.wait_for(stream.next(), 10)
        out.append((em.start, em.end, em.final))
    return out


async def test_streams_receive_their_chunks_in_order_then_final() -> None:
    steps: list[Step] = []
    runner = Runner(Engine(SPEC), on_step=steps.append)
    runner.start()
    try:
        a = runner.open(prompt_tokens=10, output_tokens=12, first_chunk_tokens=2, chunk_tokens=5)
        b = runner.open(prompt_tokens=10, output_tokens=3, first_chunk_tokens=2, chunk_tokens=5)
        spans_a = await spans(a)
        spans_b = await spans(b)
    finally:
        await runner.stop()
    assert spans_a == [(0, 2, False), (2, 7, False), (7, 12, True)]
    assert spans_b == [(0, 2, False), (2, 3, True)]
    assert runner.open_streams == 0
    assert steps[0].batch == 2  # both joined the same (first) step: continuous batching


async def test_gated_stream_waits_for_input() -> None:
    runner = Runner(Engine(SPEC))
    runner.start()
    try:
        stream = runner.open(
            prompt_tokens=5, output_tokens=None, first_chunk_tokens=3, chunk_tokens=3
        )
        stream.extend(3)
        first = await asyncio.wait_for(stream.next(), 10)
        assert (first.start, first.end, first.final) == (0, 3, False)
        assert runner.engine.stats().running == 1  # idle, but holding its slot
        stream.extend(1)
        stream.close_input()
        last = await asyncio.wait_for(stream.next(), 10)
        assert (last.start, last.end, last.final) == (3, 4, True)
        assert stream.done
    finally:
        await runner.stop()


async def test_cancel_leaves_the_engine() -> None:
    runner = Runner(Engine(SPEC))
    runner.start()
    try:
        stream = runner.open(
            prompt_tokens=5, output_tokens=500, first_chunk_tokens=2, chunk_tokens=2
        )
        await stream.next()
        stream.cancel()
        stream.cancel()
        assert runner.engine.stats().running == 0
        assert runner.open_streams == 0
    finally:
        await runner.stop()


async def test_stop_wakes_every_open_stream() -> None:
    runner = Runner(Engine(SPEC))
    runner.start()
    stream = runner.open(prompt_tokens=5, output_tokens=None, first_chunk_tokens=2, chunk_tokens=2)
    await runner.stop()
    with pytest.raises(EngineStopped):
        await stream.next()
    with pytest.raises(EngineStopped):
        runner.open(prompt_tokens=5, output_tokens=5, first_chunk_tokens=2, chunk_tokens=2)


async def test_a_crashed_step_loop_ends_streams_instead_of_hanging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def explode(step: Step) -> None:
        raise RuntimeError("boom")

    runner = Runner(Engine(SPEC), on_step=explode)
    runner.start()
    stream = runner.open(prompt_tokens=5, output_tokens=5, first_chunk_tokens=2, chunk_tokens=2)
    with caplog.at_level(logging.ERROR, logger="proxy.sim"), pytest.raises(EngineStopped):
        await stream.next()
    await runner.stop()
    assert "step loop failed" in caplog.text
