"""``headroom demo``: the banner lists exactly the routes the demo gateway serves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import wave

import httpx
import pytest
from websockets.asyncio.client import connect

from proxy.process.demo import (
    DEMO_RAMP,
    _banner,
    _run,
    add_arguments,
    demo_cap,
    demo_preset,
    demo_settings,
)
from proxy.sim.capacity import describe
from proxy.sim.presets import PRESETS, get_preset
from tests.integration.test_ws_relay import wait_until

ASR = next(name for name, preset in PRESETS.items() if preset.kind == "asr")
TTS = next(name for name, preset in PRESETS.items() if preset.kind == "tts")
ROUTE_LINE = re.compile(r"^  ((?:ws|http)://\S+)\s+(WebSocket|POST), (\S+)$", re.MULTILINE)


@pytest.mark.parametrize("name", [ASR, TTS])
def test_banner_lists_every_route_of_the_demo_settings(name: str) -> None:
    preset = get_preset(name)
    settings = demo_settings(
        preset, ["http://127.0.0.1:1"], 4, host="127.0.0.1", port=8080, queue_depth=8,
        queue_wait=10,
    )  # fmt: skip
    info = {
        "ceiling": 4, "limited_by": ["steady"], "chunk_schedule": "28, then 7", "seed": 0,
        "ceiling_range": [4, 5], "ceiling_by_seed": {"0": 4, "1": 5}, "recommended_cap": 4,
        "ceiling_rules": {"threshold": 1.2, "prebuffer_s": 0.2, "ttfa_p99_s": 1.0},
    }  # fmt: skip
    banner = _banner(preset, info, 4, settings, "http://127.0.0.1:8080", ["http://127.0.0.1:1"])
    listed = [(url, how, protocol) for url, how, protocol in ROUTE_LINE.findall(banner)]
    expected = [
        (
            ("ws://127.0.0.1:8080" if r.is_websocket else "http://127.0.0.1:8080") + r.path,
            "WebSocket" if r.is_websocket else "POST",
            r.protocol,
        )
        for r in settings.routes
    ]
    assert listed == expected
    if preset.kind == "asr":
        assert "http://127.0.0.1:8080/v1/audio/transcriptions" in banner
        assert (
            "curl -sSN --fail-with-body http://127.0.0.1:8080/v1/audio/transcriptions "
            "-F file=@" in banner
        )
    else:  # a refusal must not end up in hello.wav with exit status 0
        assert "curl -sSN --fail-with-body http://127.0.0.1:8080/v1/audio/speech" in banner
        assert banner.count("-o hello.wav") == 1


def _demo_banner(*argv: str) -> str:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(argv))
    preset, chunking = demo_preset(args)
    info = describe(preset)
    cap = demo_cap(args, info)
    settings = demo_settings(
        preset, ["http://127.0.0.1:1"], cap, host="127.0.0.1", port=8080, queue_depth=8,
        queue_wait=10,
    )  # fmt: skip
    return _banner(
        preset, info, cap, settings, "http://127.0.0.1:8080", ["http://127.0.0.1:1"],
        chunking, capped_by_user=bool(args.cap),
    )  # fmt: skip


def test_the_default_demo_runs_a_chunk_ramp_the_engine_offers_and_says_so() -> None:
    # vLLM-Omni's default Qwen3-TTS chunking has ceiling 0 (first-seam stalls): the demo
    # used to cap at max(1, 0) = 1 under a banner promising 1.2x realtime.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    preset, _ = demo_preset(parser.parse_args([]))
    assert preset.schedule.initial == DEMO_RAMP and not preset.schedule.load_first
    info = describe(preset)
    ceiling, (low, high) = info["ceiling"], info["ceiling_range"]
    assert 2 <= info["recommended_cap"] <= low <= ceiling <= high
    assert low == min(info["ceiling_by_seed"].values())
    banner = _demo_banner()
    assert "codec_chunk_ramp 4,4,8,16,25, the demo's choice" in banner
    span = f"{low}" if low == high else f"{low}-{high}"
    assert (
        f"ceiling        : {span} sessions/GPU over seeds 0, 1, 2, 3, 4 ({ceiling} at seed "
        f"0: {ceiling + 1} broke: stalls)" in banner
    )
    assert "no stall for a listener with a 0.2 s prebuffer" in banner
    # The cap is at most the low end of the range, not seed 0's ceiling.
    cap = info["recommended_cap"]
    assert f"cap per GPU    : {cap} (the largest level at or below the range's low end" in banner


def test_the_engine_default_chunking_shows_ceiling_0_and_the_buffer_listeners_need() -> None:
    banner = _demo_banner("--codec-chunk-ramp", "default")
    need = describe("l40s-qwen3tts-1.7b")["min_prebuffer_s"]
    assert "load 2/4/8/16, then 25 tokens per chunk (the engine's default)" in banner
    assert "ceiling        : 0 sessions/GPU (one session already breaks: stalls)" in banner
    assert f"listeners need : >= {need:g} s of prebuffer" in banner
    assert "cap per GPU    : 1 (no level keeps the rules on every seed" in banner
    capped = _demo_banner("--codec-chunk-ramp", "default", "--cap", "3")
    assert "cap per GPU    : 3 (--cap)" in capped


def test_presets_without_a_load_dependent_first_chunk_keep_their_schedule() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    preset, how = demo_preset(parser.parse_args(["--preset", "h100-orpheus-3b"]))
    assert preset.schedule == get_preset("h100-orpheus-3b").schedule
    assert how == "the engine's default"
    fixed, how = demo_preset(parser.parse_args(["--initial-codec-chunk-frames", "8"]))
    assert fixed.schedule.initial == (8,) and "initial_codec_chunk_frames 8" in how


def _wav(seconds: float = 0.3, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * int(seconds * rate))
    return buffer.getvalue()


async def test_every_route_the_asr_demo_banner_lists_is_served() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--preset", ASR, "--gpus", "1", "--port", "0"])
    out = io.StringIO()
    demo = asyncio.ensure_future(_run(args, out))
    try:
        await wait_until(lambda: "Ctrl-C" in out.getvalue() or demo.done(), timeout=60)
        assert not demo.done(), out.getvalue()
        routes = ROUTE_LINE.findall(out.getvalue())
        assert {url.rsplit("/v1", 1)[1] for url, _, _ in routes} == {
            "/realtime",
            "/audio/transcriptions",
        }
        model = get_preset(ASR).model
        async with httpx.AsyncClient(timeout=30) as client:
            for url, how, _ in routes:
                if how == "WebSocket":
                    async with connect(url, compression=None) as ws:
                        assert ws.response is not None and ws.response.status_code == 101
                    continue
                response = await client.post(
                    url,
                    files={"file": ("speech.wav", _wav(), "audio/wav")},
                    data={"model": model, "stream": "true"},
                )
                assert response.status_code == 200, response.text
                assert response.headers["content-type"].startswith("text/event-stream")
                assert "[DONE]" in response.text
    finally:
        demo.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await demo


def test_the_demo_serves_metrics_on_its_one_port_as_its_banner_says() -> None:
    # The demo has no admin listener, so /metrics is on the client listener.
    settings = demo_settings(
        get_preset(TTS), ["http://127.0.0.1:1"], 4, host="127.0.0.1", port=8080,
        queue_depth=8, queue_wait=10,
    )  # fmt: skip
    assert not settings.admin.enabled and settings.metrics.client_port
