"""``headroom demo``: the embedded default. Starts a simulated multi-GPU engine and the
gateway in front of it, with each GPU's cap set to the ceiling the simulator's own
model gives for the preset, prints the URLs and a one-line client command, and runs
until Ctrl-C (or ``--exit-after``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any, TextIO

from proxy.settings import Settings, settings_from_mapping

__all__ = ["add_arguments", "demo_settings", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from proxy.sim.presets import DEFAULT_PRESET

    parser.add_argument("--preset", default=DEFAULT_PRESET, help="simulated deployment")
    parser.add_argument("--gpus", type=int, default=2, help="simulated GPUs (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--port", type=int, default=8080, help="gateway port (0: any free)")
    parser.add_argument("--sim-port", type=int, default=0, help="first simulator port (0: free)")
    parser.add_argument("--cap", type=int, help="sessions per GPU (default: the preset ceiling)")
    parser.add_argument("--queue-depth", type=int, default=8, help="queue depth per pool")
    parser.add_argument("--queue-wait", type=float, default=10.0, help="max queue wait, s")
    parser.add_argument("--exit-after", type=float, metavar="S", help="stop after S seconds")


def demo_settings(
    preset: Any, urls: list[str], cap: int, *, host: str, port: int, queue_depth: int,
    queue_wait: float,
) -> Settings:  # fmt: skip
    """The gateway configuration for a simulated cluster."""
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
        "log_format": "text",
        "log_level": "warning",
        "pools": [
            {
                "name": pool,
                "replicas": [
                    {"name": f"gpu{i}", "url": url, "max_sessions": cap}
                    for i, url in enumerate(urls)
                ],
                "queue": {"max_depth": queue_depth, "max_wait_s": queue_wait},
            }
        ],
        "routes": routes,
    }
    return settings_from_mapping(data, env={}, source="headroom demo")


def _banner(
    preset: Any, ceiling: int, cap: int, settings: Settings, gateway_url: str, urls: list[str]
) -> str:
    """What the demo serves. The route list is generated from ``settings`` -- the same
    object the gateway serves -- so the banner cannot list a route that is not there or
    miss one that is."""
    ws_url = gateway_url.replace("http://", "ws://", 1)
    lines = [
        f"Headroom demo: {preset.name} ({preset.description})",
        f"  simulated GPUs : {', '.join(urls)}",
        f"  ceiling        : {ceiling} sessions/GPU (worst-1% delivery >= 1.2x realtime)",
        f"  cap per GPU    : {cap}",
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
            "Stream speech through the gateway into a WAV file:",
            f"  curl -sN {gateway_url}/v1/audio/speech -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{preset.model}", "input": "Hello from Headroom. Every '
            f'listener keeps realtime.", "voice": "default", "response_format": '
            f'"wav", "stream": true, "stream_format": "audio"}}\' -o hello.wav',
        ]
    if "/v1/audio/transcriptions" in paths:
        lines += [
            "",
            "Transcribe a WAV file (PCM16) through the gateway, streamed as it is decoded:",
            f"  curl -sN {gateway_url}/v1/audio/transcriptions -F file=@speech.wav "
            f"-F model={preset.model} -F stream=true",
        ]
    lines += ["", "Ctrl-C to stop."]
    return "\n".join(lines)


async def _run(args: argparse.Namespace, out: TextIO) -> None:
    from proxy.gateway import Gateway
    from proxy.sim.capacity import describe
    from proxy.sim.cluster import running_cluster
    from proxy.sim.presets import get_preset

    preset = get_preset(args.preset)
    ceiling = int(describe(preset.name)["ceiling"])
    cap = args.cap or max(1, ceiling)
    async with running_cluster(preset, gpus=args.gpus, host="127.0.0.1", port=args.sim_port) as c:
        settings = demo_settings(
            preset, c.urls, cap, host=args.host, port=args.port,
            queue_depth=args.queue_depth, queue_wait=args.queue_wait,
        )  # fmt: skip
        gateway = Gateway(settings)
        serving = asyncio.ensure_future(gateway.serve())
        ready = asyncio.ensure_future(gateway.server.ready.wait())
        await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        url = f"http://{args.host}:{gateway.port}"
        print(_banner(preset, ceiling, cap, settings, url, c.urls), file=out, flush=True)
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
    from proxy.cli import run_async
    from proxy.logs import configure_logging

    configure_logging("warning", "text")
    run_async(_run(args, out or sys.stdout))
    return 0
