"""Tenants and priorities, measured through real sockets (issue 18).

    python -m bench.tenants [--preset l40s-qwen3tts-1.7b] [--codec-chunk-ramp 4,4,8,16,25]
                            [--hold 60] [--warmup 15] [--backend memory|redis] [--json OUT]

Starts ``headroom sim`` (one simulated GPU) and, per phase, ``headroom serve`` with API
keys, caps the pool at the simulator's recommended cap (``headroom sim --describe``: the
largest level every seed passes) and offers
closed-loop users per key (``headroom probe``'s client and metering, each key's users in
their own load-generator process, started together on the shared monotonic clock; a
refused user retries after ``min(Retry-After, 1 s)``). Three phases:

1. ``fifo``: keys ``a`` (2x the cap in users) and ``b`` (1x) without tenant fields
   -- today's single FIFO, the baseline.
2. ``fair``: the same load, both keys ``weight: 1``.
   Reported: each key's session-seconds over the hold window (Headroom's own
   ``headroom_tenant_session_seconds_total``, scraped at the window's edges) and Jain's
   fairness index of the two (1 = equal shares; issue target >= 0.95 in ``fair``).
3. ``priority``: ``a`` and ``b`` as in ``fair``, plus ``free`` (``priority: -1``, 1x the
   cap in users) and ``gold`` (``priority: 10``, as many users as its reserve);
   the pool keeps ``reserve`` slots for class 10 and its queue holds as many waiters as
   ``a`` and ``b`` have users. Reported per key: sessions, queued share, queue wait p99
   (from ``headroom_tenant_queue_wait_seconds``; a session admitted at once waited 0),
   time to first audio p99, modelled underruns, and refusals by reason.

``--backend redis`` runs each phase's ``headroom serve`` with ``admission.backend: redis``
on a redis-server of its own (127.0.0.1, free port, no persistence; a key prefix per
phase): the same rules, applied by the shared backend's scripts.

The Headroom figures are the deltas of its ``/metrics`` over the hold window; the load
runs 5 s past it, so the users stopping is not measured. Client figures (TTFA,
underruns) come from the probe's traces over its own window (warm-up excluded).

All traffic stays on 127.0.0.1; every phase is bounded in time; child processes are
always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.overload import (
    _child,
    _preset,
    _trace_from,
    recommended_cap,
    run_bench,
    run_worker,
    wait_workers,
    worker_processes,
)
from proxy.probe.analysis import LevelWindow, SessionTrace, level_stats, quantile
from proxy.probe.probe_session import ClientOptions, endpoint_url
from proxy.probe.ramp import ProbeSettings
from proxy.probe.workload import bundled

__all__ = ["jain", "main"]

_PY = [sys.executable, "-m", "proxy.process.cli"]
_PATH = "/v1/audio/speech/stream"
_PROTOCOL = "vllm-omni-speech-ws"
#: The load goes on this long after the measured window, so that the users stopping (and
#: the queue draining into the slots they free) is not measured.
_TAIL_S = 5.0


def jain(values: list[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1 when every share is equal."""
    square = sum(v * v for v in values)
    return None if not values or square == 0 else sum(values) ** 2 / (len(values) * square)


def _key(name: str) -> str:
    return f"bench-key-{name}"


