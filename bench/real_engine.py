"""The real-engine tier: Headroom's probe and overload proof against llama.cpp's server.

    python -m bench.real_engine [--tokens-per-audio-second 8] [--levels 2,4,...]
                                [--hold 20] [--warmup 6] [--repeat 2] [--load 3]
                                [--overload-hold 40] [--overload-warmup 8] [--clients 2]
                                [--workload FILE] [--cache DIR] [--json OUT]

It builds (or reuses) ``llama-server`` from the pinned sdist (:mod:`bench.llama_engine`),
writes the random-weight model (:mod:`bench.tiny_model`; kept in the cache), starts the
server on 127.0.0.1 with 16 continuous-batching slots, and speaks
``openai-completions-tokens`` to it: every generated token is ``1/tokens_per_audio_second``
of audio. Then, as :mod:`bench.overload` does with the simulator:

1. ``headroom probe`` (a child process) finds the engine's ceiling: the worst-1 % delivery
   ratio, the modelled playback and TTFA rules, repeats around the knee;
2. ``load x ceiling`` closed-loop users straight at the engine, then through ``headroom
   serve`` capped at the probed ceiling (guard enforce, no queue), each with ``--clients``
   load-generator processes, metered with the probe's client and adapters.

``--engine-url`` runs steps 1 and 2 against an engine already running (the simulator's
completions endpoint, for instance) instead of building and starting llama-server. All
traffic stays on 127.0.0.1; every phase is bounded in time; children are always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from bench.harness import free_port
from bench.llama_engine import default_cache, ensure_llama_server, llama_server
from bench.overload import _child, _figures, _trace_from, run_worker, wait_workers, worker_processes
from bench.tiny_model import TinyModel, ensure_model
from proxy.probe.analysis import LevelWindow, SessionTrace, level_stats
from proxy.probe.probe_session import ClientOptions, endpoint_url
from proxy.probe.ramp import ProbeSettings
from proxy.probe.workload import Workload, bundled, load_workload

__all__ = ["engine_figures", "main", "render", "run_on_engine"]

_PY = [sys.executable, "-m", "proxy.process.cli"]
PROTOCOL = "openai-completions-tokens"
PATH = "/v1/completions"


def _headroom_config(engine_url: str, cap: int, tokens: float, window_s: float) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "log_level": "warning",
        "log_format": "text",
        "guard": {"mode": "enforce", "threshold": 1.2, "hysteresis": 0.1, "hold_s": 5,
                  "min_samples": 50},
        "meter": {"window_s": window_s},
        "pools": [{"name": "tts-main", "queue": {"max_depth": 0, "max_wait_s": 10},
                   "replicas": [{"name": "engine0", "url": engine_url, "max_sessions": cap}]}],
        "routes": [{"path": PATH, "pool": "tts-main", "protocol": PROTOCOL,
                    "tokens_per_audio_second": tokens}],
    }  # fmt: skip


def _workload(args: argparse.Namespace) -> Workload:
    """``--workload``'s file, else the probe's bundled TTS texts."""
    if not args.workload:
        return bundled("tts")
    path = Path(args.workload)
    return load_workload(path.read_text("utf-8"), str(path), path.parent)


def _settings(url: str, args: argparse.Namespace, users: int, seed: int) -> ProbeSettings:
    client = ClientOptions(url=endpoint_url(url, PROTOCOL), protocol=PROTOCOL,
                           tokens_per_audio_second=args.tokens_per_audio_second)  # fmt: skip
    return ProbeSettings(
        client=client,
        workload=_workload(args),
        levels=(users,),
        extend=False,
        bisect=False,
        hold_s=args.overload_hold,
        warmup_s=args.overload_warmup,
        seed=seed,
        time_limit_s=args.overload_warmup + args.overload_hold + 120,
        session_timeout_s=300,
        max_error_rate=1.0,
        preflight=False,
    )


async def _measure(url: str, args: argparse.Namespace, users: int) -> dict[str, Any]:
    """``users`` closed-loop users against ``url`` over ``--clients`` processes."""
    clients = max(1, min(args.clients, users))
    shares = [users // clients + (i < users % clients) for i in range(clients)]
    start_at = time.monotonic() + 3.0 + 0.5 * clients
    with tempfile.TemporaryDirectory() as tmp:
        cmds, outs = [], []
        for i, share in enumerate(shares):
            out = Path(tmp) / f"worker{i}.json"
            outs.append(out)
            cmds.append([sys.executable, "-m", "bench.real_engine", "--worker", url,
                         "--users", str(share), "--start-at", repr(start_at),
                         "--traces-out", str(out), "--seed", str(args.seed + 1000 * i),
                         "--tokens-per-audio-second", str(args.tokens_per_audio_second),
                         "--overload-hold", str(args.overload_hold),
                         "--overload-warmup", str(args.overload_warmup),
                         *(["--workload", args.workload] if args.workload else [])])  # fmt: skip
        async with worker_processes(cmds) as procs:
            await wait_workers(procs, args.overload_warmup + args.overload_hold + 300)
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
    figures["tokens_per_s"] = (
        None
        if stats.throughput is None
        else round(stats.throughput * args.tokens_per_audio_second, 1)
    )
    return figures


async def _probe(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``headroom probe`` against ``url`` in a child process; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        cmd = [*_PY, "probe", "--target", url, "--protocol", PROTOCOL,
               "--tokens-per-audio-second", str(args.tokens_per_audio_second),
               "--levels", args.levels, "--max-level", str(args.max_level),
               "--hold", str(args.hold), "--warmup", str(args.warmup),
               "--repeat", str(args.repeat), "--seed", str(args.seed),
               "--ttfa-limit", str(args.ttfa_limit),
               "--time-limit", str(args.probe_time_limit), "--session-timeout", "300",
               *(["--workload", args.workload] if args.workload else []),
               "--quiet", "--json", str(out)]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), args.probe_time_limit + 120)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"headroom probe exited {proc.returncode}:\n{stderr.decode(errors='replace')}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
        result["table"] = stdout.decode(errors="replace")
        return result


async def run_on_engine(engine_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Probe the engine, then the overload at the probed cap, direct and through Headroom."""
    out: dict[str, Any] = {"engine_url": engine_url, "protocol": PROTOCOL,
                           "tokens_per_audio_second": args.tokens_per_audio_second,
                           "loadavg_before": os.getloadavg()}  # fmt: skip
    started = time.monotonic()
    probe = await _probe(engine_url, args)
    out["probe"] = {k: probe[k] for k in ("ceiling", "exact", "bracket", "ceiling_range",
                                          "limited_by", "trials", "duration_s", "levels",
                                          "estimates", "settings")}  # fmt: skip
    out["probe_table"] = probe["table"]
    # The low end of the range seen: every trial of that level passed.
    cap = int(args.cap or probe["ceiling_range"][0])
    if cap < 1:
        raise RuntimeError(f"the probe found no passing level (range {probe['ceiling_range']})")
    users = max(1, round(args.load * cap), args.min_users)
    out.update(cap=cap, load_factor=args.load, users=users, clients=args.clients,
               overload_hold_s=args.overload_hold,
               overload_warmup_s=args.overload_warmup)  # fmt: skip
    print(f"direct: {users} users -> {engine_url} (cap {cap})", file=sys.stderr)
    out["direct"] = await _measure(engine_url, args, users)
    await asyncio.sleep(3)  # let the engine finish the cut streams
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "headroom.yaml"
        settings = _headroom_config(engine_url, cap, args.tokens_per_audio_second, args.window)
        config.write_text(yaml.safe_dump(settings))
        serve = [*_PY, "serve", "--config", str(config)]
        async with _child(serve, "stderr", "headroom: serving on ") as banner:
            proxy_url = banner.rsplit(" ", 1)[-1]
            print(f"headroom: {users} users -> {proxy_url} (cap {cap})", file=sys.stderr)
            out["headroom"] = await _measure(proxy_url, args, users)
    out["loadavg_after"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - started, 1)
    return out


