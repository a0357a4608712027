"""A lean WebSocket relay prototype: what the hot-path recommendations in
``bench/RESULTS.md`` would buy, measured by ``bench/relay.py --targets ...,splice``.

    python bench/splice_relay.py --port P --upstream-port U [--meter]

Not Headroom and not for production: no admission, limits, close-code mapping, TLS or
keepalive. After the client's handshake it opens a TCP connection to the upstream,
forwards the request and the 101 response verbatim, then splices bytes both ways in
protocol callbacks (no task per message, no re-framing: a server frame is valid as it
stands on the client leg and a masked client frame on the upstream leg). The
upstream -> client direction tracks frame headers incrementally (no payload copy) so each
binary frame can be metered by its length; with ``--meter`` every frame goes through
Headroom's real :class:`proxy.metering.session_meter.SessionMeter` and Prometheus sink (PCM length
->
seconds, as the ``vllm-omni-speech-ws`` adapter does for PCM), otherwise frames are only
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # `python bench/splice_relay.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_HEADER = 16 * 1024
HIGH_WATER = 256 * 1024


class FrameMeter:
    """Walks server frame headers across reads; meters complete binary frames."""

    __slots__ = ("_bps", "_head", "_left", "_length", "_loop", "_meter", "_opcode", "frames")

    def __init__(self, meter: Any, bytes_per_second: float) -> None:
        self._meter = meter
        self._bps = bytes_per_second
        self._loop = asyncio.get_running_loop()
        self._head = b""  # a header split across reads
        self._left = 0  # payload bytes of the current frame still to come
        self._opcode = 0
        self._length = 0
        self.frames = 0

    def feed(self, data: bytes) -> None:
        n = len(data)
        i = 0
        if self._left:
            take = min(self._left, n)
            self._left -= take
            i = take
            if self._left:
                return
            self._done()
        if self._head:
            data = self._head + data[i:]
            n = len(data)
            i = 0
            self._head = b""
        while i < n:
            if n - i < 2:
                self._head = data[i:]
                return
            b1 = data[i + 1] & 0x7F
            head = 2 + (2 if b1 == 126 else 8 if b1 == 127 else 0)
            if n - i < head:
                self._head = data[i:]
                return
            if b1 == 126:
                length = int.from_bytes(data[i + 2 : i + 4], "big")
            elif b1 == 127:
                length = int.from_bytes(data[i + 2 : i + 10], "big")
            else:
                length = b1
            self._opcode = data[i] & 0x0F
            i += head
            if n - i < length:
                self._left = length - (n - i)
                self._length = length
                return
            i += length
            self._length = length
            self._done()

    def _done(self) -> None:
        self.frames += 1
        if self._opcode == 2 and self._meter is not None:
            self._meter.audio(self._loop.time(), self._length / self._bps)


class Leg(asyncio.Protocol):
    """One socket of a spliced pair; forwards what it reads to ``peer``."""

    def __init__(self, session: Session, upstream: bool) -> None:
        self.session = session
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.peer: Leg | None = None
        self.buffer = bytearray()  # handshake bytes
        self.spliced = False
        self.meter: FrameMeter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        if not self.upstream:
            self.session.client = self

    def data_received(self, data: bytes) -> None:
        if self.spliced:
            assert self.peer is not None and self.peer.transport is not None
            self.peer.transport.write(data)
            if self.meter is not None:
                self.meter.feed(data)
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEADER and self.transport is not None:
                self.transport.abort()
            return
        head, rest = bytes(self.buffer[: end + 4]), bytes(self.buffer[end + 4 :])
        self.buffer = bytearray()
        if self.upstream:
            self.session.upstream_answered(head, rest)
        else:
            if self.transport is not None:
                self.transport.pause_reading()
            self.session.opening = asyncio.ensure_future(self.session.open_upstream(head, rest))

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class Session:
    def __init__(self, relay: SpliceRelay) -> None:
        self.relay = relay
        self.client: Leg | None = None
        self.up: Leg | None = None
        self.opening: asyncio.Future[None] | None = None

    async def open_upstream(self, request: bytes, rest: bytes) -> None:
        loop = asyncio.get_running_loop()
        client = self.client
        assert client is not None and client.transport is not None
        try:
            _, up = await loop.create_connection(
                lambda: Leg(self, upstream=True), "127.0.0.1", self.relay.upstream_port
            )
        except OSError:
            client.transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            client.transport.close()
            return
        self.up = up
        up.peer, client.peer = client, up
        assert up.transport is not None
        up.transport.write(request + rest)

    def upstream_answered(self, head: bytes, rest: bytes) -> None:
        client, up = self.client, self.up
        assert client is not None and up is not None
        assert client.transport is not None and up.transport is not None
        client.transport.write(head)
        if head.startswith(b"HTTP/1.1 101"):
            up.meter = FrameMeter(self.relay.new_meter(), 48000.0)
            client.spliced = up.spliced = True
            client.transport.resume_reading()
            if rest:
                up.data_received(rest)
        else:
            client.transport.write(rest)
            client.transport.close()
            up.transport.close()


class SpliceRelay:
    def __init__(self, upstream_port: int, meter: bool) -> None:
        self.upstream_port = upstream_port
        self.metering = meter
        self._sink: Any = None
        if meter:
            from proxy.metering.rolling import ReplicaSignals
            from proxy.metering.series import Metrics
            from proxy.metering.session_meter import PrometheusReplicaSink

            self._sink = PrometheusReplicaSink(Metrics(), "bench", "up0", ReplicaSignals())

    def new_meter(self) -> Any:
        if not self.metering:
            return None
        from proxy.metering.session_meter import SessionMeter

        return SessionMeter(asyncio.get_running_loop().time(), self._sink)


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    relay = SpliceRelay(args.upstream_port, args.meter)
    server = await loop.create_server(
        lambda: Leg(Session(relay), upstream=False), "127.0.0.1", args.port, backlog=4096
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"splice relay on 127.0.0.1:{args.port} pid {os.getpid()}", file=sys.stderr)
    await stop.wait()
    server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--meter", action="store_true", help="meter frames with Headroom's meter")
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args))


if __name__ == "__main__":
    main()
