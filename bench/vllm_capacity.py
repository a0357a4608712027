"""Capacity against vLLM's CPU engine itself: the probe and the overload, the bend, the
engine's bypass streams and the refusal latency, through an ``openai-completions-tokens``
route to the tiny Llama of :mod:`bench.vllm_engine`.

    python -m bench.vllm_capacity [--steps ramp,overload,reconcile,refusals]
                                  [--max-num-seqs 2] [--tokens-per-audio-second 12.5]
                                  [--max-tokens 1000] [--stream-interval 25]
                                  [--levels 1,2,4,8,12] [--engine-url URL] [--json OUT]

One vLLM server serves every step of a run, niced and its session's scheduling group too
(:func:`bench.vllm_engine.nice_session`). Its ``--max-num-seqs`` is the bottleneck the probe and the
overload find (a low one, by default); for the ramp, give one above every level, so that
its own queue stays empty until the batch is full. The steps:

1. **ramp** (:func:`bend_ramp`): ``N`` closed-loop streams straight at vLLM per level,
   each request ``max_tokens`` long with ``ignore_eos`` and vLLM's running usage (an SSE
   event per ``--stream-interval`` tokens, counted from ``usage.completion_tokens``); over
   each level's
   hold, the p99 gap between a stream's consecutive events, the worst-1 % per-event
   delivery ratio (the event's audio, its tokens over the route's tokens per audio
   second, over its gap) and vLLM's own ``vllm:num_requests_waiting`` and
   ``vllm:num_requests_running`` sampled from ``/metrics``;
2. **probe and overload** (:func:`probe_and_overload`: :mod:`bench.real_engine`'s steps
   with :func:`workload_file`'s requests): ``headroom probe`` finds the ceiling with its
   range; ``load x`` that many closed-loop users straight at vLLM, then through
   ``headroom serve`` capped at the low end of the range, with vLLM's waiting and running
   gauges sampled on each side;
3. **bypass** (:func:`reconcile_timeline`): a gateway scraping vLLM's ``/metrics`` every
   second with ``engine_reconcile`` on; clients that go straight to vLLM, then leave; the
   timeline of ``headroom_engine_unadmitted_streams`` and ``headroom_session_slots``, and
   how many sessions the gateway admits while they run;
4. **refusals** (:func:`refusal_latency`): at the cap, with the admitted streams running,
   the time from a newcomer's request to its 503.

Every figure comes with the load average (1 minute) when it was taken. All traffic stays
on 127.0.0.1; every phase is bounded in time; children are always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import real_engine
from bench.overload import _child
from bench.real_engine import build_parser as real_engine_parser
from bench.real_engine import render as render_overload
from bench.vllm_engine import ensure_model, ensure_vllm, metric_value, vllm_server
from proxy.probe.analysis import quantile

__all__ = [
    "MODEL",
    "StreamLog",
    "bend_ramp",
    "capacity_gateway",
    "main",
    "probe_and_overload",
    "reconcile_timeline",
    "refusal_latency",
    "render",
    "route",
    "workload_file",
]

MODEL = "tiny"
PATH = "/v1/completions"
PROTOCOL = "openai-completions-tokens"
#: Asked of every request: each step an event with vLLM's running token count.
USAGE = {"include_usage": True, "continuous_usage_stats": True}
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
UNADMITTED = "headroom_engine_unadmitted_streams"
SLOTS = "headroom_session_slots"


def route(tokens_per_audio_second: float) -> dict[str, Any]:
    """The route every step uses."""
    return {"path": PATH, "protocol": PROTOCOL, "tokens_per_audio_second": tokens_per_audio_second}


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def workload_file(directory: Path, max_tokens: int) -> Path:
    """The probe's bundled TTS texts, each request asking vLLM's model by name for
    ``max_tokens`` tokens (``ignore_eos``: every stream runs its full length) with the
    running usage the meter counts."""
    text = resources.files("proxy.probe").joinpath("data", "tts.yaml").read_text("utf-8")
    doc = yaml.safe_load(text)
    extra = {"max_tokens": max_tokens, "ignore_eos": True, "stream_options": USAGE}
    doc["defaults"] = {"model": MODEL, "extra": extra}
    path = directory / "tts-vllm.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _body(max_tokens: int, prompt: str = "hello world") -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": USAGE}  # fmt: skip


@dataclass(slots=True)
class StreamLog:
    """One closed-loop stream's events: (arrival time, tokens it carried), per request."""

    requests: list[list[tuple[float, int]]] = field(default_factory=list)
    errors: int = 0


