"""Request-head limits (issue 14 item 4): what trickled and oversized heads cost a gateway.

    python bench/head_limits.py                       # 250 trickling connections, 3 s deadline
    python bench/head_limits.py --connections 50 --timeout 1
    python bench/head_limits.py --json out.json

Starts ``headroom serve`` on 127.0.0.1 (free ports; one replica behind a small local
upstream that answers 200), then:

1. ``--connections`` clients each send a partial request head and then one more byte
   every second (a slowloris). The gateway's open descriptors are counted before, while
   they trickle, and after ``limits.handshake_timeout_s`` (``--timeout``) plus the
   lingering close; how many clients were answered 408 and closed, and when.
2. One client sends a request with a 16 MiB header; its status and the gateway's RSS
   before and after; how many requests reached the upstream.

Bounded: everything stops by itself within ``--timeout`` + ~20 s. Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Upstream:
    """Answers every HTTP request with a small 200 and counts them."""

    def __init__(self) -> None:
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()


async def _wait_port(port: int, proc: asyncio.subprocess.Process) -> None:
    for _ in range(300):
        if proc.returncode is not None:
            raise RuntimeError("headroom serve exited")
        with contextlib.suppress(OSError):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("headroom serve did not start")


async def _trickler(port: int, stop: asyncio.Event, t0: float) -> float | None:
    """A partial head, then one byte a second. The time the server closed it (and the
    status it answered, 408 expected), or None if it was still open at ``stop``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /http HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    reading = asyncio.ensure_future(reader.read(4096))
    try:
        while not stop.is_set():
            done, _ = await asyncio.wait({reading}, timeout=1.0)
            if done:
                data = reading.result() if not reading.exception() else b""
                return time.monotonic() - t0 if data.startswith(b"HTTP/1.1 408 ") else -1.0
            with contextlib.suppress(ConnectionError):
                writer.write(b"a")
        return None
    finally:
        reading.cancel()
        writer.close()


async def _huge_header(port: int) -> int | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET /http HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
    request += b"a" * (16 * MiB) + b"\r\n\r\n"

    async def write() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(request)
            await writer.drain()

    writing = asyncio.ensure_future(write())
    try:
        data = await asyncio.wait_for(reader.read(4096), 30)
    except (TimeoutError, ConnectionError):
        data = b""
    finally:
        writing.cancel()
        with contextlib.suppress(BaseException):
            await writing
        writer.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    upstream = Upstream()
    up = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
    up_port = up.sockets[0].getsockname()[1]
    port, admin = _free_port(), _free_port()
    config = f"""
listen: {{host: 127.0.0.1, port: {port}}}
admin: {{host: 127.0.0.1, port: {admin}}}
log_level: warning
limits: {{handshake_timeout_s: {args.timeout}}}
pools:
  - name: main
    replicas: [{{name: gpu0, url: "http://127.0.0.1:{up_port}", max_sessions: 8}}]
routes:
  - {{path: /http, pool: main, protocol: passthrough-http}}
"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "headroom.yaml"
        path.write_text(config)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.process.cli", "serve", "--config", str(path), cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await _wait_port(port, proc)
            await asyncio.sleep(0.5)
            pid = proc.pid
            result: dict[str, Any] = {"connections": args.connections, "timeout_s": args.timeout}
            result["fds_before"] = _fds(pid)
            stop = asyncio.Event()
            t0 = time.monotonic()
            tricklers = [
                asyncio.ensure_future(_trickler(port, stop, t0)) for _ in range(args.connections)
            ]
            await asyncio.sleep(min(1.0, args.timeout / 2))
            result["fds_while_trickling"] = _fds(pid)
            # the deadline, the 2 s lingering close, and a margin
            await asyncio.sleep(args.timeout + 2.0 + 1.0)
            result["fds_after_deadline"] = _fds(pid)
            stop.set()
            closed = await asyncio.gather(*tricklers)
            answered = [t for t in closed if t is not None and t >= 0]
            result["answered_408"] = len(answered)
            result["closed_otherwise"] = sum(1 for t in closed if t is not None and t < 0)
            result["still_open"] = sum(1 for t in closed if t is None)
            if answered:
                result["408_after_s"] = [round(min(answered), 2), round(max(answered), 2)]

            result["rss_mb_before_16mib_header"] = round(_rss_mb(pid), 1)
            result["status_16mib_header"] = await _huge_header(port)
            await asyncio.sleep(0.5)
            result["rss_mb_after_16mib_header"] = round(_rss_mb(pid), 1)
            result["upstream_requests"] = upstream.requests
            return result
        finally:
            if proc.returncode is None:
                proc.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 10)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            up.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=250)
    parser.add_argument("--timeout", type=float, default=3.0, help="handshake_timeout_s")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
