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

``--a nginx`` (or ``--b nginx``) puts Debian's nginx on that side, configured as
``bench/relay.py`` runs it: with ``--stream-windows`` this gives Headroom's CPU per chunk
as a ratio to nginx's measured in the same windows, on the same machine at the same time,
rather than one relay after the other.

The machine is shared: read the per-round ratios and their spread, not one number.

The two sides are not alike in the stream windows: with the same tree on both sides, B
reads a few percent cheaper than A, for a reason not found (both share one paced
upstream, and A's sessions connect and start first). Compare two relays by running them
both ways, ``--a X --b Y`` then ``--a Y --b X``, and take the geometric mean:
``sqrt(r1 / r2)`` for Y against X, where r1 and r2 are the two runs' B/A medians
(bench/RESULTS.md has the runs and the lean's size). ``--both-ways`` does both runs in
one invocation and prints that mean:

    python bench/connect_ab.py --a nginx --b /tmp/tree --sessions 500 --rounds 1 \
        --stream-windows 12 --window 4 --both-ways
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
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
    start_relay,
    start_upstreams,
    wait_port,
)

GC_TRACE = Path(__file__).resolve().parent / "gc_trace.py"
#: ``--a``/``--b`` value for nginx instead of a Headroom tree.
NGINX = "nginx"


@dataclass
class Medians:
    """One run's B/A medians: set-up per round, and CPU per chunk (None without
    ``--stream-windows``)."""

    setup: float
    stream: float | None = None


@dataclass
class Side:
    name: str
    tree: Path
    pids: list[int] = field(default_factory=list)  # the relay's processes (nginx: two)
    clients: list[Worker] = field(default_factory=list)
    gc_log: Path | None = None
    setup_ms: list[float] = field(default_factory=list)
    windows: list[tuple[int, int]] = field(default_factory=list)  # connect phases, ns
    close_ms: list[float] = field(default_factory=list)


async def _start(procs: Processes, side: Side, run_dir: Path, upstream_port: int, cap: int) -> str:
    if str(side.tree) == NGINX:
        relay = await start_relay(procs, NGINX, run_dir / side.name, upstream_port)
        side.pids = relay.pids()
        return relay.url
    port = free_port()
    conf = run_dir / f"{side.name}.yaml"
    conf.write_text(headroom_config(port, upstream_port, cap, "vllm-omni-speech-ws"))
    log = run_dir / f"{side.name}.log"
    env = {**os.environ, "PYTHONPATH": str(side.tree.resolve())}
    cmd = [sys.executable, "-m", "proxy"]
    if side.gc_log is not None:  # every collection logged (bench/gc_trace.py)
        cmd = [sys.executable, str(GC_TRACE), str(side.gc_log), "--"]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, "serve", "--config", str(conf),
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
            start_new_session=True, cwd=str(side.tree.resolve()),
        )  # fmt: skip
    procs.add(proc)
    await wait_port(port, 30.0, proc)
    side.pids = [proc.pid]
    return f"ws://127.0.0.1:{port}{ROUTE_PATH}"


async def _round(side: Side, n: int, concurrency: int, settle: float) -> None:
    shares = _shares(n, side)
    before = sample(side.pids)
    started_ns = time.monotonic_ns()
    replies = await asyncio.gather(
        *(w.call("connect", "connected", 60.0, n=k, concurrency=concurrency)
          for w, k in zip(side.clients, shares, strict=True))
    )  # fmt: skip
    ok = sum(int(r["ok"]) for r in replies)
    if ok != n:
        raise RuntimeError(f"{side.name}: {ok} of {n} connected: {[r['failed'] for r in replies]}")
    await asyncio.sleep(settle)
    connected = sample(side.pids)
    side.windows.append((started_ns, time.monotonic_ns()))
    await asyncio.gather(*(w.call("close", "closed", 60.0) for w in side.clients))
    await asyncio.sleep(settle)
    closed = sample(side.pids)
    side.setup_ms.append((connected.cpu_ns - before.cpu_ns) / 1e6 / n)
    side.close_ms.append((closed.cpu_ns - connected.cpu_ns) / 1e6 / n)


async def run(args: argparse.Namespace) -> Medians:
    raise_fd_limit()
    procs = Processes()
    run_dir = Path(tempfile.mkdtemp(prefix="headroom-connect-ab-"))
    sides = [Side("A", Path(args.a)), Side("B", Path(args.b))]
    if args.gc_trace:
        for side in sides:
            if str(side.tree) != NGINX:
                side.gc_log = run_dir / f"{side.name}-gc.log"
    try:
        _, up_port = await start_upstreams(procs, 1, 40.0, 9600)
        for side in sides:
            url = await _start(procs, side, run_dir, up_port, args.sessions + 16)
            print(f"{side.name} pids {side.pids}", file=sys.stderr, flush=True)
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
        stream = await _stream(sides, args, run_dir) if args.stream_windows else None
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
    for side in sides:
        if side.gc_log is not None:
            print(f"{side.name}: {_gc_summary(side, args.sessions)}")
    print(
        f"B/A setup per round: {' '.join(f'{x:.3f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.3f}"
    )
    return Medians(statistics.median(ratios), stream)


