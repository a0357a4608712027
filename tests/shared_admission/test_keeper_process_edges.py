"""The keeper process's edges (proxy/admission/keeper_process.py): a proof covers only
the grants its renewal carried, a child that does not read its pipe costs the gateway
a bounded buffer, and a child that cannot start is retried with a back-off, logged once,
while the gate's fence stays the last resort."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.keeper_process import MAX_BACKOFF_S, KeeperConfig, ProcessKeeper
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import Clock, FakeClock, LoopClock
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="keeper process: Linux"
)

TTL, RENEW, MARGIN, CAP = 3.0, 0.5, 0.5, 4
CONFIG_URL = "redis://127.0.0.1:1/0"  # never reached by the tests without a server


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


def _gate(url: str, keeper: ProcessKeeper, clock: Clock) -> SharedGate:
    backend = RedisAdmission(url, gateway_id="gwk", lease_ttl_s=TTL, timeout_s=0.5)
    pool = SharedPoolSpec("tts", (ReplicaSpec("gpu0", CAP),), QueuePolicy(0, 1))
    return SharedGate([pool], backend=backend, clock=clock, lease_ttl_s=TTL,
                      renew_interval_s=RENEW, fence_margin_s=MARGIN, keeper=keeper)  # fmt: skip


def _config(url: str) -> KeeperConfig:
    return KeeperConfig(url, "headroom:", TTL, 0.5, RENEW, MARGIN)


async def _until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


class _Stopped:
    """The keeper's child stopped (SIGSTOP) inside the block, running again after it."""

    def __init__(self, pid: int | None) -> None:
        assert pid is not None
        self.pid = pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


async def test_a_proof_is_dated_no_later_than_the_grants_it_did_not_carry(
    tmp_path: Path,
) -> None:
    # A stand-in child: it takes its configuration, then reads and ignores the rest;
    # the test writes its proofs.
    config_out = tmp_path / "config.json"
    child = tmp_path / "child"
    child.write_text(f'#!/bin/sh\nIFS= read -r line\nprintf "%s\\n" "$line" > "{config_out}"\n'
                     "exec cat > /dev/null\n")  # fmt: skip
    child.chmod(child.stat().st_mode | stat.S_IXUSR)
    ticks = _Ticks()
    ticks.now = 100.0
    keeper = ProcessKeeper(_config(CONFIG_URL), python=str(child), monotonic=ticks)
    try:
        keeper.start()
        await _until(lambda: config_out.exists() and config_out.read_text().endswith("\n"),
                     "the stand-in's configuration")  # fmt: skip
        _, state_dir = KeeperConfig.from_json(config_out.read_text())
        state = Path(state_dir) / "kept.json"

        def prove(kept: float, carried: int) -> None:
            state.write_text(json.dumps({"tts": [kept, carried]}))

        prove(90.0, 0)
        assert keeper.kept_age("tts") == 10.0  # no grant since: the proof as it is
        keeper.hold("tts", "a")  # granted at 100
        ticks.now = 110.0
        prove(105.0, 0)  # renewed at 105, but without the grant's message
        assert keeper.kept_age("tts") == 10.0  # dated to the grant, not 5.0
        prove(107.0, 10**6)  # a renewal that carried it
        assert keeper.kept_age("tts") == 3.0
        ticks.now = 120.0
        keeper.hold("tts", "b")  # granted at 120, then proven by an older renewal
        ticks.now = 121.0
        assert keeper.kept_age("tts") == 14.0  # the older proof (107) is the earlier
        # Messages so far: the start's sync (1), a (2), b (3). Then 200 grants, c0..c199
        # (4..203), at 130..329, more than the keeper remembers one by one.
        for i in range(200):
            ticks.now = 130.0 + i
            keeper.hold("tts", f"c{i}")
        ticks.now = 400.0
        prove(300.0, 103)  # carried c0..c99, not c100 (granted at 230)
        age = keeper.kept_age("tts")
        assert age is not None and age >= 400.0 - 230.0
        prove(300.0, 203)  # carried them all
        assert keeper.kept_age("tts") == 100.0
    finally:
        await asyncio.to_thread(keeper.stop)