def _config(sim_url: str, preset: Any, cap: int, phase: str, users: dict[str, int],
            reserve: int, redis_url: str | None = None) -> dict[str, Any]:  # fmt: skip
    fields: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    queue = {"max_depth": sum(users.values()), "max_wait_s": 120}
    replica = {"name": "gpu0", "url": sim_url, "max_sessions": cap}
    pool: dict[str, Any] = {"name": "tts-main", "queue": queue, "replicas": [replica]}
    if phase in ("fair", "priority"):
        fields = {"a": {"weight": 1}, "b": {"weight": 1}}
    if phase == "priority":
        fields["free"] = {"priority": -1}
        fields["gold"] = {"priority": 10}
        pool["reserve"] = [{"priority": 10, "slots": reserve}]
        queue["max_depth"] = users["a"] + users["b"]
    route = {"path": _PATH, "pool": "tts-main", "protocol": _PROTOCOL,
             "audio": {"sample_rate": preset.sample_rate}}  # fmt: skip
    keys = [
        {"name": name, "sha256": hashlib.sha256(_key(name).encode()).hexdigest(), **extra}
        for name, extra in fields.items()
    ]
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},  # scraped on the client listener
        "log_level": "warning",
        "log_format": "text",
        "pools": [pool],
        "routes": [route],
        "auth": {"keys": keys},
    }
    if redis_url is not None:
        redis = {"url": redis_url, "key_prefix": f"bench-tenants-{phase}:"}
        config["admission"] = {"backend": "redis", "redis": redis}
    return config


def _probe_settings(url: str, args: argparse.Namespace) -> ProbeSettings:
    return ProbeSettings(
        client=ClientOptions(
            url=endpoint_url(url, _PROTOCOL),
            protocol=_PROTOCOL,
            model=args.model,
            headers=(("Authorization", f"Bearer {_key(args.tenant)}"),),
            open_timeout_s=150.0,  # queued sessions wait up to max_wait_s for the handshake
        ),
        workload=bundled("tts"),
        levels=(args.users,),
        extend=False,
        bisect=False,
        hold_s=args.hold,
        warmup_s=args.warmup,
        seed=args.seed,
        time_limit_s=args.warmup + args.hold + 300,
        session_timeout_s=300,
        max_error_rate=1.0,
        preflight=False,
    )


async def _worker(args: argparse.Namespace) -> int:
    """One key's users, from the shared monotonic instant ``--start-at``."""
    return await run_worker(_probe_settings(args.worker, args), args.start_at, args.traces_out)