async def _stream(sides: list[Side], args: argparse.Namespace, run_dir: Path) -> float:
    """Both relays stream at once (``--sessions`` each, one chunk per 40 ms): relay CPU
    per chunk in each of ``--stream-windows`` windows of ``--window`` seconds, side by
    side, so that both see the same machine."""
    for side in sides:
        await asyncio.gather(
            *(w.call("connect", "connected", 60.0, n=n, concurrency=args.concurrency)
              for w, n in zip(side.clients, _shares(args.sessions, side), strict=True))
        )  # fmt: skip
    for side in sides:
        await asyncio.gather(*(w.call("start", "started", 10.0) for w in side.clients))
    await asyncio.sleep(2.0)
    per_chunk: dict[str, list[float]] = {side.name: [] for side in sides}
    workers = [w for side in sides for w in side.clients]
    for k in range(args.stream_windows):
        await asyncio.gather(*(w.call("mark", "marked", 10.0) for w in workers))
        before = {side.name: sample(side.pids) for side in sides}
        await asyncio.sleep(args.window)
        after = {side.name: sample(side.pids) for side in sides}
        # Every client of both sides stops at once: the chunks a side counts run on until
        # its clients stop, so neither side is counted over longer than the other.
        stops = await asyncio.gather(
            *(w.call("stop", "stopped", 30.0, out=str(run_dir / f"{side.name}{i}"))
              for side in sides for i, w in enumerate(side.clients))
        )  # fmt: skip
        first = 0
        for side in sides:
            last = first + len(side.clients)
            chunks = sum(int(x["chunks"]) for x in stops[first:last])
            first = last
            cpu_us = (after[side.name].cpu_ns - before[side.name].cpu_ns) / 1e3
            per_chunk[side.name].append(cpu_us / max(1, chunks))
        a, b = (per_chunk[side.name][-1] for side in sides)
        print(f"window {k + 1}: CPU per chunk A {a:.1f} B {b:.1f} us (B/A {b / a:.3f})",
              file=sys.stderr)  # fmt: skip
    ratios = [b / a for a, b in zip(*per_chunk.values(), strict=True)]
    for side in sides:
        print(f"{side.name}: CPU per chunk median {statistics.median(per_chunk[side.name]):.1f} us")
    print(f"B/A CPU per chunk per window: {' '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")  # fmt: skip
    for side in sides:
        await asyncio.gather(*(w.call("close", "closed", 60.0) for w in side.clients))
    return statistics.median(ratios)


def _shares(n: int, side: Side) -> list[int]:
    parts = len(side.clients)
    return [n // parts + (i < n % parts) for i in range(parts)]


def _gc_summary(side: Side, sessions: int) -> str:
    """Collections during the connect phases: count and pause per generation, per
    session."""
    count = [0, 0, 0]
    pause_ns = [0, 0, 0]
    assert side.gc_log is not None
    for line in side.gc_log.read_text().splitlines():
        at, gen, pause, _ = (int(x) for x in line.split())
        if any(a <= at <= b for a, b in side.windows):
            count[gen] += 1
            pause_ns[gen] += pause
    n = sessions * len(side.windows)
    per = " ".join(f"gen{g} {count[g]}x {pause_ns[g] / 1e3 / n:.1f}" for g in range(3))
    return f"GC in connect phases, us per session: {per}; total {sum(pause_ns) / 1e3 / n:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="source tree A (holds proxy/), or nginx")
    p.add_argument("--b", required=True, help="source tree B, or nginx")
    p.add_argument("--sessions", type=int, default=500)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=50)
    p.add_argument("--settle", type=float, default=0.3)
    p.add_argument("--gc-trace", action="store_true", help="log and sum GC passes")
    p.add_argument(
        "--stream-windows",
        type=int,
        default=0,
        help="then stream on both at once: CPU per chunk in this many windows",
    )
    p.add_argument("--window", type=float, default=4.0, help="seconds per stream window")
    p.add_argument(
        "--both-ways",
        action="store_true",
        help="then run again with A and B swapped, and print B against A: the geometric "
        "mean of the two runs' B/A medians, which cancels the sides' lean",
    )
    args = p.parse_args()
    first = asyncio.run(run(args))
    if args.both_ways:
        second = asyncio.run(run(argparse.Namespace(**{**vars(args), "a": args.b, "b": args.a})))
        print(both_ways(first, second, args.a, args.b))
    return 0


def both_ways(first: Medians, second: Medians, a: str, b: str) -> str:
    """B against A from a run (A, B) and a run with the sides swapped: the geometric mean
    ``sqrt(r1 / r2)`` of their B/A medians."""
    lines = [
        f"{b} against {a}, both ways:",
        f"  set-up {math.sqrt(first.setup / second.setup):.3f} "
        f"(B/A medians {first.setup:.3f} and {second.setup:.3f})",
    ]
    if first.stream is not None and second.stream is not None:
        lines.append(
            f"  CPU per chunk {math.sqrt(first.stream / second.stream):.3f} "
            f"(B/A medians {first.stream:.3f} and {second.stream:.3f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