@contextlib.asynccontextmanager
async def _engine(args: argparse.Namespace) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The engine's URL and what it is: the given one, or llama-server started here."""
    if args.engine_url:
        yield args.engine_url, {"engine": "given", "url": args.engine_url}
        return
    cache = args.cache or default_cache()
    started = time.monotonic()
    binary = await asyncio.to_thread(ensure_llama_server, cache)
    built_s = round(time.monotonic() - started, 1)
    shape = TinyModel(layers=args.layers, hidden=args.hidden, ff=args.ff)
    model = await asyncio.to_thread(ensure_model, cache, shape)
    info = {"engine": "llama-server", "binary": str(binary), "build_or_find_s": built_s,
            "model": model.name, "parameters_m": round(shape.parameters / 1e6, 1),
            "slots": args.slots, "threads": args.threads, "batch": args.batch}  # fmt: skip
    async with llama_server(binary, model, free_port(), slots=args.slots,
                            threads=args.threads, batch=args.batch) as url:  # fmt: skip
        yield url, info


async def engine_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run: the engine, the probe, the overload."""
    async with _engine(args) as (url, info):
        result = await run_on_engine(url, args)
    result["engine"] = info
    return result


_ROWS = (
    ("sessions_started", "sessions started", "{:d}"),
    ("sessions_refused", "sessions refused", "{:d}"),
    ("underruns", "modelled underruns (admitted)", "{:d}"),
    ("stall_s", "modelled stall seconds", "{:.2f}"),
    ("worst_delivery_ratio", "worst-1% delivery ratio", "{:.2f}"),
    ("median_delivery_ratio", "median delivery ratio", "{:.2f}"),
    ("p99_gap_s", "p99 token gap (s)", "{:.3f}"),
    ("ttfa_p99_s", "time to first token p99 (s)", "{:.3f}"),
    ("tokens_per_s", "engine tokens/s (hold)", "{:.0f}"),
    ("refusal_latency_p99_s", "refusal latency p99 (s)", "{:.4f}"),
    ("errors", "errors", "{:d}"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def render(result: dict[str, Any]) -> str:
    """The probe's levels and the overload, as markdown tables."""
    probe, tps = result["probe"], result["tokens_per_audio_second"]
    low, high = probe["ceiling_range"]
    trials = ", ".join(f"{k}: {v['passed']}/{v['runs']}" for k, v in probe["trials"].items())
    lines = [
        f"Probe: ceiling {probe['ceiling']} (range {low}-{high}; trials {trials}; limited by "
        f"{', '.join(probe['limited_by']) or '-'}), {tps:g} tokens per audio second",
        "",
        "| level | verdict | worst-1% | median | p99 gap (s) | TTFA p99 (s) | underruns "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lv in probe["levels"]:
        thr = lv["throughput"]
        lines.append(
            f"| {lv['level']} | {lv['verdict']} | {_cell(lv['worst_1pct'], '{:.2f}')} | "
            f"{_cell(lv['median_ratio'], '{:.2f}')} | {_cell(lv['p99_gap_s'], '{:.3f}')} | "
            f"{_cell(lv['ttfa_p99_s'], '{:.2f}')} | {lv['underruns']} | "
            f"{_cell(None if thr is None else thr * tps, '{:.0f}')} |"
        )
    lines += [
        "",
        f"Overload: {result['users']} closed-loop users (at least {result['load_factor']:g}x "
        f"the cap, {result['cap']}), {result['overload_hold_s']:g} s measured after "
        f"{result['overload_warmup_s']:g} s warm-up, {result['clients']} load-generator processes",
        "",
        f"| {'':30} | {'headroom':>9} | {'direct':>9} |",
        f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|",
    ]
    for key, label, fmt in _ROWS:
        cells = [_cell(result[side].get(key), fmt) for side in ("headroom", "direct")]
        lines.append(f"| {label:30} | {cells[0]:>9} | {cells[1]:>9} |")
    before, after = result["loadavg_before"], result["loadavg_after"]
    lines += ["", f"load average (1, 5, 15 min): before {', '.join(f'{v:.2f}' for v in before)},"
              f" after {', '.join(f'{v:.2f}' for v in after)} ({os.cpu_count()} CPUs)"]  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = parser.add_argument
    a("--tokens-per-audio-second", type=float, default=8.0)
    a("--levels", default="2,4,...", help="the probe's ramp")
    a("--max-level", type=int, default=16, help="the highest level (the engine's slots)")
    a("--hold", type=float, default=20.0, help="the probe's measured seconds per level")
    a("--warmup", type=float, default=6.0, help="the probe's warm-up per level")
    a("--repeat", type=int, default=2, help="the probe's repeats around the knee")
    a("--ttfa-limit", type=float, default=3.0,
      help="the probe's TTFA p99 limit (a CPU's prefill of the workload's long texts "
           "takes 1-2 s at any concurrency)")  # fmt: skip
    a("--probe-time-limit", type=float, default=900.0)
    a("--workload", help="the probe's and the users' workload file (default: the bundled "
                         "TTS texts)")  # fmt: skip
    a("--cap", type=int, help="overload cap (default: the probed ceiling)")
    a("--load", type=float, default=3.0, help="offered load x cap")
    a("--min-users", type=int, default=0,
      help="offer at least this many users (more than the slots: the engine saturated "
           "whatever the probe found)")  # fmt: skip
    a("--overload-hold", type=float, default=40.0)
    a("--overload-warmup", type=float, default=8.0)
    a("--clients", type=int, default=2, help="load-generator processes")
    a("--window", type=float, default=10.0, help="guard window (s)")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=1, help="llama-server compute threads")
    a("--slots", type=int, default=16, help="llama-server continuous-batching slots (-np)")
    a("--batch", type=int, default=16, help="llama-server tokens per step (-b, -ub; >= slots)")
    shape = TinyModel()
    a("--layers", type=int, default=shape.layers, help="the model's shape")
    a("--hidden", type=int, default=shape.hidden)
    a("--ff", type=int, default=shape.ff)
    a("--cache", type=Path, help="engine cache (default: $HEADROOM_ENGINE_CACHE or "
                                 "~/.cache/headroom/engine)")  # fmt: skip
    a("--engine-url", help="an engine already running (skips building llama-server)")
    a("--json", metavar="OUT", help="write the figures as JSON")
    # A load-generator process (started by _measure, not by hand).
    a("--worker", metavar="URL", help=argparse.SUPPRESS)
    a("--users", type=int, help=argparse.SUPPRESS)
    a("--start-at", type=float, help=argparse.SUPPRESS)
    a("--traces-out", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        settings = _settings(args.worker, args, args.users, args.seed)
        return asyncio.run(run_worker(settings, args.start_at, args.traces_out))
    result = asyncio.run(engine_figures(args))
    print(result["probe_table"])
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
