"""Gang reservations on the shared backend: what a reservation and a claim cost.

    python -m bench.reservations_redis [--calls 1000] [--json out.json]
    python -m bench.reservations_redis --quick

Two gateways in one process on a local redis-server (started here: no persistence,
stopped at the end). Each call reserves one slot in two pools on the first gateway (the
key has ``max_sessions``, so its quota is counted too), then claims both slots on the
second gateway (as behind a load balancer) and releases them. Prints p50/p99 in
microseconds of the reservation (one ``open`` plus one ``hold`` per pool) and of one claim
(``claim`` plus the lease's confirmation), and the CPU of this process and of
redis-server per call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.admission_redis import Redis, _pct
from proxy.admission import QueuePolicy, ReplicaSpec
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.reservations import Reservations
from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
from proxy.clock import LoopClock
from proxy.settings import ApiKeySettings

POOLS = ("asr", "tts")


async def _seed(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    for pool in POOLS:
        await client.hset(f"headroom:{{{pool}}}:gen", mapping={"id": "bench", "since": 0})
    await client.aclose()


def _gate(url: str, gw: str) -> SharedGate:
    return SharedGate(
        [SharedPoolSpec(pool, (ReplicaSpec("gpu0", 64),), QueuePolicy(0, 1.0))
         for pool in POOLS],
        backend=RedisAdmission(url, gateway_id=gw),
        clock=LoopClock(),
    )  # fmt: skip


async def run(calls: int) -> dict[str, Any]:
    redis = Redis()
    try:
        await _seed(redis.url)
        gates = [_gate(redis.url, "gw0"), _gate(redis.url, "gw1")]
        for gate in gates:
            await gate.start()
        issuer, claimer = (Reservations(g, g.clock, None) for g in gates)
        key = ApiKeySettings(name="agent", sha256="a" * 64, max_sessions=1000)
        reserve_s: list[float] = []
        claim_s: list[float] = []
        cpu0, redis0 = time.process_time(), redis.cpu_s()
        for _ in range(calls):
            t0 = time.perf_counter()
            r = await issuer.reserve(list(POOLS), 30.0, key)
            t1 = time.perf_counter()
            leases = []
            for pool in POOLS:
                t = time.perf_counter()
                leases.append(await claimer.claim(r.token, pool, key))
                claim_s.append(time.perf_counter() - t)
            reserve_s.append(t1 - t0)
            for lease in leases:
                lease.release()
            await gates[1].quiesce()
        cpu, redis_cpu = time.process_time() - cpu0, redis.cpu_s() - redis0
        for gate in gates:
            await gate.stop()
        return {
            "calls": calls,
            "pools": len(POOLS),
            "reserve_p50_us": round(_pct(reserve_s, 0.5) * 1e6, 1),
            "reserve_p99_us": round(_pct(reserve_s, 0.99) * 1e6, 1),
            "claim_p50_us": round(_pct(claim_s, 0.5) * 1e6, 1),
            "claim_p99_us": round(_pct(claim_s, 0.99) * 1e6, 1),
            "gateway_cpu_us_per_call": round(cpu / calls * 1e6, 1),
            "redis_cpu_us_per_call": round(redis_cpu / calls * 1e6, 1),
        }
    finally:
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="100 calls: a smoke run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    row = asyncio.run(run(100 if args.quick else args.calls))
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