async def _stream_once(http: httpx.AsyncClient, url: str, max_tokens: int, log: StreamLog) -> None:
    events: list[tuple[float, int]] = []
    log.requests.append(events)
    seen = 0
    async with http.stream("POST", f"{url}{PATH}", json=_body(max_tokens)) as response:
        if response.status_code != 200:
            await response.aread()
            log.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            tokens = int(usage.get("completion_tokens", seen))
            if tokens > seen:
                events.append((time.monotonic(), tokens - seen))
                seen = tokens


async def _closed_loop(url: str, max_tokens: int, log: StreamLog, stop: asyncio.Event) -> None:
    """Requests one after another until ``stop`` (the one running is then cut)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as http:
        while not stop.is_set():
            try:
                await _stream_once(http, url, max_tokens, log)
            except httpx.HTTPError:
                log.errors += 1
                await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def _streams(url: str, n: int, max_tokens: int) -> AsyncIterator[list[StreamLog]]:
    """``n`` closed-loop streams at ``url`` while the block runs; cut when it ends."""
    stop = asyncio.Event()
    logs = [StreamLog() for _ in range(n)]
    tasks = [asyncio.create_task(_closed_loop(url, max_tokens, log, stop)) for log in logs]
    try:
        yield logs
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sample(
    url: str, names: tuple[str, ...], every_s: float, out: list[tuple[float, ...]]
) -> None:
    """Append (time, value of each name) from ``url``/metrics every ``every_s`` until
    cancelled."""
    while True:
        with contextlib.suppress(httpx.HTTPError):
            values = [await metric_value(url, name) for name in names]
            out.append((time.monotonic(), *values))
        await asyncio.sleep(every_s)


def _window_stats(
    logs: list[StreamLog], start: float, end: float, tokens_per_audio_second: float
) -> dict[str, Any]:
    """Gaps between a request's consecutive events that arrived in [start, end]."""
    gaps: list[float] = []
    ratios: list[float] = []
    tokens = 0
    for log in logs:
        for events in log.requests:
            for (t0, _), (t1, n) in itertools.pairwise(events):
                if start <= t1 <= end:
                    gap = max(t1 - t0, 1e-6)
                    gaps.append(gap)
                    ratios.append(n / tokens_per_audio_second / gap)
                    tokens += n
    held = end - start
    return {
        "events": len(gaps),
        "gap_p50_s": None if not gaps else round(quantile(gaps, 0.5), 4),
        "gap_p99_s": None if not gaps else round(quantile(gaps, 0.99), 4),
        "worst_1pct_ratio": None if not ratios else round(quantile(ratios, 0.01), 3),
        "median_ratio": None if not ratios else round(quantile(ratios, 0.5), 3),
        "tokens_per_s": round(tokens / held, 1),
        "per_stream_tokens_per_s": round(tokens / held / max(1, len(logs)), 1),
        "errors": sum(log.errors for log in logs),
    }


async def bend_ramp(
    url: str,
    levels: list[int],
    *,
    tokens_per_audio_second: float,
    max_tokens: int,
    warmup_s: float,
    hold_s: float,
) -> list[dict[str, Any]]:
    """Per level: ``level`` closed-loop streams straight at vLLM; the hold's gaps and
    ratios, and vLLM's waiting and running gauges over it."""
    rows = []
    for level in levels:
        samples: list[tuple[float, ...]] = []
        async with _streams(url, level, max_tokens) as logs:
            await asyncio.sleep(warmup_s)
            start = time.monotonic()
            sampler = asyncio.create_task(_sample(url, (WAITING, RUNNING), 0.25, samples))
            try:
                await asyncio.sleep(hold_s)
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            end = time.monotonic()
        row = {"level": level, **_window_stats(logs, start, end, tokens_per_audio_second)}
        row["waiting_max"] = max((s[1] for s in samples), default=None)
        row["running_max"] = max((s[2] for s in samples), default=None)
        row["loadavg"] = _load()
        rows.append(row)
        print(f"ramp {level}: {row}", file=sys.stderr, flush=True)
        await _idle(url)
    return rows


