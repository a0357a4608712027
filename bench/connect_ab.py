"""Set-up cost A/B: Headroom from two source trees, connects interleaved, same machine.

Each tree runs as its own ``headroom serve`` process (``PYTHONPATH=<tree>``, so a
``git archive`` of a commit can stand beside the working tree), both in front of one
paced upstream (``bench/wsload.py upstream``; nothing streams: the clients never send
their first text frame). Then, for every round, each relay in turn (ABAB..., the order
swapped every round so drift hits both alike) gets ``--sessions`` WebSocket connects
from its own client processes; the relay's CPU from before the connects to after a
short settle, divided by the sessions, is the round's set-up cost. Closing them all is
measured the same way. The report gives each round, each tree's median, and B/A.

    git archive HEAD | tar -x -C /tmp/tree-a
    python bench/connect_ab.py --a /tmp/tree-a --b . --sessions 500 --rounds 8

The machine is shared: read the per-round ratios and their spread, not one number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python bench/connect_ab.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # type: ignore[import-not-found,unused-ignore]
    ROUTE_PATH,
    Processes,
    Worker,
    cpu_busy,
    free_port,
    headroom_config,
    raise_fd_limit,
    sample,
    start_upstreams,
    wait_port,
)


@dataclass
class Side:
    name: str
    tree: Path
    pid: int = 0
    clients: list[Worker] = field(default_factory=list)
    setup_ms: list[float] = field(default_factory=list)
    close_ms: list[float] = field(default_factory=list)


async def _start(procs: Processes, side: Side, run_dir: Path, upstream_port: int, cap: int) -> str:
    port = free_port()
    conf = run_dir / f"{side.name}.yaml"
    conf.write_text(headroom_config(port, upstream_port, cap, "vllm-omni-speech-ws"))
    log = run_dir / f"{side.name}.log"
    env = {**os.environ, "PYTHONPATH": str(side.tree.resolve())}
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(conf),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
            start_new_session=True, cwd=str(side.tree.resolve()),
        )  # fmt: skip
    procs.add(proc)
    await wait_port(port, 30.0, proc)
    side.pid = proc.pid
    return f"ws://127.0.0.1:{port}{ROUTE_PATH}"


async def _round(side: Side, n: int, concurrency: int, settle: float) -> None:
    parts = len(side.clients)
    shares = [n // parts + (i < n % parts) for i in range(parts)]
    before = sample([side.pid])
    replies = await asyncio.gather(
        *(w.call("connect", "connected", 60.0, n=k, concurrency=concurrency)
          for w, k in zip(side.clients, shares, strict=True))
    )  # fmt: skip
    ok = sum(int(r["ok"]) for r in replies)
    if ok != n:
        raise RuntimeError(f"{side.name}: {ok} of {n} connected: {[r['failed'] for r in replies]}")
    await asyncio.sleep(settle)
    connected = sample([side.pid])
    await asyncio.gather(*(w.call("close", "closed", 60.0) for w in side.clients))
    await asyncio.sleep(settle)
    closed = sample([side.pid])
    side.setup_ms.append((connected.cpu_ns - before.cpu_ns) / 1e6 / n)
    side.close_ms.append((closed.cpu_ns - connected.cpu_ns) / 1e6 / n)


async def run(args: argparse.Namespace) -> int:
    raise_fd_limit()
    procs = Processes()
    run_dir = Path(tempfile.mkdtemp(prefix="headroom-connect-ab-"))
    sides = [Side("A", Path(args.a)), Side("B", Path(args.b))]
    try:
        _, up_port = await start_upstreams(procs, 1, 40.0, 9600)
        for side in sides:
            url = await _start(procs, side, run_dir, up_port, args.sessions + 16)
            print(f"{side.name} pid {side.pid}", file=sys.stderr, flush=True)
            for i in range(args.client_procs):
                w, _ = await Worker.start(
                    procs, f"{side.name}-clients{i}", "clients", "--url", url, "--timeout-s", "30"
                )
                side.clients.append(w)
            await _round(side, 4, 4, 0.2)  # prime: imports, first-use allocations
            side.setup_ms.clear()
            side.close_ms.clear()
        busy0 = cpu_busy()
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                await _round(side, args.sessions, args.concurrency, args.settle)
            print(
                f"round {r + 1}: setup A {sides[0].setup_ms[-1]:.3f} B {sides[1].setup_ms[-1]:.3f}"
                f" ms/session (B/A {sides[1].setup_ms[-1] / sides[0].setup_ms[-1]:.3f}); close A "
                f"{sides[0].close_ms[-1]:.3f} B {sides[1].close_ms[-1]:.3f}",
                file=sys.stderr,
            )
        busy1 = cpu_busy()
    finally:
        await procs.stop_all()
    busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    a, b = sides
    ratios = [y / x for x, y in zip(a.setup_ms, b.setup_ms, strict=True)]
    print(f"A = {a.tree}, B = {b.tree}; {args.rounds} rounds x {args.sessions} connects")
    print(f"machine busy {busy:.0%} during the rounds")
    for side in sides:
        print(
            f"{side.name}: setup median {statistics.median(side.setup_ms):.3f} ms/session "
            f"(min {min(side.setup_ms):.3f}, max {max(side.setup_ms):.3f}); close median "
            f"{statistics.median(side.close_ms):.3f} ms/session"
        )
    print(
        f"B/A setup per round: {' '.join(f'{x:.3f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.3f}"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="source tree A (holds proxy/)")
    p.add_argument("--b", required=True, help="source tree B")
    p.add_argument("--sessions", type=int, default=500)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--settle", type=float, default=0.3)
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
