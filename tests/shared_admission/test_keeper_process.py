"""The lease keeper process keeps a frozen gateway's leases and hands back a dead one's
(proxy/admission/keeper_process.py).

Gateway A is a process of its own (tests/shared_admission/keeper_gateway.py) holding
every slot of a replica on a real redis-server; gateway B, in this process, asks for a
slot every few milliseconds throughout. A's sessions run as long as A lives, so every
slot B is granted while A lives is a stream over the cap. Through a GIL-holding stall
and a SIGSTOP of two TTLs B gets nothing and A cuts no session; the thread keeper,
frozen with the interpreter, lets B in (the control). After kill -9 of A, B gets the
slots back before A's leases would have lapsed: the keeper hands them back after
``fence_margin_s``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.keeper_process import KeeperConfig, ProcessKeeper
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.redis_clients import SentinelNodes
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock
from proxy.errors import Refused
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="keeper process: Linux"),
]

TTL, RENEW, MARGIN, CAP = 3.0, 0.5, 0.5, 2
ROOT = Path(__file__).resolve().parents[2]
LEASES = "headroom:{tts}:leases"


@pytest.fixture
async def server() -> AsyncIterator[RedisServer]:
    s = RedisServer()
    await seed_generation(s.url)
    yield s
    s.stop()


@dataclass
class GatewayA:
    process: asyncio.subprocess.Process
    keeper_pid: int

    async def line(self) -> str:
        assert self.process.stdout is not None
        raw = await asyncio.wait_for(self.process.stdout.readline(), 60)
        assert raw, "gateway A ended"
        return raw.decode().strip()

    async def command(self, text: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()
        return await self.line()


@contextlib.asynccontextmanager
async def gateway_a(url: str, keeper: str) -> AsyncIterator[GatewayA]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.shared_admission.keeper_gateway", url, str(CAP), str(TTL),
        str(RENEW), str(MARGIN), keeper, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    a = GatewayA(process, 0)
    try:
        ready = (await a.line()).split()
        assert ready[0] == "ready", ready
        a.keeper_pid = int(ready[1])
        yield a
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
            assert process.stdin is not None
            with contextlib.suppress(ConnectionError):
                process.stdin.write(b"exit\n")
                await process.stdin.drain()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        await _gone(a.keeper_pid)


async def _gone(pid: int) -> None:
    """Wait for the keeper child (started by A) to exit; kill it if it does not."""
    if not pid:
        return
    for _ in range(600):
        if not _alive(pid):
            return
        await asyncio.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"keeper process {pid} outlived its gateway")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


@dataclass
class Load:
    """Gateway B asking for a slot without queueing, every ``every_s``."""

    gate: SharedGate
    client: aioredis.Redis
    every_s: float = 0.02
    attempts: int = 0
    grants: list[float] = field(default_factory=list)  # Redis time (ms) after each grant
    refusals: set[str] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.attempts += 1
            try:
                lease = await self.gate.acquire("tts")
            except Refused as exc:
                self.refusals.add(exc.reason)
            else:
                now_s, now_us = await self.client.time()
                self.grants.append(int(now_s) * 1000 + int(now_us) / 1000)
                lease.release()
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        """Start asking (after A holds every slot)."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        # Cancelled until it has ended, not once: on Python 3.11 a cancel that lands as
        # redis-py sends a command is lost (CPython gh-86296) and the loop asks on.
        for _ in range(100):
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=0.1)
            if self._task.done():
                break
        else:
            raise AssertionError("gateway B's load loop did not end within 100 cancels")
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await asyncio.wait_for(self.gate.quiesce(), 30)
        assert self.refusals <= {"pool_full"}, self.refusals


@pytest.fixture
async def load(server: RedisServer) -> AsyncIterator[Load]:
    backend = RedisAdmission(server.url, gateway_id="gwb", lease_ttl_s=TTL, timeout_s=0.5)
    pool = SharedPoolSpec("tts", (ReplicaSpec("gpu0", CAP),), QueuePolicy(0, 1))
    gate = SharedGate([pool], backend=backend, clock=LoopClock(), lease_ttl_s=TTL,
                      renew_interval_s=RENEW, fence_margin_s=MARGIN)  # fmt: skip
    client = aioredis.from_url(server.url)
    b = Load(gate, client)
    yield b
    if b._task is not None and not b._task.done():
        await b.stop()
    await gate.stop()
    await client.aclose()


async def _a_expiries(url: str, gateway: str = "gwa:") -> list[float]:
    client = aioredis.from_url(url)
    try:
        scores = await client.zrange(LEASES, 0, -1, withscores=True)
        return [score for member, score in scores if member.startswith(gateway.encode())]
    finally:
        await client.aclose()


@pytest.mark.parametrize("keeper", ["process", "thread"])
async def test_a_gil_holding_stall_of_two_ttls(
    server: RedisServer, load: Load, keeper: str
) -> None:
    async with gateway_a(server.url, keeper) as a:
        load.start()
        stalled = float((await a.command(f"gil {int(2 * TTL)}")).split()[1])
        assert stalled >= 2 * TTL
        fenced = int((await a.command("check")).split()[1])
        await load.stop()
        print(f"\n{keeper}: stall {stalled:.1f} s, {load.attempts} attempts by B, "
              f"{len(load.grants)} granted over the cap, {fenced} fence(s) in A")  # fmt: skip
        if keeper == "process":
            assert load.grants == []
            assert fenced == 0
        else:  # the control: the thread froze with the interpreter
            assert load.grants, "the stall did not hold the GIL"


