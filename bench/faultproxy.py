"""A fault-injecting TCP proxy for the chaos soak: it sits between Headroom and a
simulated GPU and misbehaves on purpose, one fault per connection.

    python bench/faultproxy.py --target 127.0.0.1:8001 --port 9001 --seed 1
    python bench/faultproxy.py --target 127.0.0.1:8001 --weights reset=1,none=3

Each accepted connection draws one fault from :class:`FaultPlan` (seeded):

============  ===============================================================================
kind          what the connection does
============  ===============================================================================
none          forwards both ways untouched
latency       every chunk, both ways, is held back ``latency_s`` before it is forwarded
stall         after ``trigger`` bytes upstream -> client, that direction stops for ``stall_s``
              (nothing read: the upstream sees back-pressure), then resumes
reset         after ``trigger`` bytes upstream -> client, both sides are reset (SO_LINGER 0:
              RST, no FIN) -- a connection cut mid-stream
half_open     after ``trigger`` bytes upstream -> client, one direction (drawn) stops
              forwarding: bytes are read and dropped, but a close still propagates
slow_reader   the upstream is read slowly (``slow_rate`` bytes/s in small reads): the
              upstream's sends block, as behind a slow network
refuse        the connection is reset as soon as it is accepted (before any byte)
blackhole     accepted, never answered: client bytes are read and dropped until it leaves
============  ===============================================================================

A close from either side always propagates (half-close with FIN, or RST after a reset),
even during a stall or a half-open fault, so an orphaned upstream connection lives at
most until its fault ends; every connection also has a hard lifetime
(``max_lifetime_s``) after which both sides are reset. The plan can be replaced while
running (:attr:`FaultProxy.plan`); it applies to new connections. Counts per kind:
:attr:`FaultProxy.chosen` (drawn) and :attr:`FaultProxy.triggered` (took effect).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import socket
import struct
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["FAULT_KINDS", "ConnectionFault", "FaultPlan", "FaultProxy", "reset_writer"]

FAULT_KINDS = (
    "none",
    "latency",
    "stall",
    "reset",
    "half_open",
    "slow_reader",
    "refuse",
    "blackhole",
)
_READ = 65536
_SLOW_READ = 4096
_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Weights of each fault kind (any subset of :data:`FAULT_KINDS`) and the ranges
    their parameters are drawn from."""

    weights: Mapping[str, float] = field(default_factory=lambda: {"none": 1.0})
    latency_s: tuple[float, float] = (0.01, 0.12)
    stall_s: tuple[float, float] = (0.3, 2.5)
    trigger_bytes: tuple[int, int] = (0, 48_000)
    slow_rate: tuple[int, int] = (12_000, 64_000)
    max_lifetime_s: float = 60.0

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds: {', '.join(sorted(unknown))}")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError("fault weights must be >= 0 and not all zero")

    @classmethod
    def clean(cls) -> FaultPlan:
        return cls({"none": 1.0})

    def draw(self, rng: random.Random) -> ConnectionFault:
        kinds = [k for k in FAULT_KINDS if self.weights.get(k, 0) > 0]
        kind = rng.choices(kinds, [self.weights[k] for k in kinds])[0]
        return ConnectionFault(
            kind=kind,
            latency_s=rng.uniform(*self.latency_s),
            stall_s=rng.uniform(*self.stall_s),
            trigger=rng.randint(*self.trigger_bytes),
            slow_rate=rng.randint(*self.slow_rate),
            half_open_down=rng.random() < 0.5,
            max_lifetime_s=self.max_lifetime_s,
        )


@dataclass(frozen=True, slots=True)
class ConnectionFault:
    """The fault one connection runs under (drawn from a :class:`FaultPlan`)."""

    kind: str
    latency_s: float = 0.0
    stall_s: float = 0.0
    trigger: int = 0
    slow_rate: int = 65536
    half_open_down: bool = True  # half_open: stop upstream -> client (else client -> upstream)
    max_lifetime_s: float = 60.0


def reset_writer(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), not FIN; safe on a transport already closing."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


class _Reset(Exception):
    """The fault resets the connection now."""


