"""A session's failover: each replica at most once, ejection only when asked for, and
failures that always have a name."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.clock import FakeClock
from proxy.process.serving import bind_socket
from proxy.relay.failover import Failover, Unreachable, describe, open_tcp, open_tcp_transport


def make_gate(replicas: int) -> Gate:
    core = PoolCore("tts", [ReplicaSpec(f"gpu{i}", 1) for i in range(replicas)], QueuePolicy())
    return Gate([core], clock=FakeClock())


def healthy(gate: Gate) -> dict[str, bool]:
    return {r.name: r.healthy for r in gate.statistics()["tts"].replicas}


def test_describe_names_an_exception_without_a_message() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(ConnectionResetError()) == "ConnectionResetError"
    assert describe(OSError("refused")) == "refused"


async def test_each_replica_is_tried_at_most_once_even_when_the_recheck_restores_it() -> None:
    gate = make_gate(2)
    lease = await gate.acquire("tts")
    assert lease.replica == "gpu0"
    failover = Failover(lease)
    assert await failover.next(eject=True)
    assert lease.replica == "gpu1"
    gate.set_healthy("tts", "gpu0", True)  # what the background re-check does
    assert not await failover.next(eject=True)  # gpu0 was tried: the session stops here
    assert gate.active == 1  # the lease still holds one slot until released
    lease.release()
    assert gate.active == 0


async def test_a_failure_that_is_not_the_replicas_does_not_eject() -> None:
    gate = make_gate(3)
    lease = await gate.acquire("tts")
    failover = Failover(lease)
    assert await failover.next(eject=False)
    assert await failover.next(eject=False)
    assert failover.tried == {"gpu0", "gpu1", "gpu2"}
    assert not await failover.next(eject=False)
    assert all(healthy(gate).values())
    stats = {r.name: r.active for r in gate.statistics()["tts"].replicas}
    assert sum(stats.values()) == 1  # one slot, wherever the walk ended
    lease.release()


async def test_an_unreachable_replica_is_ejected() -> None:
    gate = make_gate(2)
    lease = await gate.acquire("tts")
    assert await Failover(lease).next(eject=True)
    assert healthy(gate) == {"gpu0": False, "gpu1": True}
    lease.release()


async def test_open_tcp_connects_and_names_a_refusal() -> None:
    listening = bind_socket()
    port = listening.getsockname()[1]
    sock = await open_tcp("127.0.0.1", port, clock=FakeClock(), timeout=5)
    assert sock.getpeername()[1] == port
    sock.close()
    listening.close()  # now refused
    with pytest.raises(Unreachable) as info:
        await open_tcp("127.0.0.1", port, clock=FakeClock(), timeout=5)
    assert str(info.value)


class _Connected(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


async def test_open_tcp_transport_connects_and_names_a_refusal() -> None:
    """The event loop's own connect, with open_tcp's rules: the transport comes with
    the factory's protocol, already told of it; a refusal is Unreachable."""
    listening = bind_socket()
    port = listening.getsockname()[1]
    transport, protocol = await open_tcp_transport(
        "127.0.0.1", port, _Connected, clock=FakeClock(), timeout=5
    )
    assert protocol.transport is transport
    assert transport.get_extra_info("peername")[1] == port
    transport.abort()
    listening.close()  # now refused
    with pytest.raises(Unreachable) as info:
        await open_tcp_transport("127.0.0.1", port, _Connected, clock=FakeClock(), timeout=5)
    assert str(info.value)


@pytest.mark.parametrize("opener", ["open_tcp", "open_tcp_transport"])
async def test_the_connect_deadline_runs_on_the_injected_clock(opener: str) -> None:
    """A connect still pending when the clock reaches the deadline is Unreachable, with
    a message that names the timeout (the address resolution is held open here); the
    same for both ways of connecting."""
    clock = FakeClock()
    loop = asyncio.get_running_loop()
    resolving = asyncio.Event()
    never: asyncio.Future[None] = loop.create_future()

    async def slow_getaddrinfo(*_args: object, **_kwargs: object) -> list[object]:
        resolving.set()
        await never
        return []

    original = loop.getaddrinfo
    loop.getaddrinfo = slow_getaddrinfo  # type: ignore[method-assign,assignment]
    try:
        attempt: asyncio.Future[object] = asyncio.ensure_future(
            open_tcp("gpu.invalid", 80, clock=clock, timeout=5)
            if opener == "open_tcp"
            else open_tcp_transport("gpu.invalid", 80, _Connected, clock=clock, timeout=5)
        )
        await resolving.wait()
        clock.advance(4.9)
        await asyncio.sleep(0)
        assert not attempt.done()
        clock.advance(0.1)
        with pytest.raises(Unreachable, match=r"within 5 s \(TimeoutError\)"):
            await attempt
    finally:
        loop.getaddrinfo = original  # type: ignore[method-assign]


def test_open_tcp_resolves_the_address_once_on_uvloop() -> None:
    """The address is resolved once, for the host. uvloop's own sock_connect resolves
    it again with no socket type, which even for a numeric address takes libuv's
    thread pool: a thread round trip on every upstream connect."""
    uvloop = pytest.importorskip("uvloop")
    lookups: list[tuple[object, ...]] = []

    class CountingLoop(uvloop.Loop):  # type: ignore[misc,name-defined]
        async def getaddrinfo(self, *args: object, **kwargs: object) -> object:
            lookups.append((*args, *sorted(kwargs.items())))
            return await super().getaddrinfo(*args, **kwargs)

    async def connect() -> int:
        listening = bind_socket()
        try:
            port = int(listening.getsockname()[1])
            sock = await open_tcp("127.0.0.1", port, clock=FakeClock(), timeout=5)
            peer = int(sock.getpeername()[1])
            sock.close()
            assert peer == port
        finally:
            listening.close()
        return port

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        port = runner.run(connect())
    assert lookups == [("127.0.0.1", port, ("type", socket.SOCK_STREAM))]
