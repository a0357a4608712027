""":func:`proxy.clock.clock_timeout` on a :class:`~proxy.clock.FakeClock`: the block is
cut with TimeoutError at its deadline, a cancellation from outside stays a
cancellation (even when the deadline fell due too), and the timer goes when the block
ends, however it ends."""

from __future__ import annotations

import asyncio

import pytest

from proxy.clock import FakeClock, LoopClock, clock_timeout


async def test_a_block_still_running_at_its_deadline_raises_timeout_error() -> None:
    clock = FakeClock()
    entered, never = asyncio.Event(), asyncio.Event()

    async def body() -> str:
        try:
            async with clock_timeout(clock, 5.0):
                entered.set()
                await never.wait()
        except TimeoutError:
            task = asyncio.current_task()
            assert task is not None
            return f"timeout, cancelling={task.cancelling()}"
        return "finished"

    task = asyncio.create_task(body())
    await entered.wait()
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(0.1)
    assert await task == "timeout, cancelling=0"
    assert clock.pending_timers == 0


async def test_a_block_ending_in_time_leaves_no_timer_and_no_cancellation() -> None:
    clock = FakeClock()
    async with clock_timeout(clock, 5.0):
        assert clock.pending_timers == 1
        await asyncio.sleep(0)
    assert clock.pending_timers == 0
    clock.advance(10.0)  # the deadline passes after the block: nothing happens
    await asyncio.sleep(0)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_an_error_in_the_block_propagates_and_the_timer_goes() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="boom"):
        async with clock_timeout(clock, 5.0):
            raise ValueError("boom")
    assert clock.pending_timers == 0


@pytest.mark.parametrize("deadline_due", [False, True])
async def test_a_cancellation_from_outside_stays_a_cancellation(deadline_due: bool) -> None:
    """Also when the deadline falls due at once after it: the timer cancels the task
    too, before it runs again, and the outside cancellation still wins."""
    clock = FakeClock()
    entered, never = asyncio.Event(), asyncio.Event()

    async def body() -> None:
        async with clock_timeout(clock, 5.0):
            entered.set()
            await never.wait()

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    if deadline_due:
        clock.advance(5.0)
    with pytest.raises(asyncio.CancelledError):
        await task
    if not deadline_due:
        assert clock.pending_timers == 0


async def test_nested_deadlines_each_raise_in_their_own_block() -> None:
    clock = FakeClock()
    entered, outer_only, never = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def body() -> str:
        async with clock_timeout(clock, 10.0):
            try:
                async with clock_timeout(clock, 2.0):
                    entered.set()
                    await never.wait()
            except TimeoutError:
                pass
            outer_only.set()
            await never.wait()
        return "finished"

    task = asyncio.create_task(body())
    await entered.wait()
    clock.advance(2.0)
    await outer_only.wait()  # the inner block's TimeoutError was caught inside
    assert not task.done()
    clock.advance(8.0)
    with pytest.raises(TimeoutError):
        await task
    assert clock.pending_timers == 0


async def test_on_the_loop_clock_a_short_deadline_cuts_a_long_sleep() -> None:
    with pytest.raises(TimeoutError):
        async with clock_timeout(LoopClock(), 0.01):
            await asyncio.sleep(3600)


async def test_loop_clock_reads_the_running_loops_time() -> None:
    """Made before the loop runs (as the runtime's is), the clock finds the running loop
    on first use; from then on now() is the loop's own time()."""
    loop = asyncio.get_running_loop()
    clock = LoopClock()
    before = loop.time()
    assert before <= clock.now() <= loop.time()
    assert clock.now == loop.time  # bound to the loop now: no Python frame per call
    assert clock.loop is loop
    given = LoopClock(loop)
    assert given.now == loop.time and given.now() <= loop.time()