@pytest.mark.slow
async def test_a_stopped_child_costs_a_bounded_buffer_and_gets_a_snapshot(
    server: RedisServer,
) -> None:
    bound = 4096
    keeper = ProcessKeeper(_config(server.url), max_pending_bytes=bound)
    gate = _gate(server.url, keeper, LoopClock())
    keeper.start()
    try:
        first = await gate.acquire("tts")
        await gate.renew()
        await _until(lambda: keeper.kept_age("tts") is not None, "the child proves the lease")
        most = 0
        with _Stopped(keeper.pid):
            # Far more grants and releases than the pipe and the bound together hold.
            for i in range(20_000):
                keeper.hold("tts", f"gone-{i}")
                keeper.drop("tts", f"gone-{i}")
                most = max(most, keeper.pending_bytes)
            second = await gate.acquire("tts")
            most = max(most, keeper.pending_bytes)
            assert keeper.coalesced > 0
        assert most <= bound + 512
        # The gate's ticks write the rest (one every two intervals leaves the child
        # room to renew). The child ends with exactly the two real leases: a lease it
        # still held from the history would be found missing in Redis, and no renewal
        # would prove them.
        for _ in range(60):
            await gate.renew()
            await asyncio.sleep(2 * RENEW)
            if keeper.kept_age("tts") is not None:
                break
        assert keeper.kept_age("tts") is not None, "no proof after the snapshot"
        assert keeper.starts == 1
        first.release()
        second.release()
    finally:
        await gate.stop()


class _Ticks:
    """A monotonic clock for the back-off, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def errors(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    caplog.set_level(logging.DEBUG, "headroom.lease_keeper")

    def levels(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level]

    return lambda: levels(logging.ERROR)


def test_a_child_that_cannot_start_is_retried_with_a_back_off_and_logged_once(
    errors: Callable[[], list[str]],
) -> None:
    ticks = _Ticks()
    keeper = ProcessKeeper(_config(CONFIG_URL), python="/nonexistent/python", monotonic=ticks)
    try:
        keeper.start()
        assert keeper.failures == 1
        tried = [0.0]
        while ticks.now < 200:
            before = keeper.failures
            keeper.ticked("tts")
            if keeper.failures != before:
                tried.append(ticks.now)
            ticks.now = round(ticks.now + 0.25, 2)
        gaps = [b - a for a, b in itertools.pairwise(tried)]
        assert gaps[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
        assert max(gaps) == MAX_BACKOFF_S
        assert keeper.starts == 0
        assert keeper.kept_age("tts") is None
        assert len(errors()) == 1, errors()
    finally:
        keeper.stop()


async def test_a_child_that_exits_before_it_runs_backs_off_then_recovers(
    tmp_path: Path,
    errors: Callable[[], list[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    ready = tmp_path / "ready"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ -e "{ready}" ] && exec "{sys.executable}" "$@"\nexit 3\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    ticks = _Ticks()
    keeper = ProcessKeeper(_config(CONFIG_URL), python=str(python), monotonic=ticks)
    try:
        keeper.start()
        assert keeper.starts == 1
        await _until(lambda: (keeper.ticked("tts"), keeper.failures)[1] == 1, "the exit seen")
        for _ in range(20):  # no start before the back-off, however many ticks
            keeper.ticked("tts")
        assert keeper.starts == 1
        ticks.now += RENEW
        keeper.ticked("tts")
        assert keeper.starts == 2
        await _until(lambda: (keeper.ticked("tts"), keeper.failures)[1] == 2, "the exit seen")
        assert len(errors()) == 1, errors()
        ready.touch()
        ticks.now += 2 * RENEW
        keeper.ticked("tts")
        assert keeper.starts == 3
        await _until(lambda: (keeper.ticked("tts"), keeper.failures)[1] == 0, "the child runs")
        assert keeper.running()
        recovered = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("after 2 failed start(s)" in m for m in recovered), recovered
        assert len(errors()) == 1, errors()
    finally:
        await asyncio.to_thread(keeper.stop)


async def test_the_gate_fences_on_time_when_no_keeper_process_runs(
    server: RedisServer,
) -> None:
    clock = FakeClock()
    keeper = ProcessKeeper(_config(server.url), python="/nonexistent/python")
    gate = _gate(server.url, keeper, clock)
    fenced: list[str] = []
    gate.on_fence(lambda pool, why: fenced.append(why))
    keeper.start()
    try:
        lease = await gate.acquire("tts")
        await gate.renew()  # the loop's last tick; its keeper cannot start
        assert keeper.failures >= 1
        clock.advance(TTL - MARGIN - 0.01)
        assert fenced == []
        clock.advance(0.02)  # no proof from any keeper: the fence, before the TTL
        assert len(fenced) == 1 and "not renewed" in fenced[0]
        lease.release()
    finally:
        await gate.stop()
