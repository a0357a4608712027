"""Load-generating processes for the relay benchmarks: a paced WebSocket upstream and a
group of WebSocket clients, both raw asyncio protocols on uvloop (a few microseconds
per frame, so the load generator is not what is measured).

    python bench/wsload.py upstream --port P [--pacing-ms 40] [--chunk-bytes 9600]
    python bench/wsload.py clients --url ws://127.0.0.1:P/path --sessions N

Both are driven by the benchmark scripts (``bench/relay.py``, ``bench/reject_storm.py``)
over a line protocol: one JSON command per line on stdin, one JSON event per line on
stdout. Both exit when stdin closes (the driver went away) or after ``--lifetime-s``.

Upstream: every connection that sends a text frame (the client's "start") gets one
``audio.start`` text event and then a binary frame of ``--chunk-bytes`` every
``--pacing-ms``, at a random phase, whose first 8 bytes are ``time.monotonic_ns()``
(little-endian) at the moment of the write: CLOCK_MONOTONIC is shared by every process
on the machine, so a client's receive time minus it is the one-way latency. Several
upstream processes may share one port (SO_REUSEPORT).

Clients: commands ``connect``, ``start``, ``mark`` (start recording), ``stop`` (stop
recording; write the latency, gap and arrival-time samples, int64 ns, to
``<out>.lat`` / ``<out>.gap`` / ``<out>.at``), ``storm`` (open connections at a rate
and count the HTTP statuses, for refusal storms), ``close``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import random
import resource
import signal
import socket
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

__all__ = ["frame_header", "main"]

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
START_TEXT = b'{"type":"input.text","text":"benchmark"}'
AUDIO_START = b'{"type":"audio.start","format":"pcm","sample_rate":24000,"channels":1}'
MAX_HEADER = 16 * 1024
WRITE_BACKLOG = 1024 * 1024  # an upstream skips a chunk while this much is unsent


def frame_header(opcode: int, length: int, *, masked: bool = False) -> bytes:
    """RFC 6455 header of one final frame (mask key not included)."""
    mask = 0x80 if masked else 0
    first = bytes([0x80 | opcode])
    if length < 126:
        return first + bytes([mask | length])
    if length < 65536:
        return first + bytes([mask | 126]) + length.to_bytes(2, "big")
    return first + bytes([mask | 127]) + length.to_bytes(8, "big")


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame; the all-zero key leaves the payload as it is."""
    return frame_header(opcode, len(payload), masked=True) + b"\0\0\0\0" + payload


def unmask(payload: bytes, key: bytes) -> bytes:
    if not payload or key == b"\0\0\0\0":
        return payload
    n = len(payload)
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


class FrameParser:
    """Incremental frame parser; calls ``on_frame(fin, opcode, payload_view)``.

    The payload is a memoryview into the receive buffer, valid only during the call
    (unmasked by the callee if needed)."""

    __slots__ = ("_buf", "_on_frame")

    def __init__(self, on_frame: Callable[[bool, int, memoryview, bytes | None], None]) -> None:
        self._buf = bytearray()
        self._on_frame = on_frame

    def feed(self, data: bytes | bytearray) -> None:
        buf = self._buf
        buf += data
        pos = 0
        end = len(buf)
        on_frame = self._on_frame
        with memoryview(buf) as view:
            while end - pos >= 2:
                b0 = buf[pos]
                b1 = buf[pos + 1]
                length = b1 & 0x7F
                head = 2
                if length == 126:
                    if end - pos < 4:
                        break
                    length = int.from_bytes(view[pos + 2 : pos + 4], "big")
                    head = 4
                elif length == 127:
                    if end - pos < 10:
                        break
                    length = int.from_bytes(view[pos + 2 : pos + 10], "big")
                    head = 10
                key: bytes | None = None
                if b1 & 0x80:
                    if end - pos < head + 4:
                        break
                    key = bytes(view[pos + head : pos + head + 4])
                    head += 4
                if end - pos < head + length:
                    break
                start = pos + head
                on_frame(bool(b0 & 0x80), b0 & 0x0F, view[start : start + length], key)
                pos = start + length
        if pos:
            del buf[:pos]


