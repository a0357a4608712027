"""Refusal storm: do refused connects hurt the streams already admitted?

    python bench/reject_storm.py                 # 50 streams, 500 refused connects/s for 5 s
    python bench/reject_storm.py --quick         # smoke: 10 streams, 100/s, 1 s windows
    python bench/reject_storm.py --json out.json

Headroom (``headroom serve``, one replica capped at ``--active`` sessions, queue off)
in front of the paced upstream of ``bench/wsload.py``; ``--active`` client sessions
fill the cap and stream 9.6 KB chunks every ``--pacing-ms``. Three windows of equal
length, back to back: ``before`` (streams only), ``storm`` (a separate process opens
``--rate`` WebSocket connects per second, each refused with 503 ``pool_full`` at the
handshake), ``after`` (streams only). Per window: the active streams' inter-chunk gap
p50/p99 and latency p99, Headroom's CPU; for the storm: refusals answered, their
answer time, and Headroom's CPU per refusal. The issue's target: the storm moves the
active streams' p99 gap by <= 5 ms (storm vs before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/reject_storm.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # type: ignore[import-not-found,unused-ignore]
    Processes,
    Worker,
    cpu_busy,
    gc_summary,
    machine_facts,
    percentile,
    raise_fd_limit,
    read_samples,
    sample,
    start_relay,
    start_upstreams,
)

GAP_MOVE_MAX_MS = 5.0


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


async def _window(
    name: str,
    active: Worker,
    pids: list[int],
    seconds: float,
    run_dir: Path,
    storm: Worker | None = None,
    rate: float = 0.0,
    gc_log: Path | None = None,
) -> dict[str, Any]:
    await active.call("mark", "marked", 10.0)
    s0 = sample(pids)
    b0 = cpu_busy()
    stormed: dict[str, Any] | None = None
    if storm is not None:
        stormed = await storm.call("storm", "stormed", seconds + 30.0, rate=rate, seconds=seconds)
    else:
        await asyncio.sleep(seconds)
    s1 = sample(pids)
    b1 = cpu_busy()
    out = run_dir / name
    stopped = await active.call("stop", "stopped", 30.0, out=str(out))
    gaps = read_samples([out.with_suffix(".gap")])
    lat = read_samples([out.with_suffix(".lat")])
    elapsed = (s1.at_ns - s0.at_ns) / 1e9
    result: dict[str, Any] = {
        "window": name,
        "seconds": _r(elapsed),
        "chunks": int(stopped["chunks"]),
        "gap_ms": {
            "p50": _r(percentile(gaps, 50)),
            "p99": _r(percentile(gaps, 99)),
            "max": _r(gaps[-1] / 1e6 if gaps else None),
            "samples": len(gaps),
        },
        "latency_ms": {"p50": _r(percentile(lat, 50)), "p99": _r(percentile(lat, 99))},
        "relay_cpu_cores": _r((s1.cpu_ns - s0.cpu_ns) / (s1.at_ns - s0.at_ns)),
        "relay_cpu_ns": s1.cpu_ns - s0.cpu_ns,
        "relay_rss_kb": s1.rss_kb,
        "machine_busy": _r((b1[0] - b0[0]) / max(1, b1[1] - b0[1])),
        "sessions_alive": int(stopped["alive"]),
    }
    if gc_log is not None:
        result["gc"] = gc_summary(gc_log, s0.at_ns, s1.at_ns)
    if stormed is not None:
        result["storm"] = {
            "attempts": stormed["attempts"],
            "rate_per_s": _r(stormed["attempts"] / max(stormed["seconds"], 1e-9), 1),
            "outcomes": stormed["outcomes"],
            "answer_ms_p50": _r(stormed["answer_ms_p50"]),
            "answer_ms_p99": _r(stormed["answer_ms_p99"]),
        }
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_fd_limit()
    procs = Processes()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="headroom-storm-"))
    started = time.monotonic()
    try:
        upstream, port = await start_upstreams(procs, 1, args.pacing_ms, args.chunk_bytes)
        gc_log = run_dir / "gc.log" if args.gc_trace or args.gc_freeze else None
        relay = await start_relay(
            procs, "headroom", run_dir, port, max_sessions=args.active, protocol=args.protocol,
            gc_trace=gc_log, gc_freeze_s=1.0 if args.gc_freeze else None,
        )  # fmt: skip
        pids = relay.pids()
        active, _ = await Worker.start(procs, "active", "clients", "--url", relay.url)
        storm, _ = await Worker.start(
            procs, "storm", "clients", "--url", relay.url, "--timeout-s", "5"
        )
        connected = await active.call(
            "connect", "connected", 60.0, n=args.active, concurrency=args.active
        )
        if int(connected["ok"]) != args.active:
            raise RuntimeError(f"only {connected['ok']} of {args.active} streams admitted")
        await active.call("start", "started", 10.0)
        await asyncio.sleep(args.warmup)
        before = await _window("before", active, pids, args.window, run_dir, gc_log=gc_log)
        during = await _window(
            "storm", active, pids, args.window, run_dir, storm, args.rate, gc_log=gc_log
        )
        after = await _window("after", active, pids, args.window, run_dir, gc_log=gc_log)
        await active.call("close", "closed", 30.0)
        _ = upstream
    except BaseException:
        print(f"logs kept in {run_dir}", file=sys.stderr)
        raise
    else:
        if not args.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        await procs.stop_all()
    windows = [before, during, after]
    storm_info = during["storm"]
    refused = int(storm_info["outcomes"].get("503", 0))
    base_rate = before["relay_cpu_ns"] / max(before["seconds"], 1e-9)
    extra_ns = during["relay_cpu_ns"] - base_rate * during["seconds"]
    moved = (
        during["gap_ms"]["p99"] - before["gap_ms"]["p99"]
        if during["gap_ms"]["p99"] is not None and before["gap_ms"]["p99"] is not None
        else None
    )
    return {
        "benchmark": "reject_storm",
        "machine": machine_facts(),
        "config": {
            "active": args.active,
            "pacing_ms": args.pacing_ms,
            "chunk_bytes": args.chunk_bytes,
            "rate_per_s": args.rate,
            "window_s": args.window,
            "warmup_s": args.warmup,
            "protocol": args.protocol,
            "gc_freeze": args.gc_freeze,
            "command": " ".join(sys.argv),
        },
        "elapsed_s": _r(time.monotonic() - started, 1),
        "windows": windows,
        "refused": refused,
        "relay_cpu_us_per_refusal": _r(extra_ns / 1e3 / refused, 1) if refused else None,
        "gap_p99_moved_ms": _r(moved),
        "target": {
            "value": _r(moved),
            "limit": GAP_MOVE_MAX_MS,
            "ok": None if moved is None else bool(moved <= GAP_MOVE_MAX_MS),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))

    lines = [
        "| window | gap p50 ms | gap p99 ms | gap max ms | latency p99 ms | Headroom cores "
        "| machine busy | refusals/s | answered 503 | 503 answer p50/p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in result["windows"]:
        s = w.get("storm")
        lines.append(
            f"| {w['window']} | {f(w['gap_ms']['p50'])} | {f(w['gap_ms']['p99'])} "
            f"| {f(w['gap_ms']['max'])} | {f(w['latency_ms']['p99'])} "
            f"| {f(w['relay_cpu_cores'])} | {f(w['machine_busy'])} "
            f"| {f(s['rate_per_s'], 0) if s else '-'} "
            f"| {s['outcomes'].get('503', 0) if s else '-'} "
            f"| {f(s['answer_ms_p50']) + ' / ' + f(s['answer_ms_p99']) if s else '-'} |"
        )
    t = result["target"]
    met = "not measured" if t["ok"] is None else ("yes" if t["ok"] else "NO")
    lines += [
        "",
        f"p99 gap moved by the storm: {f(t['value'])} ms (limit {t['limit']:g} ms): {met}; "
        f"Headroom CPU per refusal: {f(result['relay_cpu_us_per_refusal'], 0)} us",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--active", type=int, default=50, help="streaming sessions (= the cap)")
    p.add_argument("--rate", type=float, default=500.0, help="refused connects per second")
    p.add_argument("--window", type=float, default=5.0, help="seconds per window (and storm)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--pacing-ms", type=float, default=40.0)
    p.add_argument("--chunk-bytes", type=int, default=9600)
    p.add_argument("--protocol", default="vllm-omni-speech-ws")
    p.add_argument("--quick", action="store_true", help="smoke: 10 streams, 100/s, 1 s windows")
    p.add_argument("--gc-trace", action="store_true", help="log Headroom's GC passes")
    p.add_argument(
        "--gc-freeze", action="store_true", help="what-if: gc.freeze() Headroom after start"
    )
    p.add_argument("--json", metavar="OUT")
    p.add_argument("--run-dir")
    args = p.parse_args(argv)
    if args.quick:
        args.active, args.rate, args.window, args.warmup = 10, 100.0, 1.0, 0.3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