async def _scrape(base: str) -> dict[tuple[str, str, str], float]:
    """(metric sample name, tenant, extra label) -> value, for the tenant series."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(base + "/metrics")).text
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("headroom_tenant_"):
            continue
        for s in family.samples:
            extra = s.labels.get("decision") or s.labels.get("le") or ""
            out[(s.name, s.labels["tenant"], extra)] = s.value
    return out


def _wait_p99(before: dict[Any, float], after: dict[Any, float], tenant: str) -> float | None:
    """p99 queue wait over the window from the histogram's buckets (upper bound of the
    bucket holding the 99th percentile), counting sessions admitted at once as 0."""
    name = "headroom_tenant_queue_wait_seconds_bucket"
    buckets = sorted(
        (float(le), after[(n, t, le)] - before.get((n, t, le), 0.0))
        for (n, t, le) in after
        if n == name and t == tenant
    )
    admitted = _delta(before, after, "headroom_tenant_decisions_total", tenant, "admitted")
    queued = _delta(before, after, "headroom_tenant_decisions_total", tenant, "queued")
    direct = max(0.0, admitted - queued)
    total = direct + (buckets[-1][1] if buckets else 0.0)
    if total == 0:
        return None
    if direct >= 0.99 * total:
        return 0.0
    for le, count in buckets:
        if direct + count >= 0.99 * total:
            return le
    return None


def _delta(before: dict[Any, float], after: dict[Any, float], name: str, tenant: str,
           extra: str = "") -> float:  # fmt: skip
    return after.get((name, tenant, extra), 0.0) - before.get((name, tenant, extra), 0.0)


async def _phase(sim_url: str, preset: Any, cap: int, phase: str, users: dict[str, int],
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "headroom.yaml"
        settings = _config(sim_url, preset, cap, phase, users, args.reserve,
                           getattr(args, "redis_url", None))  # fmt: skip
        config.write_text(yaml.safe_dump(settings))
        serve = [*_PY, "serve", "--config", str(config)]
        async with _child(serve, "stderr", "headroom: serving on ") as banner:
            url = banner.rsplit(" ", 1)[-1]
            base = url.replace("ws://", "http://")
            print(f"{phase}: {users} -> {url} (cap {cap})", file=sys.stderr)
            start_at = time.monotonic() + 3.0 + 0.5 * len(users)
            cmds, outs = [], {}
            for i, (tenant, n) in enumerate(users.items()):
                out = Path(tmp) / f"{tenant}.json"
                outs[tenant] = out
                cmds.append([sys.executable, "-m", "bench.tenants", "--worker", url,
                             "--tenant", tenant, "--users", str(n), "--start-at", repr(start_at),
                             "--traces-out", str(out), "--model", preset.model,
                             "--hold", str(args.hold + _TAIL_S), "--warmup", str(args.warmup),
                             "--seed", str(args.seed + 1000 * i)])  # fmt: skip
            async with worker_processes(cmds) as procs:
                await asyncio.sleep(max(0.0, start_at + args.warmup - time.monotonic()))
                before = await _scrape(base)
                await asyncio.sleep(args.hold)
                after = await _scrape(base)
                await wait_workers(procs, args.warmup + args.hold + 400)
            result: dict[str, Any] = {"users": users, "tenants": {}}
            for tenant, out in outs.items():
                data = json.loads(out.read_text())
                w = data["window"]
                window = LevelWindow(level=w[0], started_at=w[1], warm_end=w[2],
                                     ended_at=w[3], complete=w[4])  # fmt: skip
                traces: list[SessionTrace] = [_trace_from(t) for t in data["traces"]]
                stats = level_stats(window, traces, threshold=1.2, max_error_rate=1.0,
                                    max_stall_share=0.0)  # fmt: skip
                refusals = {
                    extra.removeprefix("rejected_"): after[(n, t, extra)]
                    - before.get((n, t, extra), 0.0)
                    for (n, t, extra) in after
                    if n == "headroom_tenant_decisions_total" and t == tenant
                    and extra.startswith("rejected_")
                }  # fmt: skip
                admitted = _delta(before, after, "headroom_tenant_decisions_total", tenant,
                                  "admitted")  # fmt: skip
                queued = _delta(before, after, "headroom_tenant_decisions_total", tenant,
                                "queued")  # fmt: skip
                result["tenants"][tenant] = {
                    "users": users[tenant],
                    "session_seconds": round(_delta(
                        before, after, "headroom_tenant_session_seconds_total", tenant), 1),
                    "admitted": int(admitted),
                    "queued": int(queued),
                    "queue_wait_p99_s": _wait_p99(before, after, tenant),
                    "refused": {k: int(v) for k, v in refusals.items() if v},
                    "underruns": stats.underruns,
                    "ttfa_p99_s": stats.ttfa_p99_s,
                    "worst_delivery_ratio": stats.worst_1pct,
                    "refusal_latency_p99_s": quantile(
                        [t.ended_at - t.started_at for t in traces
                         if t.outcome == "refused" and window.contains(t.started_at)], 0.99),
                }  # fmt: skip
            shares = [result["tenants"][t]["session_seconds"] for t in ("a", "b")]
            result["jain_a_b"] = jain(shares)
            return result


def pool_cap(args: argparse.Namespace, preset: Any) -> tuple[int, str]:
    """The pool's cap and where it came from: ``--cap``, else the preset's (with its
    chunk schedule) recommended cap over the simulator's seeds."""
    if args.cap:
        return int(args.cap), "--cap"
    return recommended_cap(preset if args.codec_chunk_ramp else preset.name)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = _preset(args)
    cap, cap_from = pool_cap(args, preset)
    if cap <= args.reserve:
        raise SystemExit(f"the cap ({cap}) must exceed --reserve ({args.reserve})")
    started = time.monotonic()
    out: dict[str, Any] = {
        "preset": preset.name, "chunk_schedule": preset.schedule.describe(), "cap": cap,
        "cap_from": cap_from,
        "reserve": args.reserve, "hold_s": args.hold, "warmup_s": args.warmup,
        "loadavg_before": os.getloadavg(), "phases": {},
    }  # fmt: skip
    sim_args = [*_PY, "sim", "--preset", preset.name, "--gpus", "1", "--port", "0", "--json"]
    if args.codec_chunk_ramp:
        sim_args += ["--codec-chunk-ramp", args.codec_chunk_ramp]
    base = {"a": 2 * cap, "b": cap}
    out["backend"] = args.backend
    redis = None
    if args.backend == "redis":
        from bench.admission_redis import Redis

        redis = Redis()
        args.redis_url = redis.url
    try:
        await _phases(sim_args, preset, cap, base, args, out)
    finally:
        if redis is not None:
            redis.stop()
    out["loadavg_after"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - started, 1)
    return out