async def _idle(url: str, within_s: float = 60.0) -> None:
    """Until vLLM runs and waits for nothing (cut streams are aborted at its next step)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await metric_value(url, RUNNING) + await metric_value(url, WAITING) == 0:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"vLLM at {url} still busy after {within_s:g} s")


@contextlib.asynccontextmanager
async def capacity_gateway(
    engine_url: str,
    *,
    cap: int,
    tokens_per_audio_second: float,
    reconcile: bool = False,
    hold_s: float = 5.0,
) -> AsyncIterator[str]:
    """``headroom serve`` (a child process): one pool, vLLM at ``max_sessions=cap``, no
    queue, metrics on the client port; with ``reconcile``, vLLM's ``/metrics`` scraped
    every second and ``engine_reconcile`` on (``engine_reconcile_hold_s`` = ``hold_s``)."""
    pool: dict[str, Any] = {
        "name": "main", "queue": {"max_depth": 0, "max_wait_s": 10},
        "replicas": [{"name": "vllm0", "url": engine_url, "max_sessions": cap}],
    }  # fmt: skip
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},
        "log_level": "warning",
        "log_format": "text",
        "pools": [pool],
        "routes": [{"pool": "main", **route(tokens_per_audio_second)}],
    }
    if reconcile:
        config["health"] = {"engine_metrics_interval_s": 1}
        pool.update(engine_reconcile=True, engine_reconcile_hold_s=hold_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "headroom.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = [sys.executable, "-m", "proxy.process.cli", "serve", "--config", str(path)]
        async with _child(serve, "stderr", "headroom: serving on ") as banner:
            yield banner.rsplit(" ", 1)[-1]


async def _wait_value(url: str, name: str, want: float, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if await metric_value(url, name) == want:
                return True
        await asyncio.sleep(0.2)
    return False


async def _admit(url: str, n: int, max_tokens: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """Open up to ``n`` streams through the gateway, one after another, each read to its
    first event and left open; (the open ones, the refusals' status, reason, message)."""
    opened: list[Any] = []
    refused: list[dict[str, Any]] = []
    for _ in range(n):
        http = httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0))
        stream = http.stream("POST", f"{url}{PATH}", json=_body(max_tokens))
        response = await stream.__aenter__()
        if response.status_code == 200:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            opened.append((http, stream, lines))
            continue
        body = (await response.aread()).decode(errors="replace")
        refused.append({"status": response.status_code,
                        "reason": response.headers.get("x-headroom-reason"),
                        "retry_after": response.headers.get("retry-after"),
                        "body": body})  # fmt: skip
        await stream.__aexit__(None, None, None)
        await http.aclose()
    return opened, refused


async def _close(opened: list[Any]) -> None:
    for http, stream, _lines in opened:
        await stream.__aexit__(None, None, None)
        await http.aclose()


async def reconcile_timeline(
    engine_url: str,
    *,
    cap: int,
    bypass: int,
    tokens_per_audio_second: float,
    max_tokens: int,
    hold_s: float = 5.0,
    settle_s: float = 60.0,
) -> dict[str, Any]:
    """A gateway with ``engine_reconcile`` in front of vLLM at ``cap``; ``bypass``
    closed-loop clients straight to vLLM, then gone. The timeline of the gateway's
    unadmitted streams and cap (and vLLM's running and waiting) every 0.5 s; how many
    sessions it admits (of ``cap`` asked) while the bypass runs, and its refusals."""
    samples: list[tuple[float, ...]] = []
    marks: dict[str, float] = {}
    async with capacity_gateway(
        engine_url,
        cap=cap,
        reconcile=True,
        hold_s=hold_s,
        tokens_per_audio_second=tokens_per_audio_second,
    ) as url:

        async def sample() -> None:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    row = [await metric_value(url, UNADMITTED), await metric_value(url, SLOTS),
                           await metric_value(engine_url, RUNNING),
                           await metric_value(engine_url, WAITING)]  # fmt: skip
                    samples.append((time.monotonic(), *row))
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample())
        try:
            t0 = time.monotonic()
            marks["start"] = t0
            await asyncio.sleep(2.0)
            async with _streams(engine_url, bypass, max_tokens):
                marks["bypass_on"] = time.monotonic()
                lowered = await _wait_value(url, SLOTS, max(1, cap - bypass), settle_s)
                marks["cap_lowered"] = time.monotonic()
                opened, refused = await _admit(url, cap, max_tokens)
                marks["admitted"] = time.monotonic()
                await _close(opened)
                await asyncio.sleep(1.0)
            marks["bypass_off"] = time.monotonic()
            restored = await _wait_value(url, SLOTS, cap, settle_s)
            marks["cap_restored"] = time.monotonic()
            await asyncio.sleep(2.0)
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    timeline = [{"t_s": round(s[0] - t0, 1), "unadmitted": s[1], "slots": s[2],
                 "vllm_running": s[3], "vllm_waiting": s[4]} for s in samples]  # fmt: skip
    return {
        "cap": cap, "bypass": bypass, "hold_s": hold_s,
        "lowered": lowered, "restored": restored,
        "admitted_during_bypass": len(opened), "refused_during_bypass": refused,
        "marks_s": {k: round(v - t0, 1) for k, v in marks.items()},
        "timeline": timeline, "loadavg": _load(),
    }  # fmt: skip


