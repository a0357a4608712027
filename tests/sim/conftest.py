"""Shared fixtures: simulated GPUs on 127.0.0.1 with free ports; a per-test deadline.

Real-time tests use fast presets (H200-class step times, short chunks) so a session
lasts a fraction of a second; they assert on content and ordering, not durations.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.sim import Timeouts, get_preset, running_cluster
from proxy.sim.cluster import Cluster

#: A quick TTS GPU: Voxtral TTS on H200 (8 ms steps) with 5-token (0.4 s) chunks.
FAST_TTS = replace(get_preset("h200-voxtral-tts-4b"), name="test-fast-tts", chunk_tokens=5)
#: The ASR preset as is (8 ms steps, 480 ms segments).
ASR = get_preset("h100-voxtral-realtime-4b")
#: Short speech-WebSocket limits so timeout tests take well under a second. Only the
#: tests of those limits get them (``tts_quick``): on a loaded machine a 0.3 s idle limit
#: could cut another test's session between two of its messages.
QUICK_TIMEOUTS = Timeouts(speech_config_s=0.3, speech_idle_s=0.3)


@pytest.fixture
async def tts() -> AsyncIterator[Cluster]:
    async with running_cluster(FAST_TTS, gpus=1) as cluster:
        yield cluster


@pytest.fixture
async def tts_quick() -> AsyncIterator[Cluster]:
    async with running_cluster(FAST_TTS, gpus=1, timeouts=QUICK_TIMEOUTS) as cluster:
        yield cluster


@pytest.fixture
async def asr() -> AsyncIterator[Cluster]:
    async with running_cluster(ASR, gpus=1) as cluster:
        yield cluster


#: No simulator test may hang the suite: each async test is cancelled after this long.
TEST_TIMEOUT_S = 60.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if not isinstance(item, pytest.Function) or here not in item.path.parents:
            continue
        test = item.obj
        if inspect.iscoroutinefunction(test):
            item.obj = _with_deadline(test)


def _with_deadline(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    @functools.wraps(test)
    async def guarded(*args: object, **kwargs: object) -> None:
        await asyncio.wait_for(test(*args, **kwargs), TEST_TIMEOUT_S)

    return guarded