async def _phases(sim_args: list[str], preset: Any, cap: int, base: dict[str, int],
                  args: argparse.Namespace, out: dict[str, Any]) -> None:  # fmt: skip
    async with _child(sim_args, "stdout", "{") as line:
        sim_url = json.loads(line)["urls"][0]
        for phase in args.phases.split(","):
            users = dict(base)
            if phase == "priority":
                users.update(free=cap, gold=args.reserve)
            out["phases"][phase] = await _phase(sim_url, preset, cap, phase, users, args)
            await asyncio.sleep(2)  # let the engine drain


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Tenants ({result.get('backend', 'memory')} admission backend): {result['preset']} "
        f"(chunks {result['chunk_schedule']}), one simulated GPU "
        f"capped at {result['cap']}, {result['hold_s']:g} s measured after "
        f"{result['warmup_s']:g} s warm-up; keys a (2x the cap in users) and b (1x) flood "
        f"together (3x); reserve {result['reserve']} for class 10 in 'priority'",
        "",
        "| phase | key | users | session-s | admitted | queued | wait p99 (s) | TTFA p99 (s) "
        "| underruns | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, r in result["phases"].items():
        for tenant, t in r["tenants"].items():
            refused = ", ".join(f"{k} {v}" for k, v in sorted(t["refused"].items())) or "0"
            wait = "-" if t["queue_wait_p99_s"] is None else f"{t['queue_wait_p99_s']:g}"
            ttfa = "-" if t["ttfa_p99_s"] is None else f"{t['ttfa_p99_s']:.2f}"
            lines.append(
                f"| {phase} | {tenant} | {t['users']} | {t['session_seconds']:.0f} | "
                f"{t['admitted']} | {t['queued']} | {wait} | {ttfa} | {t['underruns']} | "
                f"{refused} |"
            )
    lines.append("")
    for phase, r in result["phases"].items():
        j = r["jain_a_b"]
        lines.append(f"{phase}: Jain index of a's and b's session-seconds "
                     f"{'-' if j is None else f'{j:.3f}'}")  # fmt: skip
    before, after = result["loadavg_before"], result["loadavg_after"]
    lines.append(f"load average before {before[0]:.2f}, after {after[0]:.2f} "
                 f"({os.cpu_count()} CPUs)")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="l40s-qwen3tts-1.7b")
    parser.add_argument("--codec-chunk-ramp", default="4,4,8,16,25", metavar="LIST")
    parser.add_argument("--cap", type=int, help="the pool's cap (default: recommended)")
    parser.add_argument("--reserve", type=int, default=2, help="slots kept for class 10")
    parser.add_argument("--phases", default="fifo,fair,priority")
    parser.add_argument("--hold", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=15.0, help="excluded seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=("memory", "redis"),
        default="memory",
        help="admission backend of the gateway (redis: a local redis-server)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--tenant", help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--traces-out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_parser().parse_args(argv), _worker, run, render)


if __name__ == "__main__":
    sys.exit(main())
