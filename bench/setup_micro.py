"""Micro-benchmarks of single steps of a WebSocket session's set-up, on uvloop, in one
process: process CPU (all threads) per call, best of five rounds.

    python bench/setup_micro.py                  # the working tree
    python bench/setup_micro.py --tree /tmp/a    # another source tree (a git archive)

Steps:

- ``open_tcp``: :func:`proxy.relay.failover.open_tcp` to a listener on 127.0.0.1 in the
  same process (so the figure includes the accept). Before ``f99bda8`` it went through
  uvloop's ``sock_connect``, which resolves the address again in libuv's thread pool.
- ``race_client``: :func:`proxy.relay.lifecycle.race_client` with a work that completes
  one callback later and a client that stays (the connect race of every session); the
  work ran in a task of its own before ``994772f``.
- ``forwarded_request_headers``: a WebSocket handshake's seven headers (drop sets built
  per request before ``6c116ad``).

Read the figures of two trees side by side, run one after the other (or interleaved a
few times: the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def _rounds(label: str, values: list[float]) -> None:
    print(f"{label:28s} best {min(values):7.2f} us  ({' '.join(f'{v:.2f}' for v in values)})")


async def _measure(step: Callable[[], Awaitable[Any]], n: int, after: Any = None) -> list[float]:
    out = []
    for _ in range(5):
        kept = []
        started = time.process_time()
        for _ in range(n):
            kept.append(await step())
        out.append((time.process_time() - started) / n * 1e6)
        if after is not None:
            after(kept)
        await asyncio.sleep(0.05)
    return out


async def main(args: argparse.Namespace) -> None:
    from proxy.clock import LoopClock
    from proxy.relay.failover import open_tcp
    from proxy.relay.headers import forwarded_request_headers
    from proxy.relay.lifecycle import race_client

    loop = asyncio.get_running_loop()
    clock = LoopClock(loop)
    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]

    def close_all(socks: list[Any]) -> None:
        for s in socks:
            s.close()

    async def connect() -> Any:
        return await open_tcp("127.0.0.1", port, clock=clock, timeout=5)

    close_all([await connect() for _ in range(100)])  # warm up
    _rounds("open_tcp", await _measure(connect, args.n, close_all))
    server.close()

    never = asyncio.Event()

    async def work() -> int:
        future: asyncio.Future[int] = loop.create_future()
        loop.call_soon(future.set_result, 1)
        return await future

    async def race() -> Any:
        return await race_client(work(), never.wait(), leftover=lambda _: None)

    _rounds("race_client", await _measure(race, args.n * 10))

    raw = [
        (b"host", b"127.0.0.1:8080"), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
        (b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="), (b"sec-websocket-version", b"13"),
        (b"user-agent", b"python/3.11 websockets/13"), (b"authorization", b"Bearer x"),
    ]  # fmt: skip

    n = args.n * 100
    values = []
    for _ in range(5):
        started = time.process_time()
        for _ in range(n):
            forwarded_request_headers(
                raw, client_host="127.0.0.1", scheme="ws", websocket=True, trusted_proxies=()
            )
        values.append((time.process_time() - started) / n * 1e6)
    _rounds("forwarded_request_headers", values)


def run() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", help="source tree to import proxy from (default: this checkout)")
    p.add_argument("-n", type=int, default=1000, help="calls per round (x10, x100 for the cheap)")
    args = p.parse_args()
    root = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    import uvloop

    print(f"proxy from {root}")
    uvloop.run(main(args))
    return 0


if __name__ == "__main__":
    sys.exit(run())
