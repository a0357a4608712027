"""``headroom demo``: the embedded default. Starts a simulated multi-GPU engine and the
gateway in front of it, with each GPU's cap set to the ceiling the simulator's own
model gives for the preset, prints the URLs and a one-line client command, and runs
until Ctrl-C (or ``--exit-after``).

The ceiling is ``describe()``'s: the largest load at which the worst 1 % of chunks
arrive at least 1.2x faster than realtime, no listener with a 0.2 s prebuffer stalls
and TTFA p99 stays within 1 s. It moves with the seed (the step-time jitter and the
utterance lengths), so the cap is the low end of its range over several seeds
(``recommended_cap``), and the banner gives the range and says so. vLLM-Omni's default
Qwen3-TTS chunking (a first chunk of 2-16 frames by load, then 25-frame chunks) stalls
such a listener at the first seam even alone (ceiling 0), so on presets with that schedule
the demo runs the engine with vLLM-Omni's documented ``codec_chunk_ramp`` example,
``[4, 4, 8, 16, 25]``, and says so (``--codec-chunk-ramp default`` keeps the engine's
default, and the banner then says what the listeners would need)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import sys
from typing import Any, TextIO

from proxy.settings import Settings, settings_from_mapping
from proxy.settings.topology import HANDSHAKE_WAIT_S

__all__ = ["DEMO_RAMP", "add_arguments", "demo_cap", "demo_preset", "demo_settings", "run"]

#: The demo's ``codec_chunk_ramp`` on presets whose first chunk depends on the load
#: (vLLM-Omni Qwen3-TTS): the example of vLLM-Omni's own documentation.
DEMO_RAMP = (4, 4, 8, 16, 25)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from proxy.sim.presets import DEFAULT_PRESET

    parser.add_argument("--preset", default=DEFAULT_PRESET, help="simulated deployment")
    parser.add_argument("--gpus", type=int, default=2, help="simulated GPUs (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--port", type=int, default=8080, help="gateway port (0: any free)")
    parser.add_argument("--sim-port", type=int, default=0, help="first simulator port (0: free)")
    parser.add_argument(
        "--cap", type=int,
        help="sessions per GPU (default: the preset's recommended cap, the largest level at "
        "or below the low end of its ceiling over seeds that every seed passes)",
    )  # fmt: skip
    parser.add_argument(
        "--queue-depth", type=int, default=8, help="sessions that may wait per pool (default 8)"
    )
    parser.add_argument(
        "--queue-wait", type=float, default=10.0,
        help="longest wait in the queue, s (default 10): HTTP requests and queue-feedback "
        "WebSocket sessions",
    )  # fmt: skip
    parser.add_argument(
        "--handshake-wait", type=float, metavar="S",
        help="longest wait of a WebSocket session whose handshake is held in the queue, s "
        f"(default {HANDSHAKE_WAIT_S:g}, or --queue-wait if shorter): its 503 and Retry-After "
        "must reach the client before the client's own handshake timeout does "
        f"({_client_open_timeout():g} s in Python's websockets)",
    )  # fmt: skip
    parser.add_argument("--exit-after", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument(
        "--codec-chunk-ramp", metavar="LIST|default",
        help="vLLM-Omni codec_chunk_ramp of the simulated engine (default on Qwen3-TTS: "
        f"{','.join(map(str, DEMO_RAMP))}; 'default': the engine's own load-dependent "
        "first chunk, which stalls listeners at the first seam)",
    )  # fmt: skip
    parser.add_argument(
        "--initial-codec-chunk-frames", type=int, metavar="N",
        help="vLLM-Omni initial_codec_chunk_frames: a fixed first chunk of N frames",
    )  # fmt: skip


def demo_preset(args: argparse.Namespace) -> tuple[Any, str]:
    """The preset the demo simulates and how its chunking was chosen (for the banner):
    ``--codec-chunk-ramp`` / ``--initial-codec-chunk-frames`` as given, else
    :data:`DEMO_RAMP` on a preset with a load-dependent first chunk, else the preset's."""
    from proxy.sim.chunks import parse_ramp
    from proxy.sim.presets import get_preset

    preset = get_preset(args.preset)
    default = preset.schedule.describe()
    first = args.initial_codec_chunk_frames
    if first is not None and first < 1:
        raise ValueError("--initial-codec-chunk-frames must be >= 1")
    given = args.codec_chunk_ramp
    if given is not None and given.strip().lower() == "default":
        ramp: tuple[int, ...] | None = None
        how = "the engine's default"
    elif given is not None:
        ramp = parse_ramp(given)
        how = f"codec_chunk_ramp {','.join(map(str, ramp))} (--codec-chunk-ramp)"
    elif first is None and preset.schedule.load_first:
        ramp = DEMO_RAMP
        how = (
            f"vLLM-Omni codec_chunk_ramp {','.join(map(str, ramp))}, the demo's choice;\n"
            f"                   the engine's default ({default}) stalls a 0.2 s "
            "listener at the first seam:\n                   ceiling 0 "
            "(--codec-chunk-ramp default runs it)"
        )
    else:
        ramp, how = None, "the engine's default"
    if first is not None:
        how = f"initial_codec_chunk_frames {first}" + (
            f", {how}" if ramp is not None else " (--initial-codec-chunk-frames)"
        )
    if ramp is not None or first is not None:
        preset = preset.with_schedule(initial_frames=first, ramp=ramp)
    return preset, how


