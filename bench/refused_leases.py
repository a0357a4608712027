"""Sessions refused while Redis stalls: do their late acquires hold slots?

    python bench/refused_leases.py [--sleep 3] [--cap 6] [--ttl 10] [--json out.json]

One shared gate (the redis backend, ``timeout_s`` 1 s) on its own redis-server, one pool
of ``--cap`` slots. Redis is stopped for ``--sleep`` seconds (SIGSTOP, then SIGCONT: what
``DEBUG SLEEP`` does, without enabling debug commands) and ``--cap`` sessions arrive
meanwhile: each is refused ``backend_unavailable`` when Redis does not
answer in time, while its acquire script waits in Redis' socket buffer. When Redis
wakes, the bench reads how many leases Redis holds (at once, and once the gateway's
background calls have landed), then ``--cap`` new sessions ask for a slot (queue wait up
to the TTL + 5 s): how long each waited. A refused session that left a lease behind
makes the newcomers wait up to a lease TTL. Loopback only; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from bench.admission_redis import Redis
from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock
from proxy.errors import Refused


async def _leases(url: str) -> int:
    client = aioredis.from_url(url)
    try:
        return int(await client.zcard("headroom:{tts}:leases"))
    finally:
        await client.aclose()


async def run(sleep_s: float, cap: int, ttl_s: float) -> dict[str, Any]:
    server = Redis()
    try:
        seed = aioredis.from_url(server.url)
        await seed.hset("headroom:{tts}:gen", mapping={"id": "seed", "since": 0})
        gate = SharedGate(
            [SharedPoolSpec("tts", (ReplicaSpec("gpu0", cap),), QueuePolicy(cap * 2, ttl_s + 5))],
            backend=RedisAdmission(server.url, gateway_id="gw", lease_ttl_s=ttl_s),
            clock=LoopClock(), metrics=None, lease_ttl_s=ttl_s,
        )  # fmt: skip
        await gate.start()
        try:
            # Warm, as a gateway under load is: the scripts loaded, a pooled connection
            # per concurrent call.
            for lease in await asyncio.gather(*(gate.acquire("tts") for _ in range(cap))):
                lease.release()
            await gate.quiesce()
            os.kill(server.proc.pid, signal.SIGSTOP)
            stopped = time.monotonic()

            async def refused_one() -> bool:
                try:
                    lease = await gate.acquire("tts")
                except Refused as exc:
                    return exc.reason == "backend_unavailable"
                lease.release()
                return False

            refused = sum(await asyncio.gather(*(refused_one() for _ in range(cap))))
            await asyncio.sleep(max(0.0, stopped + sleep_s - time.monotonic()))
            os.kill(server.proc.pid, signal.SIGCONT)
            woke = time.monotonic()
            at_wake = await _leases(server.url)
            await gate.quiesce()
            settled = await _leases(server.url)

            async def newcomer() -> float:
                started = time.monotonic()
                lease = await gate.acquire("tts")
                waited = time.monotonic() - started
                await asyncio.sleep(0.5)
                lease.release()
                return waited

            waits = await asyncio.gather(*(newcomer() for _ in range(cap)))
            return {
                "sleep_s": sleep_s, "cap": cap, "ttl_s": ttl_s, "refused": refused,
                "leases_at_wake": at_wake, "leases_settled": settled,
                "settled_after_s": round(time.monotonic() - woke, 3),
                "newcomer_wait_max_s": round(max(waits), 3),
                "newcomer_wait_sum_s": round(sum(waits), 3),
            }  # fmt: skip
        finally:
            await gate.stop()
            await seed.aclose()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sleep", type=float, default=3.0, help="seconds Redis is stopped")
    parser.add_argument("--cap", type=int, default=6, help="slots in the pool")
    parser.add_argument("--ttl", type=float, default=10.0, help="lease TTL seconds")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    result = asyncio.run(run(args.sleep, args.cap, args.ttl))
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
