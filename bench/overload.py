"""The overload proof: the same closed-loop load far above a GPU's ceiling, once through
Headroom and once straight to the engine, side by side.

    python -m bench.overload [--preset h100-orpheus-3b] [--load 3] [--hold 60]
                             [--warmup 10] [--protocol vllm-omni-speech-ws] [--json OUT]
                             [--cap N | --cap-from PROBE.json] [--clients K]
                             [--codec-chunk-ramp LIST]

It starts ``headroom sim`` (one simulated GPU) and ``headroom serve`` as separate
processes, caps Headroom at a ceiling -- ``--cap-from`` the JSON of a ``headroom probe``
run against the same simulated engine (the low end of the ``ceiling_range`` the probe
measured), ``--cap N``, or by default the simulator's own model (``headroom sim
--describe``'s ``recommended_cap``: the low end of the ceiling over seeds) -- with the guard on
(enforce) and no queue, then offers ``load x ceiling`` closed-loop users for ``warmup +
hold`` seconds to each target with ``headroom probe``'s client and metering (a refused
user retries after ``min(Retry-After, 1 s)``, so the offered load stays at ``load x
ceiling``). The users are split over ``--clients`` load-generator processes (default 4,
each its own Python interpreter and event loop, started together on the shared
monotonic clock), so that one process's scheduling is not mistaken for the engine's
tail; their traces are merged and analysed once. ``--codec-chunk-ramp`` runs the
simulated engine with vLLM-Omni's ``codec_chunk_ramp``. Reported for each target, over
the hold window (the warm-up is excluded; with several processes, the window they all
held):

- ``sessions_started``: sessions the target took (not refused);
- ``sessions_refused``: sessions refused (503 / close 1013);
- ``underruns``: modelled client playback underruns over the admitted sessions;
- ``worst_delivery_ratio``: worst-1% per-chunk delivery ratio (audio s / wall s);
- ``p99_gap_s``: p99 gap between consecutive audio chunks;
- ``refusal_latency_p99_s``: connect attempt to refusal, p99.

All traffic stays on 127.0.0.1; every phase is bounded in time; child processes are
always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import yaml

from proxy.probe.analysis import (
    Arrival,
    LevelStats,
    LevelWindow,
    SessionTrace,
    level_stats,
    quantile,
)
from proxy.probe.probe_session import ClientOptions, endpoint_url
from proxy.probe.ramp import ProbeSettings, run_probe
from proxy.probe.workload import bundled
from proxy.sim.capacity import describe
from proxy.sim.chunks import parse_ramp
from proxy.sim.presets import Preset, get_preset

__all__ = ["main", "recommended_cap", "run_overload"]

_PY = [sys.executable, "-m", "proxy.process.cli"]


async def _read_line(proc: asyncio.subprocess.Process, stream: str, prefix: str) -> str:
    reader = proc.stdout if stream == "stdout" else proc.stderr
    assert reader is not None
    while True:
        line = (await reader.readline()).decode()
        if not line:
            raise RuntimeError(f"child exited before printing {prefix!r}")
        if line.startswith(prefix):
            return line.strip()


@contextlib.asynccontextmanager
async def _child(
    args: list[str], stream: str, prefix: str, keep: deque[str] | None = None
) -> AsyncIterator[str]:
    """Start a child in its own process group; yield the first line starting with
    ``prefix`` on ``stream``; always stop it. What it prints after that line is read and
    dropped, or appended line by line to ``keep`` (bounded by its ``maxlen``)."""
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    drain: asyncio.Task[Any] | None = None
    try:
        line = await asyncio.wait_for(_read_line(proc, stream, prefix), 60)
        other = proc.stderr if stream == "stdout" else proc.stdout
        assert other is not None
        drain = asyncio.ensure_future(_discard(proc, other, keep))  # never let a pipe fill
        yield line
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if drain is not None:
            if keep is not None:  # what it printed before it stopped, to the end
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(drain), 5)
            drain.cancel()


@contextlib.asynccontextmanager
async def worker_processes(
    cmds: list[list[str]],
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Start every load-generator command in its own process group; on the way out,
    kill the group of any still running."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for cmd in cmds:
            procs.append(await asyncio.create_subprocess_exec(*cmd, start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                await p.wait()


async def wait_workers(procs: list[asyncio.subprocess.Process], deadline: float) -> None:
    """Wait up to ``deadline`` seconds for every process; raise unless all exited 0."""
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), deadline)
    if any(codes):
        raise RuntimeError(f"load-generator processes exited with {codes}")


async def _discard(
    proc: asyncio.subprocess.Process,
    other: asyncio.StreamReader,
    keep: deque[str] | None = None,
) -> None:
    streams = [other]
    if proc.stdout is not None and proc.stdout is not other:
        streams.append(proc.stdout)
    if proc.stderr is not None and proc.stderr is not other:
        streams.append(proc.stderr)

    async def sink(reader: asyncio.StreamReader) -> None:
        if keep is None:
            while await reader.read(65536):
                pass
            return
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # a line over the reader's limit: dropped, not kept
                continue
            if not line:
                return
            keep.append(line.decode(errors="replace").rstrip())

    await asyncio.gather(*(sink(s) for s in streams))


def _headroom_config(
    sim_url: str, preset: Any, cap: int, protocol: str, window_s: float
) -> dict[str, Any]:
    path = "/v1/audio/speech/stream" if protocol == "vllm-omni-speech-ws" else "/v1/audio/speech"
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "log_level": "warning",
        "log_format": "text",
        "guard": {"mode": "enforce", "threshold": 1.2, "hysteresis": 0.1, "hold_s": 5,
                  "min_samples": 50},
        "meter": {"window_s": window_s},
        "pools": [{"name": "tts-main", "queue": {"max_depth": 0, "max_wait_s": 10},
                   "replicas": [{"name": "gpu0", "url": sim_url, "max_sessions": cap}]}],
        "routes": [{"path": path, "pool": "tts-main", "protocol": protocol,
                    "audio": {"sample_rate": preset.sample_rate}}],
    }  # fmt: skip


def _figures(window: LevelWindow, traces: list[SessionTrace], stats: LevelStats) -> dict[str, Any]:
    in_window = [t for t in traces if window.contains(t.started_at)]
    refused = [t for t in in_window if t.outcome == "refused"]
    return {
        "users": window.level,
        "sessions_started": sum(1 for t in in_window if t.outcome != "refused"),
        "sessions_refused": len(refused),
        "underruns": stats.underruns,
        "startup_stalls": stats.startup_stalls,
        "stall_s": round(stats.stall_s, 3),
        "worst_delivery_ratio": stats.worst_1pct,
        "median_delivery_ratio": stats.median_ratio,
        "p99_gap_s": stats.p99_gap_s,
        "ttfa_p99_s": stats.ttfa_p99_s,
        "errors": stats.errors,
        "refusal_latency_p99_s": quantile([t.ended_at - t.started_at for t in refused], 0.99),
        "throughput_audio_s_per_s": stats.throughput,
        "chunks": stats.chunks,
        "hold_s": round(window.hold_s, 2),
    }


def _trace_json(trace: SessionTrace) -> dict[str, Any]:
    return {
        "started_at": trace.started_at,
        "ended_at": trace.ended_at,
        "outcome": trace.outcome,
        "arrivals": [[a.at, a.audio_s, a.gap, a.ratio] for a in trace.arrivals],
        "underruns": [list(u) for u in trace.underruns],
        "detail": trace.detail,
    }


def _trace_from(data: dict[str, Any]) -> SessionTrace:
    return SessionTrace(
        started_at=data["started_at"],
        ended_at=data["ended_at"],
        outcome=data["outcome"],
        arrivals=tuple(Arrival(*a) for a in data["arrivals"]),
        underruns=tuple((at, stall) for at, stall in data["underruns"]),
        detail=data["detail"],
    )


def _probe_settings(url: str, args: argparse.Namespace, users: int, model: str) -> ProbeSettings:
    return ProbeSettings(
        client=ClientOptions(
            url=endpoint_url(url, args.protocol), protocol=args.protocol, model=model
        ),
        workload=bundled("tts"),
        levels=(users,),
        extend=False,
        bisect=False,
        hold_s=args.hold,
        warmup_s=args.warmup,
        seed=args.seed,
        time_limit_s=args.warmup + args.hold + 120,
        session_timeout_s=120,
        max_error_rate=1.0,
        preflight=False,
    )


async def run_worker(settings: ProbeSettings, start_at: float, traces_out: str) -> int:
    """One load-generator process's run: from the shared monotonic instant ``start_at``,
    one probe level; its window and traces go to ``traces_out`` as JSON."""
    delay = start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    result = await run_probe(settings, clock=time.monotonic)
    run = result.runs[0]
    w = run.window
    data = {
        "window": [w.level, w.started_at, w.warm_end, w.ended_at, w.complete],
        "traces": [_trace_json(t) for t in run.traces],
    }
    await asyncio.to_thread(Path(traces_out).write_text, json.dumps(data))
    return 0


async def _worker(args: argparse.Namespace) -> int:
    """One load-generator process: ``--users`` users against ``--worker`` from
    ``--start-at``, traces to ``--traces-out``."""
    settings = _probe_settings(args.worker, args, args.users, args.model)
    return await run_worker(settings, args.start_at, args.traces_out)


async def _measure(url: str, args: argparse.Namespace, users: int, model: str) -> dict[str, Any]:
    """``users`` closed-loop users against ``url``, split over ``args.clients`` worker
    processes; their traces merged and analysed over the window every worker held."""
    clients = max(1, min(args.clients, users))
    shares = [users // clients + (i < users % clients) for i in range(clients)]
    start_at = time.monotonic() + 3.0 + 0.5 * clients  # every interpreter up and waiting
    with tempfile.TemporaryDirectory() as tmp:
        cmds, outs = [], []
        for i, share in enumerate(shares):
            out = Path(tmp) / f"worker{i}.json"
            outs.append(out)
            cmds.append([sys.executable, "-m", "bench.overload", "--worker", url,
                         "--users", str(share), "--start-at", repr(start_at),
                         "--traces-out", str(out), "--model", model,
                         "--protocol", args.protocol,
                         "--hold", str(args.hold), "--warmup", str(args.warmup),
                         "--seed", str(args.seed + 1000 * i)])  # fmt: skip
        async with worker_processes(cmds) as procs:
            await wait_workers(procs, args.warmup + args.hold + 240)
        traces: list[SessionTrace] = []
        windows = []
        for out in outs:
            data = json.loads(out.read_text())
            windows.append(data["window"])
            traces += [_trace_from(t) for t in data["traces"]]
    window = LevelWindow(
        level=users,
        started_at=min(w[1] for w in windows),
        warm_end=max(w[2] for w in windows),
        ended_at=min(w[3] for w in windows),
        complete=all(w[4] for w in windows),
    )
    stats = level_stats(window, traces, threshold=1.2, max_error_rate=1.0, max_stall_share=0.0)
    figures = _figures(window, traces, stats)
    figures["clients"] = clients
    return figures


def _preset(args: argparse.Namespace) -> Preset:
    preset = get_preset(args.preset)
    if args.codec_chunk_ramp:
        preset = preset.with_schedule(ramp=parse_ramp(args.codec_chunk_ramp))
    return preset


def _cap(args: argparse.Namespace, preset: Preset) -> tuple[int, str]:
    """Headroom's cap and where it came from."""
    if args.cap:
        return int(args.cap), "--cap"
    if args.cap_from:
        probe = json.loads(Path(args.cap_from).read_text())
        low = int((probe.get("ceiling_range") or [probe["ceiling"]])[0])
        if low < 1:
            raise SystemExit(f"{args.cap_from}: the probe's ceiling is {low}: no cap")
        return low, f"headroom probe ({args.cap_from}), the low end of its ceiling_range"
    return recommended_cap(preset if args.codec_chunk_ramp else preset.name)