def demo_settings(
    preset: Any, urls: list[str], cap: int, *, host: str, port: int, queue_depth: int,
    queue_wait: float, handshake_wait: float | None = None,
) -> Settings:  # fmt: skip
    """The gateway configuration for a simulated cluster (``handshake_wait`` None: the
    queue's default ``max_handshake_wait_s``)."""
    queue: dict[str, float] = {"max_depth": queue_depth, "max_wait_s": queue_wait}
    if handshake_wait is not None:
        queue["max_handshake_wait_s"] = handshake_wait
    pool = "asr-main" if preset.kind == "asr" else "tts-main"
    audio = {"sample_rate": preset.sample_rate}
    if preset.kind == "asr":
        routes = [
            {"path": "/v1/realtime", "pool": pool, "protocol": "vllm-realtime", "audio": audio},
            {"path": "/v1/audio/transcriptions", "pool": pool,
             "protocol": "openai-transcription-sse", "audio": audio},
        ]  # fmt: skip
    else:
        routes = [
            {"path": "/v1/audio/speech/stream", "pool": pool,
             "protocol": "vllm-omni-speech-ws", "audio": audio},
            {"path": "/v1/audio/speech", "pool": pool, "protocol": "openai-speech-http",
             "audio": audio},
            {"path": "/v1/realtime", "pool": pool, "protocol": "vllm-realtime", "audio": audio},
        ]  # fmt: skip
    data = {
        "listen": {"host": host, "port": port},
        "admin": {"enabled": False},
        # no admin listener here: /metrics on the demo's one port, as the banner says
        "metrics": {"client_port": True},
        "log_format": "text",
        "log_level": "warning",
        "pools": [
            {
                "name": pool,
                "replicas": [
                    {"name": f"gpu{i}", "url": url, "max_sessions": cap}
                    for i, url in enumerate(urls)
                ],
                "queue": queue,
            }
        ],
        "routes": routes,
    }
    return settings_from_mapping(data, env={}, source="headroom demo")


def demo_cap(args: argparse.Namespace, info: dict[str, Any]) -> int:
    """Sessions per GPU: ``--cap``, else ``describe()``'s ``recommended_cap`` (the low
    end of the ceiling over seeds), at least 1 so the demo serves at all."""
    return int(args.cap or max(1, int(info["recommended_cap"])))


def _ceiling_lines(info: dict[str, Any], cap: int, capped_by_user: bool) -> list[str]:
    """What the ceiling is over seeds, what limited it, and the rules it keeps
    (``describe()``'s)."""
    rules = info["ceiling_rules"]
    ceiling = int(info["ceiling"])
    low, high = (int(v) for v in info["ceiling_range"])
    seeds = ", ".join(info["ceiling_by_seed"])
    broke = ", ".join(info["limited_by"]) or "nothing (search limit)"
    kept = (
        f"worst-1% delivery >= {rules['threshold']:g}x realtime, no stall for a listener "
        f"with a {rules['prebuffer_s']:g} s prebuffer, TTFA p99 <= {rules['ttfa_p99_s']:g} s"
    )
    if high > 0:
        span = f"{low}" if low == high else f"{low}-{high}"
        lines = [
            f"  ceiling        : {span} sessions/GPU over seeds {seeds} ({ceiling} at seed "
            f"{info['seed']}: {ceiling + 1} broke: {broke})"
        ]
    else:
        lines = [f"  ceiling        : 0 sessions/GPU (one session already breaks: {broke})"]
        need = info.get("min_prebuffer_s")
        if need is not None:
            lines.append(
                f"  listeners need : >= {need:g} s of prebuffer with this chunking (ceiling "
                f"{info.get('ceiling_at_min_prebuffer')} with it)"
            )
    lines.append(f"  ceiling rules  : {kept}")
    if capped_by_user:
        why = "(--cap)"
    elif low == 0:
        why = "(no level keeps the rules on every seed; 1 so the demo serves at all: expect stalls)"
    else:
        why = "(the largest level at or below the range's low end that every seed passes)"
    lines.append(f"  cap per GPU    : {cap} {why}")
    return lines


def _client_open_timeout() -> float:
    """Python's websockets client's default bound on its whole opening handshake."""
    from websockets.asyncio.client import connect

    default = inspect.signature(connect).parameters["open_timeout"].default
    return float(default)