async def _drain(lines: AsyncIterator[str]) -> float:
    """Read a held stream to its end; the time it ended."""
    with contextlib.suppress(httpx.HTTPError):
        async for _line in lines:
            pass
    return time.monotonic()


async def refusal_latency(
    engine_url: str, *, cap: int, tokens_per_audio_second: float, max_tokens: int, newcomers: int
) -> dict[str, Any]:
    """At ``cap`` held by streams vLLM generates (``max_tokens`` long, read as they come),
    up to ``newcomers`` requests one after another through the gateway, until a held
    stream ends: the time from each request to its answer, and the answers. One that is
    not refused is recorded with whether a held stream ended within 5 s of it (a slot it
    took once freed)."""
    async with capacity_gateway(
        engine_url, cap=cap, tokens_per_audio_second=tokens_per_audio_second
    ) as url:
        opened, refused = await _admit(url, cap, max_tokens)
        drains = [asyncio.create_task(_drain(lines)) for _, _, lines in opened]
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        admitted: list[bool] = []
        try:
            if refused:
                raise RuntimeError(f"the gateway refused below its cap: {refused}")
            running = await metric_value(engine_url, RUNNING)
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as http:
                for _ in range(newcomers):
                    if any(d.done() for d in drains):
                        break
                    begun = time.perf_counter()
                    response = await http.post(f"{url}{PATH}", json=_body(8))
                    took = time.perf_counter() - begun
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    if response.status_code == 503:
                        latencies.append(took)
                        continue
                    done, _ = await asyncio.wait(drains, timeout=5.0)
                    admitted.append(bool(done))
                    break
            running_after = await metric_value(engine_url, RUNNING)
        finally:
            for drain in drains:
                drain.cancel()
            await asyncio.gather(*drains, return_exceptions=True)
            await _close(opened)
    return {
        "cap": cap, "newcomers": sum(statuses.values()), "statuses": statuses,
        "admitted_after_a_held_stream_ended": admitted,
        "vllm_running": [running, running_after],
        "p50_s": None if not latencies else round(quantile(latencies, 0.5), 4),
        "p99_s": None if not latencies else round(quantile(latencies, 0.99), 4),
        "max_s": None if not latencies else round(max(latencies), 4), "loadavg": _load(),
    }  # fmt: skip


def overload_args(
    workload: Path, tokens_per_audio_second: float, extra: list[str]
) -> argparse.Namespace:
    """bench.real_engine's arguments for vLLM: the given workload, levels from 1."""
    return real_engine_parser().parse_args(
        [
            "--tokens-per-audio-second",
            str(tokens_per_audio_second),
            "--workload",
            str(workload),
            "--levels",
            "1,2,4,...",
            *extra,
        ]
    )


@contextlib.asynccontextmanager
async def _gauges(engine_url: str) -> AsyncIterator[dict[str, Any]]:
    """vLLM's waiting and running gauges sampled every 0.5 s while the block runs; on
    exit, their peaks and the number of samples."""
    samples: list[tuple[float, ...]] = []
    figures: dict[str, Any] = {}
    sampler = asyncio.create_task(_sample(engine_url, (WAITING, RUNNING), 0.5, samples))
    try:
        yield figures
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        figures.update(vllm_samples=len(samples),
                       vllm_waiting_max=max((x[1] for x in samples), default=None),
                       vllm_running_max=max((x[2] for x in samples), default=None))  # fmt: skip