def recommended_cap(target: Preset | str) -> tuple[int, str]:
    """``headroom sim --describe``'s ``recommended_cap`` of ``target`` (the largest level
    every seed of the ceiling range passes) and where it came from; SystemExit when no
    level passes on every seed."""
    info = describe(target)
    name = target if isinstance(target, str) else target.name
    low, high = info["ceiling_range"]
    if int(info["recommended_cap"]) < 1:
        raise SystemExit(f"{name}: no level keeps the rules on every seed: no cap")
    seeds = ", ".join(info["ceiling_by_seed"])
    return int(info["recommended_cap"]), (
        f"headroom sim --describe's recommended_cap: every seed passes there; ceiling "
        f"{low}-{high} over seeds {seeds}"
    )


async def run_overload(args: argparse.Namespace) -> dict[str, Any]:
    preset = _preset(args)
    ceiling, source = _cap(args, preset)
    users = max(1, round(args.load * ceiling))
    started = time.monotonic()
    out: dict[str, Any] = {
        "preset": preset.name,
        "chunk_schedule": preset.schedule.describe(),
        "protocol": args.protocol,
        "ceiling": ceiling,
        "ceiling_from": source,
        "load_factor": args.load,
        "users": users,
        "clients": args.clients,
        "hold_s": args.hold,
        "warmup_s": args.warmup,
        "loadavg_before": os.getloadavg(),
    }
    sim_args = [*_PY, "sim", "--preset", preset.name, "--gpus", "1", "--port", "0", "--json"]
    if args.codec_chunk_ramp:
        sim_args += ["--codec-chunk-ramp", args.codec_chunk_ramp]
    async with _child(sim_args, "stdout", "{") as line:
        sim_url = json.loads(line)["urls"][0]
        print(f"direct: {users} users -> {sim_url} ({preset.name}, ceiling {ceiling})",
              file=sys.stderr)  # fmt: skip
        out["direct"] = await _measure(sim_url, args, users, preset.model)
        await asyncio.sleep(2)  # let the engine drain before the second phase
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "headroom.yaml"
            settings = _headroom_config(sim_url, preset, ceiling, args.protocol, args.window)
            config.write_text(yaml.safe_dump(settings))
            serve = [*_PY, "serve", "--config", str(config)]
            async with _child(serve, "stderr", "headroom: serving on ") as banner:
                proxy_url = banner.rsplit(" ", 1)[-1]
                print(f"headroom: {users} users -> {proxy_url} (cap {ceiling}, guard enforce)",
                      file=sys.stderr)  # fmt: skip
                out["headroom"] = await _measure(proxy_url, args, users, preset.model)
    out["loadavg_after"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - started, 1)
    return out


