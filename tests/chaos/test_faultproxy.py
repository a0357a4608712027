"""The fault-injecting TCP proxy of the soak (``bench/faultproxy.py``) does what it says:
each fault kind, against a real echo/stream server, asserting on bytes and closes (never
on durations)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from faultproxy import FaultPlan, FaultProxy  # bench/faultproxy.py

PAYLOAD = bytes(range(256)) * 256  # 64 KiB


class Upstream:
    """Per connection: sends PAYLOAD, then echoes what it reads until EOF; records what
    it saw and how each connection ended."""

    def __init__(self) -> None:
        self.connections = 0
        self.received = bytearray()
        self.ended: list[str] = []
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        how = "eof"
        try:
            writer.write(PAYLOAD)
            await writer.drain()
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            how = "reset"
        finally:
            self.ended.append(how)
            writer.close()
            self.done.set()


@contextlib.asynccontextmanager
async def chain(kind: str, **plan: Any) -> AsyncIterator[tuple[FaultProxy, Upstream]]:
    upstream = Upstream()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = FaultProxy(("127.0.0.1", port), FaultPlan({kind: 1.0}, **plan), seed=1)
    try:
        async with proxy:
            yield proxy, upstream
    finally:
        server.close()
        await server.wait_closed()


async def read_all(reader: asyncio.StreamReader, limit: int = 1 << 20) -> tuple[bytes, str]:
    data = bytearray()
    try:
        async with asyncio.timeout(30):
            while len(data) < limit and (chunk := await reader.read(65536)):
                data += chunk
    except (ConnectionError, OSError):
        return bytes(data), "reset"
    return bytes(data), "eof"


async def open_client(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


@pytest.mark.parametrize("kind", ["none", "latency", "slow_reader", "stall"])
async def test_data_faults_deliver_every_byte_in_order(kind: str) -> None:
    plan = {"stall_s": (0.05, 0.05), "latency_s": (0.001, 0.002),
            "slow_rate": (400_000, 400_000), "trigger_bytes": (1000, 1000)}  # fmt: skip
    async with chain(kind, **plan) as (proxy, up):
        reader, writer = await open_client(proxy)
        data = await reader.readexactly(len(PAYLOAD))
        assert data == PAYLOAD
        writer.write(b"ping")
        await writer.drain()
        assert await reader.readexactly(4) == b"ping"
        writer.write_eof()  # a half-close propagates: the upstream sees EOF and closes
        rest, how = await read_all(reader)
        writer.close()
        assert (rest, how) == (b"", "eof")
        await asyncio.wait_for(up.done.wait(), 30)
    assert up.ended == ["eof"]
    assert proxy.chosen[kind] == 1
    if kind != "none":
        assert proxy.triggered[kind] == 1


async def test_reset_cuts_both_sides_after_the_trigger() -> None:
    async with chain("reset", trigger_bytes=(10_000, 10_000)) as (proxy, up):
        reader, writer = await open_client(proxy)
        data, how = await read_all(reader)
        writer.close()
        await asyncio.wait_for(up.done.wait(), 30)
    assert how == "reset" and len(data) >= 10_000  # the trigger, rounded up to one read
    assert up.ended in (["reset"], ["eof"])
    assert proxy.triggered["reset"] == 1


async def test_refuse_resets_before_any_byte() -> None:
    async with chain("refuse") as (proxy, up):
        reader, writer = await open_client(proxy)
        data, how = await read_all(reader)
        writer.close()
    assert (data, how) == (b"", "reset")
    assert up.connections == 0


async def test_blackhole_answers_nothing_and_never_reaches_the_upstream() -> None:
    async with chain("blackhole") as (proxy, up):
        reader, writer = await open_client(proxy)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await writer.drain()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await reader.read(1)
        writer.close()  # leaving ends the connection
        await writer.wait_closed()
        async with asyncio.timeout(30):
            while proxy.open:  # noqa: ASYNC110 -- polling a counter of the proxy under test
                await asyncio.sleep(0.01)
    assert up.connections == 0
    assert proxy.triggered["blackhole"] == 1


async def test_half_open_drops_one_direction_but_a_close_still_propagates() -> None:
    async with chain("half_open", trigger_bytes=(0, 0)) as (proxy, up):
        reader, writer = await open_client(proxy)
        writer.write(b"hello")
        await writer.drain()
        writer.write_eof()
        data, how = await read_all(reader)
        writer.close()
        await asyncio.wait_for(up.done.wait(), 30)
    # downstream dropped: the client got nothing; upstream dropped: the upstream got nothing
    assert data == b"" or bytes(up.received) == b""
    assert how == "eof" and up.ended == ["eof"]


async def test_every_connection_ends_within_its_lifetime() -> None:
    async with chain("stall", stall_s=(60, 60), trigger_bytes=(0, 0),
                     max_lifetime_s=0.3) as (proxy, up):  # fmt: skip
        reader, writer = await open_client(proxy)
        _, how = await read_all(reader)
        writer.close()
        await asyncio.wait_for(up.done.wait(), 30)
    assert how == "reset" and proxy.expired == 1


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="unknown fault kinds"):
        FaultPlan({"meteor": 1.0})
    with pytest.raises(ValueError, match="not all zero"):
        FaultPlan({"none": 0.0})
