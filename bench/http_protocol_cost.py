"""What uvicorn's HTTP protocol behind Headroom's client listener costs a streamed response.

    python bench/http_protocol_cost.py                 # 3 rounds, 20 streams x 3000 chunks
    python bench/http_protocol_cost.py --chunks 1000 --rounds 1

One process serves an app that streams ``--chunks`` chunks of 9.6 KB (0.2 s of 24 kHz
PCM16) as one chunked response, to ``--streams`` clients in the same process, on
127.0.0.1. It is served three ways, alternating, each round: uvicorn's ``httptools``
protocol alone, uvicorn's ``h11`` protocol alone, and Headroom's client listener
(``proxy.relay.listener``, which hands plain HTTP to uvicorn's h11 protocol). The
figure is the process's CPU time per chunk, clients included (they are the same
for all three), so differences between the rows are what the server side costs.
Everything stops by itself; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/http_protocol_cost.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.process.serving import running_server
from proxy.relay.listener import client_listener
from proxy.relay.ws_server import WebSocketSessions
from proxy.settings import LimitsSettings

CHUNK = b"\0" * 9600


def streaming_app(chunks: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream")]})  # fmt: skip
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def one(kind: str, streams: int, chunks: int) -> float:
    """CPU microseconds per chunk with ``kind`` serving."""
    app = streaming_app(chunks)
    http: Any = kind
    if kind == "listener":
        http = client_listener(app, LimitsSettings, WebSocketSessions())
    async with running_server(app, http=http, lifespan="off") as server:

        async def client() -> None:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n")
            tail = b""
            while True:
                data = await asyncio.wait_for(reader.read(1 << 20), 60)
                if not data:
                    break
                tail = (tail + data)[-5:]
                if tail == b"0\r\n\r\n":
                    break
            writer.close()

        start = time.process_time()
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(streams))), 600)
        return (time.process_time() - start) / (streams * chunks) * 1e6


async def main(args: argparse.Namespace) -> None:
    kinds = ["httptools", "h11", "listener"]
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        order = kinds[round_ % 3 :] + kinds[: round_ % 3]
        for kind in order:
            results[kind].append(await one(kind, args.streams, args.chunks))
    print(f"CPU per 9.6 KB chunk, clients included ({args.streams} streams x "
          f"{args.chunks} chunks, {args.rounds} rounds):")  # fmt: skip
    for kind in kinds:
        runs = results[kind]
        print(f"  {kind:10s} median {statistics.median(runs):6.2f} us "
              f"(range {min(runs):.2f}-{max(runs):.2f})")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    try:
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:  # pragma: no cover - platform without uvloop
        asyncio.run(main(parser.parse_args()))