_ROWS = (
    ("sessions_started", "sessions started", "{:d}"),
    ("sessions_refused", "sessions refused", "{:d}"),
    ("underruns", "modelled underruns (admitted)", "{:d}"),
    ("startup_stalls", "first-seam stalls (streams)", "{:d}"),
    ("stall_s", "modelled stall seconds", "{:.2f}"),
    ("worst_delivery_ratio", "worst-1% delivery ratio", "{:.2f}"),
    ("median_delivery_ratio", "median delivery ratio", "{:.2f}"),
    ("p99_gap_s", "p99 chunk gap (s)", "{:.3f}"),
    ("ttfa_p99_s", "time to first audio p99 (s)", "{:.3f}"),
    ("refusal_latency_p99_s", "refusal latency p99 (s)", "{:.4f}"),
    ("errors", "errors", "{:d}"),
)


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Overload: {result['users']} closed-loop users = {result['load_factor']:g}x the "
        f"ceiling ({result['ceiling']}, from {result.get('ceiling_from', '?')}) of "
        f"{result['preset']} (chunks {result.get('chunk_schedule', '?')}), "
        f"{result['protocol']}, {result['hold_s']:g} s measured after "
        f"{result['warmup_s']:g} s warm-up, load generated by {result.get('clients', 1)} "
        "processes",
        "",
        f"| {'':32} | {'headroom':>10} | {'direct':>10} |",
        f"|{'-' * 34}|{'-' * 12}|{'-' * 12}|",
    ]
    for key, label, fmt in _ROWS:
        cells = []
        for side in ("headroom", "direct"):
            value = result[side].get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(f"| {label:32} | {cells[0]:>10} | {cells[1]:>10} |")
    before, after = result.get("loadavg_before"), result.get("loadavg_after")
    if before and after:
        lines += ["", f"load average (1, 5, 15 min): before {_loads(before)}, after "
                  f"{_loads(after)} ({os.cpu_count()} CPUs)"]  # fmt: skip
    return "\n".join(lines)