async def test_sigstop_of_two_ttls(server: RedisServer, load: Load) -> None:
    async with gateway_a(server.url, "process") as a:
        load.start()
        a.process.send_signal(signal.SIGSTOP)
        await asyncio.sleep(2 * TTL)  # the stall under test, while B asks
        a.process.send_signal(signal.SIGCONT)
        fenced = int((await a.command("check")).split()[1])
        await load.stop()
        print(f"\nSIGSTOP {2 * TTL:.0f} s: {load.attempts} attempts by B, "
              f"{len(load.grants)} granted over the cap, {fenced} fence(s) in A")  # fmt: skip
        assert load.grants == []
        assert fenced == 0


async def test_kill_9_hands_the_slots_back_before_the_leases_lapse(
    server: RedisServer, load: Load
) -> None:
    async with gateway_a(server.url, "process") as a:
        load.start()
        await asyncio.sleep(RENEW)  # B asks a few times while A lives
        expiries = await _a_expiries(server.url)
        assert len(expiries) == CAP
        client = aioredis.from_url(server.url)
        now_s, now_us = await client.time()
        killed_ms = int(now_s) * 1000 + int(now_us) / 1000
        await client.aclose()
        assert load.grants == []  # A alive: nothing for B
        a.process.kill()
        await a.process.wait()
        for _ in range(3000):
            if load.grants:
                break
            await asyncio.sleep(0.01)
        await load.stop()
        assert load.grants, "the slots never came back"
        back_ms = load.grants[0]
        print(f"\nkill -9: slots back {back_ms - killed_ms:.0f} ms after the kill; A's leases "
              f"would have lapsed {min(expiries) - killed_ms:.0f} ms after it")  # fmt: skip
        assert back_ms < min(expiries)
        await _gone(a.keeper_pid)  # it handed them back and exited


def _gate_with_keeper(url: str) -> tuple[SharedGate, ProcessKeeper]:
    keeper = ProcessKeeper(KeeperConfig(url, "headroom:", TTL, 0.5, RENEW, MARGIN))
    backend = RedisAdmission(url, gateway_id="gwk", lease_ttl_s=TTL, timeout_s=0.5)
    pool = SharedPoolSpec("tts", (ReplicaSpec("gpu0", CAP),), QueuePolicy(0, 1))
    gate = SharedGate([pool], backend=backend, clock=LoopClock(), lease_ttl_s=TTL,
                      renew_interval_s=RENEW, fence_margin_s=MARGIN, keeper=keeper)  # fmt: skip
    return gate, keeper


async def _until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(3000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_a_keeper_process_that_dies_is_started_again_with_its_leases(
    server: RedisServer,
) -> None:
    gate, keeper = _gate_with_keeper(server.url)
    keeper.start()  # the loop's ticks are run by hand: no renew loop
    try:
        lease = await gate.acquire("tts")
        await gate.renew()
        await _until(keeper.running, "the keeper process runs")
        first = keeper.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        for _ in range(3000):  # the first tick after it has exited starts another
            await gate.renew()
            if keeper.starts == 2:
                break
            await asyncio.sleep(0.01)
        assert keeper.starts == 2 and keeper.pid != first
        # The new child was told of the lease and its generation: with no tick since,
        # it renews the pool and proves it.
        await _until(lambda: keeper.kept_age("tts") is not None, "a proof by the new child")
        lease.release()
    finally:
        await gate.stop()


async def test_a_stopped_keeper_hands_nothing_back(server: RedisServer) -> None:
    gate, keeper = _gate_with_keeper(server.url)
    keeper.start()
    try:
        lease = await gate.acquire("tts")
        await gate.renew()
        await _until(keeper.running, "the keeper process runs")
        pid = keeper.pid
        assert pid is not None
        await asyncio.to_thread(keeper.stop)
        await _gone(pid)
        assert keeper.kept_age("tts") is None  # its state is removed with it
        # The gateway still runs this session: its lease is still held in Redis.
        assert len(await _a_expiries(server.url, "gwk:")) == 1
        lease.release()
    finally:
        await gate.stop()


def test_the_keeper_configuration_crosses_the_pipe_whole() -> None:
    sentinel = SentinelNodes("primary", (("10.0.0.1", 26379), ("::1", 26380)), "s3cret")
    config = KeeperConfig("redis://h:1/2", "hr:", 10.0, 1.0, 2.0, 1.0, sentinel)
    assert KeeperConfig.from_json(config.to_json("/tmp/x")) == (config, "/tmp/x")
    with pytest.raises(ValueError, match="interval_s"):
        KeeperConfig("redis://h", "hr:", 10.0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="fence_margin_s"):
        KeeperConfig("redis://h", "hr:", 10.0, 1.0, 2.0, -1.0)