def _write_event(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def _commands() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the paced upstream -----------------------------------------------------------------


class UpstreamStats:
    __slots__ = ("connections", "open", "sent", "skipped", "streams")

    def __init__(self) -> None:
        self.connections = 0
        self.open = 0
        self.streams = 0
        self.sent = 0
        self.skipped = 0


class UpstreamConnection(asyncio.Protocol):
    """One upstream WebSocket: handshake, then paced binary frames after "start"."""

    def __init__(self, stats: UpstreamStats, pacing_s: float, chunk_bytes: int) -> None:
        self.stats = stats
        self.pacing_s = pacing_s
        self.head = frame_header(2, chunk_bytes)
        self.filler = bytes(chunk_bytes - 8)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.request = bytearray()
        self.parser: FrameParser | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.next_at = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.stats.connections += 1
        self.stats.open += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.stats.open -= 1
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self.parser is not None:
            self.parser.feed(data)
            return
        self.request += data
        end = self.request.find(b"\r\n\r\n")
        if end < 0:
            if len(self.request) > MAX_HEADER:
                self._abort()
            return
        head = bytes(self.request[:end]).decode("latin-1")
        rest = bytes(self.request[end + 4 :])
        self.request = bytearray()
        key = ""
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "sec-websocket-key":
                key = value.strip()
        if not key:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            self.transport.close()
            return
        accept = base64.b64encode(hashlib.sha1(key.encode() + GUID).digest())
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        self.parser = FrameParser(self._on_frame)
        if rest:
            self.parser.feed(rest)

    def _on_frame(self, fin: bool, opcode: int, payload: memoryview, key: bytes | None) -> None:
        transport = self.transport
        assert transport is not None
        if opcode == 1 and self.timer is None:  # the client's start
            self.stats.streams += 1
            transport.write(frame_header(1, len(AUDIO_START)) + AUDIO_START)
            self.next_at = self.loop.time() + random.uniform(0, self.pacing_s)
            self.timer = self.loop.call_at(self.next_at, self._tick)
        elif opcode == 9:  # ping -> pong
            data = unmask(bytes(payload), key or b"\0\0\0\0")
            transport.write(frame_header(10, len(data)) + data)
        elif opcode == 8:  # close: echo the code, then hang up
            data = unmask(bytes(payload[:2]), (key or b"\0\0\0\0")[:2])
            transport.write(frame_header(8, len(data)) + data)
            self._stop()
            transport.close()

    def _tick(self) -> None:
        if self.closed:
            return
        transport = self.transport
        assert transport is not None
        if transport.get_write_buffer_size() > WRITE_BACKLOG:
            self.stats.skipped += 1
        else:
            stamp = time.monotonic_ns().to_bytes(8, "little")
            transport.write(self.head + stamp + self.filler)
            self.stats.sent += 1
        now = self.loop.time()
        self.next_at += self.pacing_s
        if self.next_at < now:  # fell behind: keep the pace, do not burst to catch up
            self.next_at = now
        self.timer = self.loop.call_at(self.next_at, self._tick)

    def _stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.closed = True

    def _abort(self) -> None:
        self._stop()
        if self.transport is not None:
            self.transport.abort()


async def run_upstream(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stats = UpstreamStats()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((args.host, args.port))
    sock.listen(4096)
    sock.setblocking(False)
    pacing_s = args.pacing_ms / 1000.0
    server = await loop.create_server(
        lambda: UpstreamConnection(stats, pacing_s, args.chunk_bytes), sock=sock
    )
    _write_event({"event": "ready", "port": sock.getsockname()[1], "pid": os.getpid()})
    commands = await _commands()
    deadline = loop.time() + args.lifetime_s
    try:
        while True:
            try:
                line = await asyncio.wait_for(commands.readline(), deadline - loop.time())
            except TimeoutError:
                break
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("cmd") == "stats":
                _write_event({"event": "stats", **{k: getattr(stats, k) for k in stats.__slots__}})
            elif cmd.get("cmd") == "exit":
                break
    finally:
        server.close()


# -- the clients --------------------------------------------------------------------------


class Recorder:
    """Samples shared by one client process's sessions (int64 nanoseconds)."""

    __slots__ = ("arrivals", "chunks", "gaps", "latencies", "on")

    def __init__(self) -> None:
        self.on = False
        self.chunks = 0
        self.latencies = array("q")
        self.arrivals = array("q")  # receive time of each latency sample
        self.gaps = array("q")


class ClientConnection(asyncio.Protocol):
    """One client WebSocket: handshake, then records every binary message's latency."""

    def __init__(self, request: bytes, recorder: Recorder) -> None:
        self.request = request
        self.recorder = recorder
        self.transport: asyncio.Transport | None = None
        self.response = bytearray()
        self.handshake: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.parser: FrameParser | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.close_code: int | None = None
        self.closing = False
        self.frames = 0
        self.last_ns = 0
        self.pending_ts = -1  # send stamp of a fragmented message in progress

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(ConnectionError("closed during handshake"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.parser is not None:
            self.parser.feed(data)
            return
        self.response += data
        end = self.response.find(b"\r\n\r\n")
        if end < 0:
            if len(self.response) > MAX_HEADER:
                self.abort()
            return
        status_line = bytes(self.response[: self.response.find(b"\r\n")])
        parts = status_line.split(b" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        rest = bytes(self.response[end + 4 :])
        self.response = bytearray()
        if not self.handshake.done():
            self.handshake.set_result(status)
        if status != 101:
            self.abort()
            return
        self.parser = FrameParser(self._on_frame)
        if rest:
            self.parser.feed(rest)

    def _on_frame(self, fin: bool, opcode: int, payload: memoryview, key: bytes | None) -> None:
        if opcode == 2 or (opcode == 0 and self.pending_ts >= 0):
            if opcode == 2:
                self.pending_ts = int.from_bytes(payload[:8], "little") if len(payload) >= 8 else 0
            if not fin:
                return
            now = time.monotonic_ns()
            rec = self.recorder
            if rec.on:
                rec.chunks += 1
                if self.pending_ts:
                    rec.latencies.append(now - self.pending_ts)
                    rec.arrivals.append(now)
                if self.last_ns:
                    rec.gaps.append(now - self.last_ns)
            self.last_ns = now
            self.pending_ts = -1
            self.frames += 1
        elif opcode == 9 and self.transport is not None:
            self.transport.write(client_frame(10, bytes(payload)))
        elif opcode == 8:
            self.close_code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
            if self.transport is not None:
                if not self.closing:
                    self.transport.write(client_frame(8, bytes(payload[:2])))
                self.transport.close()

    def send_text(self, text: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(client_frame(1, text))

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing() and not self.closing:
            self.closing = True
            self.transport.write(client_frame(8, (1000).to_bytes(2, "big")))

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _request(host: str, port: int, path: str) -> bytes:
    key = base64.b64encode(os.urandom(16))
    return (
        (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        ).encode()
        + b"Sec-WebSocket-Key: "
        + key
        + b"\r\n\r\n"
    )


class ClientGroup:
    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self.recorder = Recorder()
        self.sessions: list[ClientConnection] = []
        self.failures: dict[str, int] = {}
        self.recording_since = 0

    async def open_one(self, recorder: Recorder) -> tuple[ClientConnection | None, str]:
        loop = asyncio.get_running_loop()
        request = _request(self.host, self.port, self.path)
        conn: ClientConnection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                _, proto = await loop.create_connection(
                    lambda: ClientConnection(request, recorder), self.host, self.port
                )
                conn = proto
                status = await proto.handshake
        except TimeoutError:
            if conn is not None:
                conn.abort()
            return None, "timeout"
        except OSError as exc:
            return None, type(exc).__name__
        if status != 101:
            return None, str(status)
        return conn, "101"

    async def connect(self, n: int, concurrency: int) -> dict[str, Any]:
        sem = asyncio.Semaphore(concurrency)
        started = time.monotonic()

        async def one() -> None:
            async with sem:
                conn, outcome = await self.open_one(self.recorder)
            if conn is None:
                self.failures[outcome] = self.failures.get(outcome, 0) + 1
            else:
                self.sessions.append(conn)

        await asyncio.gather(*(one() for _ in range(n)))
        return {
            "event": "connected",
            "ok": len(self.sessions),
            "failed": dict(self.failures),
            "seconds": round(time.monotonic() - started, 3),
        }

    def start(self) -> dict[str, Any]:
        for conn in self.sessions:
            conn.send_text(START_TEXT)
        return {"event": "started", "sessions": len(self.sessions)}

    def mark(self) -> dict[str, Any]:
        rec = self.recorder
        rec.latencies = array("q")
        rec.arrivals = array("q")
        rec.gaps = array("q")
        rec.chunks = 0
        rec.on = True
        self.recording_since = time.monotonic_ns()
        return {"event": "marked"}

    def stop(self, out: str) -> dict[str, Any]:
        rec = self.recorder
        rec.on = False
        seconds = (time.monotonic_ns() - self.recording_since) / 1e9
        with open(out + ".lat", "wb") as f:
            rec.latencies.tofile(f)
        with open(out + ".gap", "wb") as f:
            rec.gaps.tofile(f)
        with open(out + ".at", "wb") as f:
            rec.arrivals.tofile(f)
        alive = sum(1 for c in self.sessions if not c.closed.done())
        return {
            "event": "stopped",
            "chunks": rec.chunks,
            "seconds": round(seconds, 4),
            "alive": alive,
            "silent": sum(1 for c in self.sessions if c.frames == 0),
        }

    async def close(self) -> dict[str, Any]:
        for conn in self.sessions:
            conn.close()
        pending = [c.closed for c in self.sessions if not c.closed.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.timeout_s)
        codes: dict[str, int] = {}
        for conn in self.sessions:
            if not conn.closed.done():
                conn.abort()
            key = str(conn.close_code)
            codes[key] = codes.get(key, 0) + 1
        self.sessions = []
        self.failures = {}
        return {"event": "closed", "close_codes": codes}

    async def storm(self, rate: float, seconds: float) -> dict[str, Any]:
        """Open connections at ``rate`` per second for ``seconds``; count the outcomes."""
        loop = asyncio.get_running_loop()
        outcomes: dict[str, int] = {}
        refusal_ns = array("q")
        tasks: set[asyncio.Task[None]] = set()
        scratch = Recorder()

        async def one() -> None:
            t0 = time.monotonic_ns()
            conn, outcome = await self.open_one(scratch)
            refusal_ns.append(time.monotonic_ns() - t0)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if conn is not None:  # admitted: not what a storm is for, hang up
                conn.abort()

        tick = 0.01
        started = loop.time()
        due = 0.0
        sent = 0
        while (now := loop.time()) - started < seconds:
            due = (now - started) * rate
            while sent < int(due):
                sent += 1
                task = asyncio.ensure_future(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(tick)
        elapsed = loop.time() - started
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout_s + 1)
        for task in tasks:
            task.cancel()
        ordered = sorted(refusal_ns)
        p50 = ordered[len(ordered) // 2] / 1e6 if ordered else None
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1e6 if ordered else None
        return {
            "event": "stormed",
            "attempts": sent,
            "seconds": round(elapsed, 3),
            "outcomes": outcomes,
            "answer_ms_p50": p50,
            "answer_ms_p99": p99,
        }


async def run_clients(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    group = ClientGroup(args.url, args.timeout_s)
    _write_event({"event": "ready", "pid": os.getpid()})
    commands = await _commands()
    deadline = loop.time() + args.lifetime_s
    try:
        while True:
            try:
                line = await asyncio.wait_for(commands.readline(), deadline - loop.time())
            except TimeoutError:
                break
            if not line:
                break
            cmd = json.loads(line)
            name = cmd.get("cmd")
            if name == "connect":
                _write_event(await group.connect(int(cmd["n"]), int(cmd.get("concurrency", 64))))
            elif name == "start":
                _write_event(group.start())
            elif name == "mark":
                _write_event(group.mark())
            elif name == "stop":
                _write_event(group.stop(str(cmd["out"])))
            elif name == "storm":
                _write_event(await group.storm(float(cmd["rate"]), float(cmd["seconds"])))
            elif name == "close":
                _write_event(await group.close())
            elif name == "exit":
                break
    finally:
        for conn in group.sessions:
            conn.abort()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    up = sub.add_parser("upstream")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=0)
    up.add_argument("--pacing-ms", type=float, default=40.0)
    up.add_argument("--chunk-bytes", type=int, default=9600)
    up.add_argument("--lifetime-s", type=float, default=900.0)
    cl = sub.add_parser("clients")
    cl.add_argument("--url", required=True)
    cl.add_argument("--timeout-s", type=float, default=10.0)
    cl.add_argument("--lifetime-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.role == "upstream" and args.chunk_bytes < 8:
        parser.error("--chunk-bytes must be at least 8 (the send stamp)")
    _raise_fd_limit()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us; Ctrl-C goes to it
    runner = run_upstream if args.role == "upstream" else run_clients
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(runner(args))
        return
    uvloop.run(runner(args))


if __name__ == "__main__":
    main()
