"""Admission cost: the in-process gate against the shared gate on a local redis-server.

    python bench/admission_redis.py [--sessions 3000] [--gateways 3] [--json out.json]
    python bench/admission_redis.py --quick

For each backend it admits and releases ``--sessions`` sessions one after another
(latency of ``acquire`` until the lease is in hand, and of the release until Redis has
it), then the same with ``--gateways`` gateways in one process, each running
``--concurrency`` sessions at a time against one pool whose cap is half the offered
concurrency (refusals and queueing included). Prints p50/p99 in microseconds and the
CPU time of this process per session (the gateway's side only; redis-server's own CPU is
reported separately from /proc). Starts its own redis-server on a free 127.0.0.1 port
(no persistence) and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from proxy.admission import PoolCore, QueuePolicy, ReplicaSpec
from proxy.admission.gate import Gate
from proxy.admission.redis_backend import RedisAdmission
from proxy.admission.session_lease import Lease
from proxy.admission.shared_gate import SharedGate, SharedLease, SharedPoolSpec
from proxy.clock import LoopClock
from proxy.errors import Refused


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Redis:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.01)
        raise SystemExit("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(name: str, acquire: list[float], release: list[float], cpu_s: float,
             n: int, redis_cpu_s: float | None, refused: int = 0) -> dict[str, Any]:  # fmt: skip
    return {
        "backend": name,
        "sessions": n,
        "acquire_p50_us": round(_pct(acquire, 0.5) * 1e6, 1),
        "acquire_p99_us": round(_pct(acquire, 0.99) * 1e6, 1),
        "release_p50_us": round(_pct(release, 0.5) * 1e6, 1) if release else None,
        "release_p99_us": round(_pct(release, 0.99) * 1e6, 1) if release else None,
        "gateway_cpu_us_per_session": round(cpu_s / n * 1e6, 1),
        "redis_cpu_us_per_session": round(redis_cpu_s / n * 1e6, 1) if redis_cpu_s else None,
        "refused": refused,
    }


async def _seed(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    await client.hset("headroom:{bench}:gen", mapping={"id": "bench", "since": 0})
    await client.aclose()


def _shared(url: str, gw: str, cap: int, depth: int) -> SharedGate:
    return SharedGate(
        [SharedPoolSpec("bench", tuple(ReplicaSpec(f"gpu{i}", cap) for i in range(4)),
                        QueuePolicy(depth, 10.0))],
        backend=RedisAdmission(url, gateway_id=gw),
        clock=LoopClock(),
    )  # fmt: skip


async def sequential(n: int, redis: Redis) -> list[dict[str, Any]]:
    out = []
    gate = Gate(
        [PoolCore("bench", [ReplicaSpec(f"gpu{i}", 12) for i in range(4)], QueuePolicy(0, 1))],
        clock=LoopClock(),
    )
    acq, rel = [], []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        lease = await gate.acquire("bench")
        t1 = time.perf_counter()
        lease.release()
        acq.append(t1 - t0)
        rel.append(time.perf_counter() - t1)
    out.append(_summary("memory", acq, rel, time.process_time() - cpu0, n, None))

    shared = _shared(redis.url, "seq", 12, 0)
    await shared.start()
    acq, rel = [], []
    r0, cpu0 = redis.cpu_s(), time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        lease = await shared.acquire("bench")
        t1 = time.perf_counter()
        assert isinstance(lease, SharedLease)
        lease.release()
        await shared.quiesce()  # until Redis has the release
        acq.append(t1 - t0)
        rel.append(time.perf_counter() - t1)
    out.append(_summary("redis", acq, rel, time.process_time() - cpu0, n,
                        redis.cpu_s() - r0))  # fmt: skip
    await shared.stop()
    return out


async def concurrent(n: int, gateways: int, concurrency: int, redis: Redis) -> dict[str, Any]:
    """``gateways`` gateways, each keeping ``concurrency`` sessions in flight; 4 replicas
    whose caps add up to half of what is offered, a queue of the same size."""
    cap = max(1, gateways * concurrency // 8)
    gates = [_shared(redis.url, f"gw{i}", cap, gateways * concurrency) for i in range(gateways)]
    for gate in gates:
        await gate.start()
    acq: list[float] = []
    refused = 0
    per_worker = max(1, n // (gateways * concurrency))

    async def worker(gate: SharedGate) -> None:
        nonlocal refused
        for _ in range(per_worker):
            t0 = time.perf_counter()
            try:
                lease: Lease = await gate.acquire("bench")
            except Refused:
                refused += 1
                continue
            acq.append(time.perf_counter() - t0)
            await asyncio.sleep(0.001)  # holds the slot for a moment
            lease.release()

    r0, cpu0 = redis.cpu_s(), time.process_time()
    await asyncio.gather(*(worker(g) for g in gates for _ in range(concurrency)))
    for gate in gates:
        await gate.quiesce()
    total = per_worker * gateways * concurrency
    name = f"redis x{gateways} gateways, {concurrency} in flight each (acquire incl. queue wait)"
    cpu = time.process_time() - cpu0
    result = _summary(name, acq, [], cpu, total, redis.cpu_s() - r0, refused)
    for gate in gates:
        await gate.stop()
    return result


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    redis = Redis()
    try:
        await _seed(redis.url)
        rows = await sequential(args.sessions, redis)
        rows.append(await concurrent(args.sessions, args.gateways, args.concurrency, redis))
        return rows
    finally:
        redis.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="200 sessions: a smoke run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.sessions = 200
    rows = asyncio.run(main_async(args))
    cols = ["backend", "acquire_p50_us", "acquire_p99_us", "release_p50_us", "release_p99_us",
            "gateway_cpu_us_per_session", "redis_cpu_us_per_session", "refused"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