class _Link:
    """One proxied connection: two pumps and the fault between them."""

    def __init__(
        self,
        owner: FaultProxy,
        fault: ConnectionFault,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.owner = owner
        self.fault = fault
        self.client_r, self.client_w = client
        self.up_r, self.up_w = upstream
        self.down_bytes = 0  # upstream -> client, forwarded
        self.triggered = False

    def _trigger_due(self) -> bool:
        return not self.triggered and self.down_bytes >= self.fault.trigger

    def _mark(self) -> None:
        if not self.triggered:
            self.triggered = True
            self.owner.triggered[self.fault.kind] += 1

    async def _up(self) -> None:
        """Client -> upstream."""
        f = self.fault
        dropping = False
        while True:
            data = await self.client_r.read(_READ)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.up_w.can_write_eof():
                        self.up_w.write_eof()
                return
            if f.kind == "half_open" and not f.half_open_down and self.triggered:
                dropping = True
            if dropping:
                continue
            if f.kind == "latency":
                self._mark()
                await asyncio.sleep(f.latency_s)
            self.up_w.write(data)
            await self.up_w.drain()

    async def _down(self) -> None:
        """Upstream -> client."""
        f = self.fault
        while True:
            if f.kind in ("stall", "reset", "half_open") and self._trigger_due():
                self._mark()
                if f.kind == "reset":
                    raise _Reset
                if f.kind == "stall":
                    await asyncio.sleep(f.stall_s)
            size = _SLOW_READ if f.kind == "slow_reader" else _READ
            data = await self.up_r.read(size)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.client_w.can_write_eof():
                        self.client_w.write_eof()
                return
            if f.kind == "half_open" and f.half_open_down and self.triggered:
                continue  # read and dropped: the close still gets through
            if f.kind == "latency":
                self._mark()
                await asyncio.sleep(f.latency_s)
            if f.kind == "slow_reader":
                self._mark()
                await asyncio.sleep(len(data) / f.slow_rate)
            self.client_w.write(data)
            self.down_bytes += len(data)
            await self.client_w.drain()

    async def run(self) -> None:
        up = asyncio.ensure_future(self._up())
        down = asyncio.ensure_future(self._down())
        pending: set[asyncio.Future[None]] = {up, down}
        reset = False
        try:
            async with asyncio.timeout(self.fault.max_lifetime_s):
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task.exception() is not None:
                            # a reset (injected or by a peer): both sides go at once
                            reset = True
                            pending_copy = set(pending)
                            pending = set()
                            for other in pending_copy:
                                other.cancel()
                            await asyncio.gather(*pending_copy, return_exceptions=True)
                            break
        except TimeoutError:
            reset = True
            self.owner.expired += 1
        finally:
            for task in (up, down):
                if not task.done():
                    task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            for writer in (self.client_w, self.up_w):
                if reset:
                    reset_writer(writer)
                else:
                    writer.close()


class FaultProxy:
    """Listen on ``host:port`` (0: a free port), forward to ``target``, inject faults."""

    def __init__(
        self,
        target: tuple[str, int],
        plan: FaultPlan | None = None,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.target = target
        self.plan = plan or FaultPlan.clean()
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.chosen: Counter[str] = Counter()
        self.triggered: Counter[str] = Counter()
        self.open = 0
        self.peak_open = 0
        self.upstream_refused = 0
        self.expired = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and reset every connection still open."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def counts(self) -> dict[str, dict[str, int]]:
        return {"chosen": dict(self.chosen), "triggered": dict(self.triggered)}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            reset_writer(writer)
            raise
        finally:
            self.open -= 1
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fault = self.plan.draw(self._rng)
        self.chosen[fault.kind] += 1
        if fault.kind == "refuse":
            self.triggered["refuse"] += 1
            reset_writer(writer)
            return
        if fault.kind == "blackhole":
            self.triggered["blackhole"] += 1
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(fault.max_lifetime_s):
                    while await reader.read(_READ):
                        pass
            reset_writer(writer)
            return
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                up_r, up_w = await asyncio.open_connection(*self.target)
        except (OSError, TimeoutError):
            self.upstream_refused += 1  # the upstream itself refuses: pass that on as RST
            reset_writer(writer)
            return
        await _Link(self, fault, (reader, writer), (up_r, up_w)).run()


def _parse_weights(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        out[kind.strip()] = float(weight or 1)
    return out


async def _main(args: argparse.Namespace) -> None:
    host, _, port = args.target.rpartition(":")
    plan = FaultPlan(_parse_weights(args.weights))
    proxy = FaultProxy((host, int(port)), plan, seed=args.seed, port=args.port)
    async with proxy:
        print(f"faultproxy: {proxy.url} -> {args.target}", file=sys.stderr, flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, metavar="HOST:PORT")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    default = "none=4,latency=1,stall=1,reset=1,half_open=1,slow_reader=1,refuse=0.3,blackhole=0.3"
    parser.add_argument("--weights", default=default, help=f"kind=weight,... ({default})")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
