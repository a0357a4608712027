"""Voice-agent calls at 2x the TTS cap while ASR has room: with and without gang
reservations (issue 19).

    python -m bench.voice_agent [--tts-preset h100-orpheus-3b] [--load 2] [--hold 30]
                                [--warmup 5] [--tts-cap N] [--asr-cap N] [--speak 1]
                                [--clients 4] [--json OUT]

It starts two ``headroom sim`` processes (one simulated ASR GPU, ``--asr-preset``, and
one simulated TTS GPU, ``--tts-preset``) and ``headroom serve`` with two pools:
``asr-main`` (vllm-realtime, capped at ``--asr-cap``, by default the ASR preset's
recommended cap, which must leave room for every call) and ``tts-main``
(vllm-omni-speech-ws, capped at ``--tts-cap``, by default the TTS preset's recommended
cap from ``headroom sim --describe``: the largest level every seed passes), no queue,
guard in observe mode (so only the caps refuse). Then ``load x TTS cap`` closed-loop
callers run for ``warmup + hold`` seconds, twice:

- ``plain``: each call opens its ASR WebSocket, streams the caller's audio (realtime
  pace, silence) for ``--speak`` seconds, then opens its TTS WebSocket for the answer
  (one text of the bundled TTS workload) while ASR keeps listening; the call ends when
  the answer has been spoken.
- ``reserved``: each call first asks ``POST /v1/headroom/reservations {"pools":
  ["asr-main", "tts-main"]}``; on a refusal the call ends there (the caller is told
  before being connected); on 201 it opens both stages as above with the token
  (``X-Headroom-Reservation``) and ``DELETE``\\ s the reservation at the end.

A refused caller calls again after ``min(Retry-After, 1 s)``; a finished one at once.
The callers are split over ``--clients`` load-generator processes started together on
the shared monotonic clock. Reported per mode, over the calls started in the hold
window (after the warm-up):

- ``calls``: calls started; ``completed``: answered to the end;
- ``refused_at_start``: refused before the caller was heard (reservation refused, or
  ASR refused);
- ``heard_not_answered``: ASR admitted, then the TTS stage refused (503, or 409 for
  the token) -- the caller was heard and never answered;
- ``failed``: anything else (errors, timeouts);
- ``told_p50_s`` / ``told_p99_s``: for every refused call, call start to the moment the
  caller learns it (the reservation's refusal, or the TTS refusal after speaking);
- ``reservation_*``: the gateway's ``headroom_reservation*`` counters at the end.

All traffic stays on 127.0.0.1; every phase is bounded in time; child processes are
always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus, WebSocketException

from bench.overload import (
    _child,
    _loads,
    recommended_cap,
    run_bench,
    wait_workers,
    worker_processes,
)
from proxy.probe.analysis import quantile
from proxy.probe.clients import run_session
from proxy.probe.probe_session import ClientOptions, Refusal, SessionFailed, SessionRecorder
from proxy.probe.workload import ASR_SAMPLE_RATE, SpeechRequest, bundled
from proxy.sim.presets import get_preset

__all__ = ["classify", "main", "render", "run_voice_agent", "summarize"]

_PY = [sys.executable, "-m", "proxy.process.cli"]
RESERVE = "/v1/headroom/reservations"
ASR_PATH = "/v1/realtime"
TTS_PATH = "/v1/audio/speech/stream"
MODES = ("plain", "reserved")
#: PCM16 silence, 200 ms at 16 kHz: one ``input_audio_buffer.append``.
_PIECE_S = 0.2
_PIECE = base64.b64encode(bytes(int(2 * ASR_SAMPLE_RATE * _PIECE_S))).decode()


class _Refused(Exception):
    """A stage or the reservation refused: ``code`` (reason or error code)."""

    def __init__(self, code: str, retry_after_s: float | None) -> None:
        super().__init__(code)
        self.code = code
        self.retry_after_s = retry_after_s


def _retry_after(headers: httpx.Headers | Any) -> float | None:
    try:
        return float(headers.get("retry-after", ""))
    except (TypeError, ValueError):
        return None


async def _open_asr(url: str, headers: dict[str, str], model: str) -> ClientConnection:
    try:
        ws = await connect(url, compression=None, additional_headers=headers,
                           open_timeout=10, close_timeout=1)  # fmt: skip
    except InvalidStatus as exc:
        response = exc.response
        code = response.headers.get("x-headroom-reason") or f"HTTP {response.status_code}"
        if response.status_code == 409:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                code = json.loads(response.body or b"")["error"]["code"]
        raise _Refused(code, _retry_after(response.headers)) from None
    await ws.send(json.dumps({"type": "session.update", "model": model}))
    return ws


async def _listen(ws: ClientConnection, stop: asyncio.Event) -> None:
    """The caller's microphone: silence at realtime pace until the call ends, the ASR
    events read and dropped."""

    async def drain() -> None:
        with contextlib.suppress(WebSocketException):
            async for _ in ws:
                pass

    reader = asyncio.ensure_future(drain())
    try:
        first = True
        while not stop.is_set():
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _PIECE}))
            if first:
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                first = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _PIECE_S)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        with contextlib.suppress(Exception):
            await ws.close()


def classify(tts_error: Exception) -> tuple[str, str]:
    """A TTS stage's failure as (outcome, detail): a refusal at the door (503/429,
    close 1013, or a 409 for the token) is ``heard_not_answered``; the rest ``failed``."""
    if isinstance(tts_error, Refusal):
        return "heard_not_answered", str(tts_error.reason)
    text = str(tts_error)
    if isinstance(tts_error, SessionFailed) and text.startswith("WebSocket handshake rejected"):
        return "heard_not_answered", text
    return "failed", text


async def _call(
    base: str, mode: str, http: httpx.AsyncClient, text: SpeechRequest, args: argparse.Namespace
) -> dict[str, Any]:
    """One call; returns its record (times on the monotonic clock)."""
    started = time.monotonic()
    record: dict[str, Any] = {"mode": mode, "started_at": started, "retry_after": None}

    def end(outcome: str, detail: str = "", retry: float | None = None) -> dict[str, Any]:
        record.update(outcome=outcome, detail=detail, ended_at=time.monotonic(),
                      retry_after=retry)  # fmt: skip
        return record

    headers: dict[str, str] = {}
    token = None
    if mode == "reserved":
        try:
            body = {"pools": ["asr-main", "tts-main"], "hold_s": args.hold_s}
            r = await http.post(f"http://{base}{RESERVE}", json=body)
        except httpx.HTTPError as exc:
            return end("failed", f"reserve: {exc}")
        if r.status_code != 201:
            error = r.json().get("error", {}) if r.status_code in (409, 429, 503) else {}
            detail = f"{r.status_code} {error.get('code')} stage={error.get('stage')}"
            if r.status_code in (429, 503):
                return end("refused_at_start", detail, _retry_after(r.headers))
            return end("failed", detail)
        token = r.json()["token"]
        headers["X-Headroom-Reservation"] = token
    try:
        try:
            ws = await _open_asr(f"ws://{base}{ASR_PATH}", headers, args.asr_model)
        except _Refused as refused:
            return end("refused_at_start", f"asr {refused.code}", refused.retry_after_s)
        except (OSError, TimeoutError, WebSocketException) as exc:
            return end("failed", f"asr: {exc}")
        stop = asyncio.Event()
        listening = asyncio.ensure_future(_listen(ws, stop))
        try:
            await asyncio.sleep(args.speak)  # the caller speaks; the agent thinks
            opts = ClientOptions(url=f"ws://{base}{TTS_PATH}", protocol="vllm-omni-speech-ws",
                                 headers=tuple(headers.items()), model=args.tts_model,
                                 sample_rate=args.sample_rate)  # fmt: skip
            rec = SessionRecorder(time.monotonic)
            try:
                await asyncio.wait_for(run_session(opts, http, text, rec), args.call_timeout)
            except (Refusal, SessionFailed) as exc:
                outcome, detail = classify(exc)
                retry = exc.retry_after_s if isinstance(exc, Refusal) else None
                return end(outcome, f"tts {detail}", retry)
            except TimeoutError:
                return end("failed", "tts: timed out")
            return end("completed")
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await listening
    finally:
        if token is not None:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(f"http://{base}{RESERVE}/{token}")


async def _caller(
    base: str, mode: str, until: float, http: httpx.AsyncClient, index: int,
    args: argparse.Namespace, out: list[dict[str, Any]],
) -> None:  # fmt: skip
    texts = bundled("tts").sampler(args.seed + index)
    while time.monotonic() < until:
        request = texts.next()
        assert isinstance(request, SpeechRequest)
        record = await _call(base, mode, http, request, args)
        out.append(record)
        if record["outcome"] != "completed":
            retry = record["retry_after"]
            await asyncio.sleep(min(retry if retry is not None else 1.0, 1.0))


async def _worker(args: argparse.Namespace) -> int:
    """One load-generator process: ``--users`` callers from ``--start-at`` for
    ``warmup + hold`` seconds; records to ``--records-out``."""
    delay = args.start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    until = args.start_at + args.warmup + args.hold
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        await asyncio.gather(*(_caller(args.worker, args.mode, until, http, i, args, records)
                               for i in range(args.users)))  # fmt: skip
    await asyncio.to_thread(Path(args.records_out).write_text, json.dumps(records))
    return 0


def summarize(
    records: list[dict[str, Any]], window_start: float, window_end: float
) -> dict[str, Any]:
    """The figures over the calls started in ``[window_start, window_end)``."""
    calls = [r for r in records if window_start <= r["started_at"] < window_end]
    kinds = ("completed", "refused_at_start", "heard_not_answered", "failed")
    counts = {k: sum(1 for r in calls if r["outcome"] == k) for k in kinds}
    told = [r["ended_at"] - r["started_at"] for r in calls
            if r["outcome"] in ("refused_at_start", "heard_not_answered")]  # fmt: skip
    unheard = [r["ended_at"] - r["started_at"] for r in calls
               if r["outcome"] == "heard_not_answered"]  # fmt: skip
    share = round(counts["heard_not_answered"] / len(calls), 4) if calls else None
    details: dict[str, int] = {}
    for r in calls:
        if r["outcome"] in ("heard_not_answered", "failed", "refused_at_start"):
            details[r["detail"]] = details.get(r["detail"], 0) + 1
    return {
        "calls": len(calls),
        **counts,
        "heard_not_answered_share": share,
        "told_p50_s": quantile(told, 0.5),
        "told_p99_s": quantile(told, 0.99),
        "heard_not_answered_told_p50_s": quantile(unheard, 0.5),
        "details": dict(sorted(details.items(), key=lambda kv: -kv[1])[:8]),
    }


async def _scrape(base: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://{base}/metrics")).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("headroom_reservation") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if not name.endswith("_created"):
                out[name] = float(value)
    return out


async def _measure(base: str, mode: str, users: int, args: argparse.Namespace) -> dict[str, Any]:
    clients = max(1, min(args.clients, users))
    shares = [users // clients + (i < users % clients) for i in range(clients)]
    start_at = time.monotonic() + 3.0 + 0.5 * clients  # every interpreter up and waiting
    with tempfile.TemporaryDirectory() as tmp:
        cmds, outs = [], []
        for i, share in enumerate(shares):
            out = Path(tmp) / f"worker{i}.json"
            outs.append(out)
            cmds.append([sys.executable, "-m", "bench.voice_agent", "--worker", base,
                         "--mode", mode, "--users", str(share), "--start-at", repr(start_at),
                         "--records-out", str(out), "--hold", str(args.hold),
                         "--warmup", str(args.warmup), "--speak", str(args.speak),
                         "--hold-s", str(args.hold_s), "--call-timeout", str(args.call_timeout),
                         "--asr-model", args.asr_model, "--tts-model", args.tts_model,
                         "--sample-rate", str(args.sample_rate),
                         "--seed", str(args.seed + 1000 * i)])  # fmt: skip
        deadline = 5.0 + 0.5 * clients + args.warmup + args.hold + args.call_timeout + 60
        async with worker_processes(cmds) as procs:
            await wait_workers(procs, deadline)
        records: list[dict[str, Any]] = []
        for out in outs:
            records += json.loads(out.read_text())
    window_start = start_at + args.warmup
    figures = summarize(records, window_start, window_start + args.hold)
    figures["users"] = users
    figures["clients"] = clients
    return figures


def _config(asr_url: str, tts_url: str, asr_cap: int, tts_cap: int, rate: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},  # scraped on the client listener
        "log_level": "warning",
        "log_format": "text",
        "guard": {"mode": "observe"},
        "pools": [
            {"name": "asr-main", "queue": {"max_depth": 0, "max_wait_s": 5},
             "session_estimate_s": 10,
             "replicas": [{"name": "gpu0", "url": asr_url, "max_sessions": asr_cap}]},
            {"name": "tts-main", "queue": {"max_depth": 0, "max_wait_s": 5},
             "session_estimate_s": 10,
             "replicas": [{"name": "gpu1", "url": tts_url, "max_sessions": tts_cap}]},
        ],
        "routes": [
            {"path": ASR_PATH, "pool": "asr-main", "protocol": "vllm-realtime"},
            {"path": TTS_PATH, "pool": "tts-main", "protocol": "vllm-omni-speech-ws",
             "audio": {"sample_rate": rate}},
        ],
        "pipelines": [{"name": "voice-agent", "stages": ["asr-main", "tts-main"]}],
    }  # fmt: skip


def caps(args: argparse.Namespace) -> tuple[tuple[int, str], tuple[int, str]]:
    """The TTS and ASR pools' caps and where each came from: ``--tts-cap`` /
    ``--asr-cap``, else the preset's recommended cap over the simulator's seeds."""
    tts = (args.tts_cap, "--tts-cap") if args.tts_cap else recommended_cap(args.tts_preset)
    asr = (args.asr_cap, "--asr-cap") if args.asr_cap else recommended_cap(args.asr_preset)
    return tts, asr


async def run_voice_agent(args: argparse.Namespace) -> dict[str, Any]:
    asr, tts = get_preset(args.asr_preset), get_preset(args.tts_preset)
    (tts_cap, tts_cap_from), (asr_cap, _) = caps(args)
    users = max(1, round(args.load * tts_cap))
    if asr_cap < users:
        raise SystemExit(f"--asr-cap {asr_cap} < {users} callers: ASR would have no room")
    args.asr_model, args.tts_model, args.sample_rate = asr.model, tts.model, tts.sample_rate
    started = time.monotonic()
    out: dict[str, Any] = {
        "asr_preset": asr.name, "tts_preset": tts.name, "asr_cap": asr_cap,
        "tts_cap": tts_cap, "tts_cap_from": tts_cap_from, "load_factor": args.load,
        "users": users,
        "clients": args.clients, "hold_s": args.hold, "warmup_s": args.warmup,
        "speak_s": args.speak, "loadavg_before": os.getloadavg(),
    }  # fmt: skip
    sim = [*_PY, "sim", "--gpus", "1", "--port", "0", "--json"]
    async with (
        _child([*sim, "--preset", asr.name], "stdout", "{") as asr_line,
        _child([*sim, "--preset", tts.name], "stdout", "{") as tts_line,
    ):
        asr_url, tts_url = json.loads(asr_line)["urls"][0], json.loads(tts_line)["urls"][0]
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "headroom.yaml"
            config.write_text(yaml.safe_dump(_config(asr_url, tts_url, asr_cap, tts_cap,
                                                     tts.sample_rate)))  # fmt: skip
            serve = [*_PY, "serve", "--config", str(config)]
            async with _child(serve, "stderr", "headroom: serving on ") as banner:
                base = banner.rsplit(" ", 1)[-1].split("://")[-1].rstrip("/")
                for mode in MODES:
                    print(f"{mode}: {users} callers -> {base} (ASR cap {asr_cap}, "
                          f"TTS cap {tts_cap})", file=sys.stderr)  # fmt: skip
                    before = await _scrape(base)
                    figures = await _measure(base, mode, users, args)
                    after = await _scrape(base)
                    figures["metrics"] = {k: v - before.get(k, 0.0) for k, v in after.items()
                                          if v - before.get(k, 0.0)}  # fmt: skip
                    out[mode] = figures
                    await asyncio.sleep(2)  # let both engines drain between the modes
    out["loadavg_after"] = os.getloadavg()
    out["duration_s"] = round(time.monotonic() - started, 1)
    return out


_ROWS = (
    ("calls", "calls started", "{:d}"),
    ("completed", "answered to the end", "{:d}"),
    ("refused_at_start", "refused before being heard", "{:d}"),
    ("heard_not_answered", "heard, then TTS refused", "{:d}"),
    ("failed", "failed otherwise", "{:d}"),
    ("told_p50_s", "refused: told after p50 (s)", "{:.4f}"),
    ("told_p99_s", "refused: told after p99 (s)", "{:.4f}"),
)


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Voice agent: {result['users']} closed-loop callers = {result['load_factor']:g}x "
        f"the TTS cap ({result['tts_cap']}, from {result['tts_cap_from']}) of "
        f"{result['tts_preset']}; ASR {result['asr_preset']} capped at {result['asr_cap']}; "
        f"each call speaks {result['speak_s']:g} s before its answer; "
        f"{result['hold_s']:g} s measured after {result['warmup_s']:g} s warm-up, load from "
        f"{result['clients']} processes",
        "",
        f"| {'':30} | {'no reservation':>14} | {'reservation':>12} |",
        f"|{'-' * 32}|{'-' * 16}|{'-' * 14}|",
    ]
    for key, label, fmt in _ROWS:
        cells = []
        for mode in MODES:
            value = result[mode].get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append(f"| {label:30} | {cells[0]:>14} | {cells[1]:>12} |")
    for mode in MODES:
        if result[mode].get("metrics"):
            deltas = ", ".join(f"{k} +{v:g}" for k, v in result[mode]["metrics"].items())
            lines += ["", f"{mode}: {deltas}"]
    before, after = result.get("loadavg_before"), result.get("loadavg_after")
    if before and after:
        lines += ["", f"load average (1, 5, 15 min): before {_loads(before)}, after "
                  f"{_loads(after)} ({os.cpu_count()} CPUs)"]  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--asr-preset", default="h100-voxtral-realtime-4b")
    parser.add_argument("--tts-preset", default="h100-orpheus-3b")
    parser.add_argument("--load", type=float, default=2.0, help="callers x the TTS cap")
    parser.add_argument("--tts-cap", type=int, help="TTS cap (default: recommended)")
    parser.add_argument("--asr-cap", type=int, help="ASR cap (default: recommended)")
    parser.add_argument("--speak", type=float, default=1.0,
                        help="seconds the caller speaks before the TTS answer")  # fmt: skip
    parser.add_argument("--hold-s", type=float, default=5.0, help="reservation hold_s")
    parser.add_argument("--call-timeout", type=float, default=120.0,
                        help="longest TTS answer before the call counts as failed")  # fmt: skip
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--hold", type=float, default=30.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=5.0, help="excluded seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    # A load-generator process (started by _measure, not by hand).
    parser.add_argument("--worker", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--records-out", help=argparse.SUPPRESS)
    parser.add_argument("--asr-model", help=argparse.SUPPRESS)
    parser.add_argument("--tts-model", help=argparse.SUPPRESS)
    parser.add_argument("--sample-rate", type=int, default=24000, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1:
        raise SystemExit("--clients must be >= 1")
    return run_bench(args, _worker, run_voice_agent, render)


if __name__ == "__main__":
    sys.exit(main())
