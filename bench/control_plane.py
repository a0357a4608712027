"""The control plane under attack (issue 26, item 2): what oversized and dripping bodies
on ``POST /v1/headroom/reservations`` cost a gateway.

    python bench/control_plane.py                       # 400 MB bodies, 200 drips, 3 s
    python bench/control_plane.py --body-mb 100 --connections 50 --timeout 1
    python bench/control_plane.py --json out.json

Starts ``headroom serve`` on 127.0.0.1 (a free port, auth on, one replica that need not
answer: nothing here reaches admission), then:

1. one client sends a ``--body-mb`` MB body of ``[`` without a key, and one with a key;
   for each, the answer and how many bytes it had sent when the answer came (the rest
   of the body is never sent);
2. ``--connections`` clients, with a key, send a head promising a body and then one byte
   of it a second (a slowloris); how they were answered and when, against
   ``limits.handshake_timeout_s`` (``--timeout``);
3. the gateway's peak RSS over both, its open descriptors before and after, and its
   ERROR lines.

Bounded: each drip stops at its answer or after ``--timeout`` + 30 s; a body at its
answer or its end. Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESERVE = b"POST /v1/headroom/reservations HTTP/1.1\r\nhost: x\r\n"
KEY = b"authorization: Bearer bench-key\r\n"

CONFIG = """
listen: {{host: 127.0.0.1, port: {port}}}
admin: {{enabled: false}}
log_level: warning
limits: {{handshake_timeout_s: {timeout}}}
pools:
  - name: main
    replicas: [{{name: gpu0, url: "http://127.0.0.1:9", max_sessions: 4}}]
routes:
  - {{path: /v1/audio/speech, pool: main, protocol: openai-speech-http}}
auth:
  keys: [{{name: bench, sha256: {sha}}}]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _status(answer: asyncio.Future[bytes]) -> str:
    try:
        return (await asyncio.wait_for(answer, 30)).split(b"\r\n")[0].decode()
    except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as exc:
        return f"no answer ({type(exc).__name__})"


async def big_body(port: int, size: int, key: bool) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(RESERVE + (KEY if key else b"") + b"content-length: %d\r\n\r\n" % size)
    answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    sent, block = 0, b"[" * 65536
    with contextlib.suppress(ConnectionError):
        while not answer.done() and sent < size:
            writer.write(block)
            sent += len(block)
            await writer.drain()
            await asyncio.sleep(0)
    status = await _status(answer)
    writer.transport.abort()
    return {"key": key, "status": status, "sent_bytes": sent}


async def drips(port: int, connections: int, timeout_s: float) -> list[dict[str, Any]]:
    pairs = []
    for _ in range(connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(RESERVE + KEY + b"content-length: 1000\r\n\r\n{")
        pairs.append((reader, writer))
    start = time.monotonic()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> dict[str, Any]:
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        while not answer.done() and time.monotonic() - start < timeout_s + 30:
            with contextlib.suppress(ConnectionError):
                writer.write(b" ")
                await writer.drain()
            await asyncio.wait({answer}, timeout=1)
        if not answer.done():
            answer.cancel()
        status = await _status(answer) if not answer.cancelled() else "no answer"
        writer.transport.abort()
        return {"status": status, "answered_after_s": round(time.monotonic() - start, 2)}

    return await asyncio.gather(*(drip(r, w) for r, w in pairs))


async def run(body_mb: int, connections: int, timeout_s: float) -> dict[str, Any]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "headroom.yaml"
        sha = hashlib.sha256(b"bench-key").hexdigest()
        config.write_text(CONFIG.format(port=port, timeout=timeout_s, sha=sha))
        log = Path(tmp) / "gateway.log"
        with log.open("w") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--config", str(config),
                cwd=ROOT, stderr=err,
            )  # fmt: skip
        try:
            for _ in range(400):
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                await asyncio.sleep(0.05)
            result: dict[str, Any] = {"rss_start_mb": round(_rss_mb(proc.pid), 1),
                                      "fds_start": _fds(proc.pid)}  # fmt: skip
            peak = result["rss_start_mb"]

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, _rss_mb(proc.pid))
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            size = body_mb * 1_000_000
            result["bodies"] = [await big_body(port, size, key) for key in (False, True)]
            answers = await drips(port, connections, timeout_s)
            await asyncio.sleep(timeout_s + 1)  # the answered connections close
            watcher.cancel()
            statuses: dict[str, int] = {}
            for a in answers:
                statuses[a["status"]] = statuses.get(a["status"], 0) + 1
            result["drips"] = {
                "connections": connections,
                "statuses": statuses,
                "answered_after_s_max": max(a["answered_after_s"] for a in answers),
            }
            result["fds_end"] = _fds(proc.pid)
            result["rss_peak_mb"] = round(peak, 1)
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 15)
        result["error_lines"] = sum("ERROR" in line for line in log.read_text().splitlines())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--body-mb", type=int, default=400)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=3.0, help="handshake_timeout_s")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args.body_mb, args.connections, args.timeout))
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
