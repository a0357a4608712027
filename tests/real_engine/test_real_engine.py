"""The real-engine tier: the probe and the overload proof against a continuous-batching
engine nobody here wrote (llama.cpp's ``llama-server``, built from the pinned sdist by
``python -m bench.llama_engine``; .ci/run builds it first), and the same run against the
simulator's completions endpoint.

The engine is CPU-bound on a machine other tests share, so no figure is fixed in
advance: the probe measures the ceiling first, the overload then runs at the low end of
the range the probe saw, so the cap follows the machine's speed at the time. What must
hold whatever that speed: the probe reports a ceiling of at least 1 with its range;
through Headroom at that cap, no admitted stream's modelled playback runs dry; straight
at the engine with three times as many users (and against llama-server at least two more
than its slots, so the engine is saturated even when a busy moment made the cap small),
streams run dry or their slow tail falls below the 1.2x margin the cap keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from bench.harness import free_port
from bench.llama_engine import cached_llama_server, default_cache, llama_server
from bench.real_engine import build_parser, render, run_on_engine
from bench.tiny_model import TinyModel, ensure_model

pytestmark = pytest.mark.slow

#: The CI version: each probe level held 6 s, the overload 15 s. The full-length runs are
#: ``python -m bench.real_engine`` (llama-server) and ``python -m bench.real_engine
#: --engine-url URL --tokens-per-audio-second 12.5`` (the simulator), with their defaults.
SHORT = ["--levels", "2,4,...", "--max-level", "16", "--hold", "6", "--warmup", "4",
         "--repeat", "1", "--probe-time-limit", "420", "--load", "3",
         "--overload-hold", "15", "--overload-warmup", "5", "--clients", "2"]  # fmt: skip
#: llama-server's slots (16) plus two: the direct side saturates the engine even when a
#: busy moment made the probe's cap small (3x a cap of 2 would not).
SATURATE = ("--min-users", "18")
#: The delivery-ratio margin a ceiling keeps (the guard's default threshold).
GUARD = 1.2
#: The simulator's probe: its engine is deterministic (probe-test-tts-c4, ceiling 4 in
#: ``describe()``; tests/probe/test_e2e.py finds that ceiling exactly with 4 s holds), so
#: its probe starts at 4 and warms each level up for half as long as llama-server's.
SIM_PROBE = ("--levels", "4,...", "--warmup", "2")


@contextlib.contextmanager
def sim_engine() -> Iterator[str]:
    """The simulator (a deterministic 12.5-tokens-per-second preset) in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.probe.simserver", "probe-test-tts-c4"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())["url"]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the server stops when its stdin closes
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def run(engine_url: str, *extra: str) -> dict[str, Any]:
    args = build_parser().parse_args([*SHORT, *extra])
    result = asyncio.run(run_on_engine(engine_url, args))
    print(render(result))
    return result


def check(result: dict[str, Any]) -> None:
    probe = result["probe"]
    low, high = probe["ceiling_range"]
    assert 1 <= low <= probe["ceiling"] <= high, render(result)
    assert result["cap"] == low
    headroom, direct = result["headroom"], result["direct"]
    # Admitted streams delivered audio in the window (at a small cap they may all have
    # started during the warm-up and outlast it, so none *starts* in the window).
    assert headroom["chunks"] > 0 and headroom["errors"] == 0, render(result)
    assert headroom["sessions_refused"] > 0, render(result)
    assert headroom["underruns"] == 0, render(result)
    # Direct, the engine is past its knee: streams run dry, or (a short hold on a quiet
    # moment, when llama-server's slots hold the rest in its own queue) their slow tail
    # falls below the 1.2x margin the cap keeps.
    assert direct["underruns"] > 0 or direct["worst_delivery_ratio"] < GUARD, render(result)


def test_probe_and_overload_against_the_simulators_completions() -> None:
    with sim_engine() as url:  # its tokens are 80 ms of audio each, as Qwen3-TTS's
        check(run(url, "--tokens-per-audio-second", "12.5", *SIM_PROBE))


def test_probe_and_overload_against_llama_server() -> None:
    binary = cached_llama_server()
    if binary is None:
        message = "llama-server is not built: python -m bench.llama_engine (a few minutes)"
        if os.environ.get("CI"):  # .ci/run builds it: a missing engine is a failure
            pytest.fail(f"{message}; CI must build it")
        pytest.skip(message)
    model = ensure_model(default_cache(), TinyModel())

    async def main() -> dict[str, Any]:
        async with llama_server(binary, model, free_port()) as url:
            args = build_parser().parse_args([*SHORT, *SATURATE])
            return await run_on_engine(url, args)

    result = asyncio.run(main())
    print(render(result))
    check(result)
