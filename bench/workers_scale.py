"""Relay capacity of ``headroom serve --workers N`` (admission.backend: redis).

    python bench/workers_scale.py --workers 1 2 --sessions 600 1200 1800 --pacing-ms 40

Runs ``bench/relay.py``'s ``headroom-installed`` cells (paced WebSocket upstream, client
processes, one-way latency from CLOCK_MONOTONIC stamps, relay CPU over the supervisor and its
workers) against ``headroom serve --workers N`` with its caps in a local redis-server
(started here on a free 127.0.0.1 port, no persistence, stopped at the end). Prints one
row per (workers, sessions): latency p50/p99, chunks delivered / paced, relay CPU.
Everything is on 127.0.0.1, bounded by relay.py's deadlines and ``--max-total-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/workers_scale.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import harness  # type: ignore[import-not-found,unused-ignore]
import relay  # type: ignore[import-not-found,unused-ignore]


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = harness.free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    import redis as sync_redis

    client = sync_redis.Redis.from_url(url)
    while True:
        try:
            client.ping()
            break
        except sync_redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.05)
    client.close()
    return proc, url


def _seed(url: str, prefix: str) -> None:
    """An established data generation: grants are not blocked for one TTL at start-up."""
    import redis as sync_redis

    client = sync_redis.Redis.from_url(url)
    client.hset(f"{prefix}{{bench}}:gen", mapping={"id": "bench", "since": 0})
    client.close()


_CONFIG = harness.headroom_config


_CELLS = iter(range(1_000_000))


def _patch(workers: int, redis_url: str) -> None:
    """Make relay.py's ``headroom`` target run ``serve --workers N`` on the redis backend.

    Each cell gets its own key prefix: the leases of the previous cell's relay, stopped
    at the end of its cell, would otherwise hold slots for one more lease TTL."""

    def shared_config(port: int, upstream_port: int, max_sessions: int, protocol: str) -> str:
        prefix = f"cell{next(_CELLS)}:"
        _seed(redis_url, prefix)
        return _CONFIG(port, upstream_port, max_sessions, protocol) + (
            "admission:\n  backend: redis\n"
            f'  redis: {{url: "{redis_url}", key_prefix: "{prefix}", lease_ttl_s: 10,'
            " renew_interval_s: 2, fence_margin_s: 1, timeout_s: 0.5}\n"
        )

    harness.headroom_config = shared_config
    script = (
        "import sys; from proxy.process.cli import main; "
        f"sys.exit(main(sys.argv[1:] + ['--workers', '{workers}']))"
    )
    harness.headroom_command = lambda: [sys.executable, "-c", script]


async def _run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    redis_proc, url = _start_redis()
    try:
        for workers in args.workers:
            _patch(workers, url)
            argv = ["--targets", "headroom-installed", "--rounds", "1", "--load-wait", "0",
                    "--warmup-chunks", "0", "--sessions", *map(str, args.sessions),
                    "--pacing-ms", str(args.pacing_ms), "--window", str(args.window),
                    "--client-procs", str(args.client_procs),
                    "--upstream-procs", str(args.upstream_procs),
                    "--max-total-s", str(args.max_total_s)]  # fmt: skip
            result = await relay.run(relay.parse_args(argv))
            for cell in result["cells"]:
                rows.append({"workers": workers, **cell})
            for note in result["notes"]:
                print(f"note ({workers} workers): {note}", file=sys.stderr)
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sessions", type=int, nargs="+", default=[600, 1200, 1800])
    p.add_argument("--pacing-ms", type=float, default=40.0)
    p.add_argument("--window", type=float, default=6.0)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--upstream-procs", type=int, default=1)
    p.add_argument("--max-total-s", type=float, default=600.0)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    harness.raise_fd_limit()
    rows = asyncio.run(_run(args))
    print(
        "| workers | sessions | chunks/s paced | delivered | p50 ms | p99 ms "
        "| relay CPU cores | load generators | other processes | machine busy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = r["sessions"] * 1000.0 / r["pacing_ms"]
        cpu = r.get("relay_cpu_cores")
        print(
            f"| {r['workers']} | {r['sessions']} | {rate:.0f} | {r['delivered_ratio']} | "
            f"{r['latency_ms']['p50']} | {r['latency_ms']['p99']} | {cpu} | "
            f"{r['loadgen_cpu_cores']} | {r['other_cpu_cores']} | {r['machine_busy']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