def _queue_lines(settings: Settings) -> list[str]:
    """How long a session may wait for a slot: HTTP requests up to ``max_wait_s``, a
    WebSocket session with its handshake held only its shorter wait (the pools of a demo
    share one queue setting), and whether that fits a client's handshake timeout."""
    queue = settings.pools[0].queue
    if not queue.max_depth or not queue.max_wait_s:
        return ["  queue          : none, 503 with Retry-After when every slot is busy"]
    timeout = _client_open_timeout()
    fits = (
        "inside the client's own handshake timeout"
        if queue.handshake_wait_s < timeout
        else "NOT inside the client's own handshake timeout: such a client gives up first"
    )
    return [
        f"  queue          : up to {queue.max_depth} waiting per pool (--queue-depth), then "
        "503 with Retry-After",
        f"  queue wait     : {queue.max_wait_s:g} s for HTTP (--queue-wait); "
        f"{queue.handshake_wait_s:g} s for a WebSocket, its handshake held "
        "(--handshake-wait),",
        f"                   {fits} ({timeout:g} s in Python's websockets)",
    ]


def _banner(
    preset: Any, info: dict[str, Any], cap: int, settings: Settings, gateway_url: str,
    urls: list[str], chunking: str = "the engine's default", *, capped_by_user: bool = False,
) -> str:  # fmt: skip
    """What the demo serves. The route list is generated from ``settings`` -- the same
    object the gateway serves -- so the banner cannot list a route that is not there or
    miss one that is."""
    ws_url = gateway_url.replace("http://", "ws://", 1)
    lines = [
        f"Headroom demo: {preset.name} ({preset.description})",
        f"  simulated GPUs : {', '.join(urls)}",
        f"  chunking       : {info['chunk_schedule']} tokens per chunk ({chunking})",
        *_ceiling_lines(info, cap, capped_by_user),
        *_queue_lines(settings),
        f"  gateway        : {gateway_url}",
        f"  metrics        : {gateway_url}/metrics",
        f"  ready          : {gateway_url}/readyz",
        "",
        "Routes (each admitted through the gate, then relayed to a simulated GPU):",
    ]
    served = [
        ((ws_url if r.is_websocket else gateway_url) + r.path, r.is_websocket, r.protocol)
        for r in settings.routes
    ]
    width = max(len(url) for url, _, _ in served)
    for url, websocket, protocol in served:
        lines.append(f"  {url:<{width}}  {'WebSocket' if websocket else 'POST'}, {protocol}")
    paths = {route.path for route in settings.routes}
    if "/v1/audio/speech" in paths:
        lines += [
            "",
            "Stream speech through the gateway into a WAV file (a refusal exits 22 and "
            "leaves its JSON in hello.wav):",
            f"  curl -sSN --fail-with-body {gateway_url}/v1/audio/speech "
            f"-H 'Content-Type: application/json' "
            f'-d \'{{"model": "{preset.model}", "input": "Hello from Headroom. Every '
            f'listener keeps realtime.", "voice": "default", "response_format": '
            f'"wav", "stream": true, "stream_format": "audio"}}\' -o hello.wav',
        ]
    if "/v1/audio/transcriptions" in paths:
        lines += [
            "",
            "Transcribe a WAV file (PCM16) through the gateway, streamed as it is decoded:",
            f"  curl -sSN --fail-with-body {gateway_url}/v1/audio/transcriptions "
            "-F file=@speech.wav "
            f"-F model={preset.model} -F stream=true",
        ]
    lines += ["", "Ctrl-C to stop."]
    return "\n".join(lines)


async def _run(args: argparse.Namespace, out: TextIO) -> None:
    from proxy.process.gateway import Gateway
    from proxy.sim.capacity import describe
    from proxy.sim.cluster import running_cluster

    preset, chunking = demo_preset(args)
    info = describe(preset)
    cap = demo_cap(args, info)
    async with running_cluster(preset, gpus=args.gpus, host="127.0.0.1", port=args.sim_port) as c:
        settings = demo_settings(
            preset, c.urls, cap, host=args.host, port=args.port,
            queue_depth=args.queue_depth, queue_wait=args.queue_wait,
            handshake_wait=args.handshake_wait,
        )  # fmt: skip
        gateway = Gateway(settings)
        serving = asyncio.ensure_future(gateway.serve())
        ready = asyncio.ensure_future(gateway.server.ready.wait())
        await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        url = f"http://{args.host}:{gateway.port}"
        banner = _banner(
            preset, info, cap, settings, url, c.urls, chunking, capped_by_user=bool(args.cap)
        )
        print(banner, file=out, flush=True)
        try:
            if args.exit_after is not None:
                await asyncio.wait({serving}, timeout=args.exit_after)
                gateway.stop()
            await serving
        finally:
            gateway.stop()
            with contextlib.suppress(BaseException):
                await serving


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from proxy.logs import configure_logging
    from proxy.process.eventloop import run_async

    configure_logging("warning", "text")
    run_async(_run(args, out or sys.stdout))
    return 0
