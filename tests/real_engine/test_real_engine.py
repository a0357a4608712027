"""The real-engine tier: the probe and the overload proof against a continuous-batching
engine nobody here wrote (llama.cpp's ``llama-server``, built from the pinned sdist by
``python -m bench.llama_engine``; .ci/run builds it first), and the same run against the
simulator's completions endpoint.

The engine is CPU-bound on a machine other tests share, so no figure is fixed in
advance: the probe measures the ceiling first, the overload then runs at the low end of
the range the probe saw, so the cap follows the machine's speed at the time. What must
hold whatever that speed: the probe reports a ceiling of at least 1 with its range;
through Headroom at that cap, no admitted stream's modelled playback runs dry; straight
at the engine with three times as many users, streams do run dry.
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
from bench.tiny_model import TinyModel, write_tiny_model

pytestmark = pytest.mark.slow

SHORT = ["--levels", "2,4,...", "--max-level", "32", "--hold", "8", "--warmup", "3",
         "--repeat", "1", "--probe-time-limit", "420", "--load", "3",
         "--overload-hold", "15", "--overload-warmup", "5", "--clients", "2"]  # fmt: skip


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


def run(engine_url: str) -> dict[str, Any]:
    args = build_parser().parse_args(SHORT)
    result = asyncio.run(run_on_engine(engine_url, args))
    print(render(result))
    return result


def check(result: dict[str, Any]) -> None:
    probe = result["probe"]
    low, high = probe["ceiling_range"]
    assert 1 <= low <= probe["ceiling"] <= high, render(result)
    assert result["cap"] == low
    headroom, direct = result["headroom"], result["direct"]
    assert headroom["sessions_started"] > 0 and headroom["errors"] == 0, render(result)
    assert headroom["sessions_refused"] > 0, render(result)
    assert headroom["underruns"] == 0, render(result)
    assert direct["underruns"] > 0, render(result)


def test_probe_and_overload_against_the_simulators_completions() -> None:
    with sim_engine() as url:
        check(run(url))


def test_probe_and_overload_against_llama_server() -> None:
    binary = cached_llama_server()
    if binary is None:
        message = "llama-server is not built: python -m bench.llama_engine (a few minutes)"
        if os.environ.get("CI"):  # .ci/run builds it: a missing engine is a failure
            pytest.fail(f"{message}; CI must build it")
        pytest.skip(message)
    shape = TinyModel()
    model = default_cache() / f"tiny-{shape.layers}x{shape.hidden}x{shape.ff}-v{shape.vocab}.gguf"
    if not model.is_file():
        write_tiny_model(model.with_suffix(".tmp"), shape)
        model.with_suffix(".tmp").replace(model)

    async def main() -> dict[str, Any]:
        async with llama_server(binary, model, free_port()) as url:
            args = build_parser().parse_args(SHORT)
            return await run_on_engine(url, args)

    result = asyncio.run(main())
    print(render(result))
    check(result)
