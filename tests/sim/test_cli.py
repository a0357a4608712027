"""``headroom sim`` through :func:`add_arguments` and :func:`run`, as the lead wires them."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import subprocess
import sys

import httpx
import pytest

from proxy.sim import sim_command as cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="headroom sim")
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_list_presets() -> None:
    out = io.StringIO()
    assert cli.run(parse("--list-presets"), out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == [
        "l4-cosyvoice2-0.5b",
        "l40s-qwen3tts-1.7b",
        "h200-qwen3tts-1.7b",
        "h100-qwen3tts-1.7b",
        "h100-voxtral-tts-4b",
        "h200-voxtral-tts-4b",
        "h100-orpheus-3b",
        "h100-voxtral-realtime-4b",
    ]
    assert "(default)" in lines[1]
    out = io.StringIO()
    cli.run(parse("--list-presets", "--json"), out)
    assert json.loads(out.getvalue())[0]["preset"] == "l4-cosyvoice2-0.5b"


def test_describe_json() -> None:
    out = io.StringIO()
    assert cli.run(parse("--describe", "l40s-qwen3tts-1.7b", "--json"), out) == 0
    info = json.loads(out.getvalue())
    assert info["single_stream_rtf"] == pytest.approx(0.245, rel=0.05)
    assert info["ceiling"] == 0  # vLLM-Omni's default chunking stalls at the first seam
    assert info["limited_by"] == ["stalls"]
    out = io.StringIO()
    assert cli.run(parse("--describe", "l40s-qwen3tts-1.7b", "--json",
                         "--codec-chunk-ramp", "4,4,8,16,25"), out) == 0  # fmt: skip
    ramped = json.loads(out.getvalue())
    assert ramped["chunk_schedule"] == "4, 4, 8, 16, 25, then 25"
    assert ramped["ceiling"] >= 4
    assert ramped["recommended_cap"] <= ramped["ceiling_range"][0] <= ramped["ceiling"]
    out = io.StringIO()
    assert cli.run(parse("--describe", "l40s-qwen3tts-1.7b"), out) == 0
    assert "limited_by" in out.getvalue()
    # The text output labels which number is the cap and which is one seed's ceiling.
    assert "recommended_cap                0  <- set max_sessions to this" in out.getvalue()
    assert "ceiling                        0 (seed 0; one draw" in out.getvalue()
    assert cli.run(parse("--describe", "l40s-qwen3tts-1.7b", "--codec-chunk-ramp", "4,x")) == 2


def test_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse("--describe", "no-such-preset")) == 2
    assert "unknown simulator preset" in capsys.readouterr().err
    assert cli.run(parse("--preset", "nope", "--port", "0")) == 2
    assert cli.run(parse("--gpus", "0")) == 2
    assert cli.run(parse("--fault-drop-after", "-1", "--port", "0")) == 2


def test_serve_prints_one_url_per_gpu_serves_and_stops_on_sigint() -> None:
    command = [
        sys.executable, "-m", "proxy.sim", "--preset", "h200-voxtral-tts-4b", "--gpus", "2",
        "--port", "0", "--json", "--max-num-seqs", "3", "--kv-cache-gib", "2",
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            urls = json.loads(proc.stdout.readline())["urls"]
            assert len(urls) == 2
            with httpx.Client(timeout=10) as client:
                for url in urls:
                    assert client.get(url + "/health").status_code == 200
                stats = client.get(urls[1] + "/sim/stats").json()
            assert stats["gpu"] == 1
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    with httpx.Client(timeout=5) as client, pytest.raises(httpx.ConnectError):
        client.get(urls[0] + "/health")


def test_exit_after_stops_serving() -> None:
    out = io.StringIO()
    assert cli.run(parse("--port", "0", "--exit-after", "0.2"), out) == 0
    assert out.getvalue().startswith("headroom sim: l40s-qwen3tts-1.7b")
    assert out.getvalue().count("http://127.0.0.1:") == 1


async def test_run_refuses_inside_a_running_loop() -> None:
    # asyncio.run() cannot nest; the lead calls run() from synchronous main().
    with pytest.raises(RuntimeError, match="running_cluster"):
        cli.run(parse("--port", "0", "--exit-after", "0"))
    await asyncio.sleep(0)