def _loads(values: list[float] | tuple[float, ...]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="h100-orpheus-3b")
    parser.add_argument("--load", type=float, default=3.0, help="offered load x ceiling")
    parser.add_argument(
        "--cap", type=int,
        help="Headroom's cap (default: describe's recommended_cap, the low end of the ceiling "
        "over seeds)",
    )  # fmt: skip
    parser.add_argument("--cap-from", metavar="PROBE_JSON",
                        help="cap at the ceiling of this headroom probe --json result")  # fmt: skip
    parser.add_argument("--codec-chunk-ramp", metavar="LIST",
                        help="vLLM-Omni codec_chunk_ramp, e.g. 4,4,8,16,25")  # fmt: skip
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--hold", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0, help="excluded seconds")
    parser.add_argument("--window", type=float, default=10.0, help="guard window (s)")
    parser.add_argument("--protocol", default="vllm-omni-speech-ws",
                        choices=["vllm-omni-speech-ws", "openai-speech-http"])  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    # A load-generator process (started by _measure, not by hand).
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--traces-out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser


def run_bench(
    args: argparse.Namespace,
    worker: Callable[[argparse.Namespace], Awaitable[int]],
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """The main of a bench with load-generator processes: with ``--worker``, one such
    process; otherwise the run, its table printed and its figures written to ``--json``."""
    if args.worker:
        return asyncio.run(worker(args))
    result = asyncio.run(run(args))
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1:
        raise SystemExit("--clients must be >= 1")
    return run_bench(args, _worker, run_overload, render)


if __name__ == "__main__":
    sys.exit(main())