async def probe_and_overload(
    engine_url: str, workload: Path, tokens_per_audio_second: float, extra: list[str]
) -> dict[str, Any]:
    """:func:`bench.real_engine.run_on_engine`'s steps against vLLM (the probe, then
    ``load x`` the low end of its range straight at vLLM and through ``headroom serve``
    capped there), with vLLM's waiting and running gauges sampled during each side."""
    args = overload_args(workload, tokens_per_audio_second, extra)
    out: dict[str, Any] = {"engine_url": engine_url, "protocol": PROTOCOL,
                           "tokens_per_audio_second": tokens_per_audio_second,
                           "loadavg_before": os.getloadavg()}  # fmt: skip
    started = time.monotonic()
    probe = await real_engine._probe(engine_url, args)
    out["probe"] = {k: probe[k] for k in ("ceiling", "exact", "bracket", "ceiling_range",
                                          "limited_by", "trials", "duration_s", "levels",
                                          "estimates", "settings")}  # fmt: skip
    out["probe_table"] = probe["table"]
    out["probe_loadavg"] = _load()
    cap = int(probe["ceiling_range"][0])
    if cap < 1:
        raise RuntimeError(
            f"the probe found no passing level (range {probe['ceiling_range']}; load "
            f"{out['probe_loadavg']}):\n{probe['table']}"
        )
    users = max(1, round(args.load * cap), args.min_users)
    out.update(cap=cap, load_factor=args.load, users=users, clients=args.clients,
               overload_hold_s=args.overload_hold,
               overload_warmup_s=args.overload_warmup)  # fmt: skip
    await _idle(engine_url)
    async with _gauges(engine_url) as gauges:
        out["direct"] = await real_engine._measure(engine_url, args, users)
    out["direct"].update(gauges, loadavg=_load())
    await _idle(engine_url)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "headroom.yaml"
        settings = real_engine._headroom_config(engine_url, cap, tokens_per_audio_second,
                                                args.window)  # fmt: skip
        config.write_text(yaml.safe_dump(settings))
        serve = [sys.executable, "-m", "proxy.process.cli", "serve", "--config", str(config)]
        async with _child(serve, "stderr", "headroom: serving on ") as banner:
            proxy_url = banner.rsplit(" ", 1)[-1]
            async with _gauges(engine_url) as gauges:
                out["headroom"] = await real_engine._measure(proxy_url, args, users)
    out["headroom"].update(gauges, loadavg=_load())
    out["loadavg_after"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - started, 1)
    return out


