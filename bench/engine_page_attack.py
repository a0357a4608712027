"""A lying or slow engine page against ``engine_reconcile``: engine samples over the cap.

One simulated GPU (pool ``tts``, capped at ``--cap``, ``engine_reconcile`` on) runs
``--bypass`` streams no gateway admitted; a replica of another pool (``other``, listed
first, so a gateway scraping one replica after the other reaches it first) serves a
vLLM ``/metrics`` page. Clients keep trying to open sessions on ``tts``. Once the
reduction is in force, the other replica's page turns into the attack:

* ``nan``: ``vllm:num_requests_running NaN`` from then on;
* ``slow``: a page that sends one byte every ``--drip-s`` seconds and never ends.

The simulated engine's own requests (running + waiting, bypass streams included) are
sampled every 10 ms against the cap over the whole run; a sample above it is a
GPU running more streams than its cap.

    python bench/engine_page_attack.py --attack nan
    python bench/engine_page_attack.py --attack slow --json out.json

Everything runs in this process on 127.0.0.1 ports chosen by the OS and stops after
``--duration`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import InvalidStatus, WebSocketException  # noqa: E402

from proxy.app import create_app  # noqa: E402
from proxy.process.gateway import uvicorn_options  # noqa: E402
from proxy.process.serving import running_server  # noqa: E402
from proxy.runtime import Runtime  # noqa: E402
from proxy.settings import Settings, settings_from_mapping  # noqa: E402
from proxy.sim.cluster import running_cluster  # noqa: E402

PRESET = "h100-orpheus-3b"
ROUTE = "/v1/audio/speech/stream"
#: About two minutes of speech: a session's request stays in the engine while it is open.
LONG_TEXT = " ".join(["steady"] * 300) + "."
SAMPLE_S = 0.01
#: Audio streamed as the engine makes it, so a closed session's request leaves the engine
#: at its next chunk (a whole-sentence reply would keep generating for minutes).
CONFIG = {"type": "session.config", "voice": "tara", "response_format": "pcm",
          "stream_audio": True}  # fmt: skip


def vllm_page(running: str) -> bytes:
    return (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    ).encode()


class OtherReplica:
    """The other pool's engine page: honest until :attr:`attack` is set."""

    def __init__(self, drip_s: float) -> None:
        self.attack: str | None = None
        self.drip_s = drip_s
        self.stop = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if self.attack == "slow":
            await send({"type": "http.response.body", "body": b"#", "more_body": True})
            while not self.stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.drip_s)
                await send({"type": "http.response.body", "body": b" ", "more_body": True})
            await send({"type": "http.response.body", "body": b"\n"})
            return
        page = vllm_page("NaN" if self.attack == "nan" else "0")
        await send({"type": "http.response.body", "body": page})


def settings(sim_url: str, other_url: str, args: argparse.Namespace) -> Settings:
    return settings_from_mapping(
        {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"enabled": False},
            "health": {"engine_metrics_interval_s": args.interval_s},
            "pools": [
                {"name": "other",
                 "replicas": [{"name": "gpu1", "url": other_url, "max_sessions": args.cap}]},
                {"name": "tts", "engine_reconcile": True,
                 "engine_reconcile_hold_s": args.hold_s,
                 "queue": {"max_depth": 0, "max_wait_s": 1},
                 "replicas": [{"name": "gpu0", "url": sim_url, "max_sessions": args.cap}]},
            ],
            "routes": [{"path": ROUTE, "pool": "tts", "protocol": "vllm-omni-speech-ws"},
                       {"path": "/other", "pool": "other", "protocol": "passthrough-ws"}],
        },
        env={},
    )  # fmt: skip


async def client(url: str, hold_s: float, until: float, counts: dict[str, int]) -> None:
    """Open a session, keep it ``hold_s`` seconds, close it; refused: retry soon."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            async with connect(url) as ws:
                counts["admitted"] += 1
                await ws.send(json.dumps(CONFIG))
                await ws.send(json.dumps({"type": "input.text", "text": LONG_TEXT}))
                await ws.send(json.dumps({"type": "input.done"}))
                end = min(until, loop.time() + hold_s)
                while loop.time() < end:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ws.recv(), end - loop.time())
        except InvalidStatus:
            counts["refused"] += 1
            await asyncio.sleep(0.1)
        except (OSError, WebSocketException):
            counts["failed"] += 1
            await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    other = OtherReplica(args.drip_s)
    async with (
        running_cluster(PRESET, gpus=1) as cluster,
        running_server(other) as other_server,
    ):
        gpu = cluster.gpus[0]
        gpu.bypass.set_count(args.bypass)
        runtime = Runtime(settings(gpu.url, other_server.http_url, args))
        app = create_app(runtime)
        async with running_server(app, **uvicorn_options(runtime.settings, app)) as gateway:
            loop = asyncio.get_running_loop()

            def cap() -> int:
                return int(runtime.gate.statistics()["tts"].replicas[0].cap)

            # The reduction in force before any client or attack.
            end = loop.time() + 30
            while cap() != max(1, args.cap - args.bypass):
                if loop.time() > end:
                    raise SystemExit(f"the reduction never came (cap {cap()})")
                await asyncio.sleep(0.05)
            start = loop.time()
            until = start + args.duration
            counts = {"admitted": 0, "refused": 0, "failed": 0}
            url = gateway.ws_url + ROUTE
            clients = [
                asyncio.create_task(client(url, args.session_s, until, counts))
                for _ in range(args.clients)
            ]
            samples = over = peak = 0
            caps: set[int] = set()
            attacked_at: float | None = None
            while (now := loop.time()) < until:
                if attacked_at is None and now - start >= args.attack_after_s:
                    other.attack, attacked_at = args.attack, now
                stats = gpu.engine.stats()
                in_engine = stats.running + stats.waiting
                samples += 1
                over += in_engine > args.cap
                peak = max(peak, in_engine)
                caps.add(cap())
                await asyncio.sleep(SAMPLE_S)
            other.stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
            errors = {
                (s.labels["pool"], s.labels["replica"], s.labels["reason"]): s.value
                for family in runtime.metrics.registry.collect()
                if family.name == "headroom_engine_scrape_errors"
                for s in family.samples
                if s.name.endswith("_total")
            }
        gpu.bypass.set_count(0)
    return {
        "attack": args.attack,
        "cap": args.cap,
        "bypass_streams": args.bypass,
        "samples": samples,
        "samples_over_cap": over,
        "peak_in_engine": peak,
        "caps_seen": sorted(caps),
        "sessions": counts,
        "scrape_errors": {"/".join(k): v for k, v in errors.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attack", choices=["nan", "slow", "none"], default="nan")
    parser.add_argument("--cap", type=int, default=3)
    parser.add_argument("--bypass", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    parser.add_argument("--attack-after-s", type=float, default=3.0)
    parser.add_argument("--interval-s", type=float, default=1.0, help="engine scrape interval")
    parser.add_argument("--hold-s", type=float, default=5.0, help="engine_reconcile_hold_s")
    parser.add_argument("--session-s", type=float, default=6.0, help="each session's length")
    parser.add_argument("--drip-s", type=float, default=1.5, help="slow page: s per byte")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    started = time.monotonic()
    result = asyncio.run(run(args))
    describe = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
    tree = subprocess.run(describe, capture_output=True, text=True, check=False).stdout
    result["tree"] = tree.strip() or str(ROOT)
    result["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