def render(result: dict[str, Any]) -> str:
    """The figures as markdown."""
    lines: list[str] = []
    if "ramp" in result:
        lines += [f"Ramp straight at vLLM (--max-num-seqs {result['max_num_seqs']}, "
                  f"{result['tokens_per_audio_second']:g} tokens per audio second):", "",
                  "| streams | gap p50 (s) | gap p99 (s) | worst-1% | median | tokens/s "
                  "| per stream | vllm waiting max | running max | load |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        keys = ("level", "gap_p50_s", "gap_p99_s", "worst_1pct_ratio", "median_ratio",
                "tokens_per_s", "per_stream_tokens_per_s", "waiting_max", "running_max",
                "loadavg")  # fmt: skip
        for r in result["ramp"]:
            lines.append(
                "| " + " | ".join("-" if r[k] is None else f"{r[k]:g}" for k in keys) + " |"
            )
        lines.append("")
    if "overload" in result:
        over = result["overload"]
        lines += [render_overload(over), ""]
        for side in ("headroom", "direct"):
            lines.append(
                f"{side}: vllm:num_requests_waiting max {over[side]['vllm_waiting_max']}, "
                f"running max {over[side]['vllm_running_max']} "
                f"({over[side]['vllm_samples']} samples), load {over[side]['loadavg']}"
            )
        lines.append("")
    if "reconcile" in result:
        rec = result["reconcile"]
        lines += [f"Bypass: cap {rec['cap']}, {rec['bypass']} clients straight to vLLM; "
                  f"admitted while they ran: {rec['admitted_during_bypass']}; marks (s) "
                  f"{rec['marks_s']}; load {rec['loadavg']}", "",
                  "| t (s) | unadmitted | slots | vllm running | vllm waiting |",
                  "|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {s['t_s']} | {s['unadmitted']:g} | {s['slots']:g} | "
            f"{s['vllm_running']:g} | {s['vllm_waiting']:g} |"
            for s in rec["timeline"]
        ]
        lines.append("")
    if "refusals" in result:
        ref = result["refusals"]
        lines.append(f"Refusals at cap {ref['cap']}: {ref['newcomers']} newcomers, statuses "
                     f"{ref['statuses']}, p50 {ref['p50_s']} s, p99 {ref['p99_s']} s, max "
                     f"{ref['max_s']} s; load {ref['loadavg']}")  # fmt: skip
    return "\n".join(lines)


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@contextlib.asynccontextmanager
async def _server(args: argparse.Namespace) -> AsyncIterator[str]:
    """``--engine-url``, or the tiny Llama served here (its start-up time printed)."""
    if args.engine_url:
        yield args.engine_url
        return
    engine = await asyncio.to_thread(ensure_vllm, args.cache)
    model = await asyncio.to_thread(ensure_model, engine, "llama")
    extra = ("--stream-interval", str(args.stream_interval))
    async with vllm_server(engine, model, name=MODEL, max_num_seqs=args.max_num_seqs,
                           max_model_len=4096, extra=extra) as server:  # fmt: skip
        yield server.url


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tps = args.tokens_per_audio_second
    out: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "tokens_per_audio_second": tps,
                           "stream_interval": args.stream_interval,
                           "max_tokens": args.max_tokens, "loadavg_before": _load()}  # fmt: skip
    async with _server(args) as url:
        if "ramp" in args.steps:
            out["ramp"] = await bend_ramp(
                url, _levels(args.levels), tokens_per_audio_second=tps,
                max_tokens=args.max_tokens, warmup_s=args.warmup, hold_s=args.hold,
            )  # fmt: skip
        if "overload" in args.steps:
            with tempfile.TemporaryDirectory() as tmp:
                workload = workload_file(Path(tmp), args.max_tokens)
                more = ["--max-level", str(4 * args.max_num_seqs), *args.overload_args.split()]
                out["overload"] = await probe_and_overload(url, workload, tps, more)
        if "reconcile" in args.steps:
            out["reconcile"] = await reconcile_timeline(
                url, cap=args.cap, bypass=args.bypass, tokens_per_audio_second=tps,
                max_tokens=args.max_tokens,
            )  # fmt: skip
        if "refusals" in args.steps:
            out["refusals"] = await refusal_latency(
                url, cap=args.cap, tokens_per_audio_second=tps,
                max_tokens=args.held_tokens, newcomers=args.newcomers,
            )  # fmt: skip
    out["loadavg_after"] = _load()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = parser.add_argument
    a("--steps", default="ramp,overload,reconcile,refusals")
    a("--max-num-seqs", type=int, default=2, help="vLLM's batch limit")
    a(
        "--tokens-per-audio-second",
        type=float,
        default=12.5,
        help="the route's tokens per audio second (12.5: 80 ms a token, as Qwen3-TTS's)",
    )
    a("--max-tokens", type=int, default=1000, help="every request's length")
    a("--stream-interval", type=int, default=25,
      help="vLLM's --stream-interval: tokens per SSE event (a codec's chunk)")  # fmt: skip
    a("--levels", default="1,2,4,8,12", help="the ramp's streams per level")
    a("--warmup", type=float, default=4.0, help="the ramp's warm-up per level (s)")
    a("--hold", type=float, default=10.0, help="the ramp's measured seconds per level")
    a("--overload-args", default="", help="more bench.real_engine arguments")
    a("--cap", type=int, default=4, help="the bypass and refusal steps' cap")
    a("--bypass", type=int, default=2, help="clients straight to vLLM in the bypass step")
    a("--newcomers", type=int, default=100, help="refused requests timed")
    a("--held-tokens", type=int, default=4000,
      help="the length of the streams holding the cap while refusals are timed")  # fmt: skip
    a("--cache", type=Path)
    a("--engine-url", help="a vLLM server already running (its --max-num-seqs and "
                           "--stream-interval as given here)")  # fmt: skip
    a("--json", metavar="OUT")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    result = asyncio.run(run(args))
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
