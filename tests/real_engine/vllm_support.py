"""What the vLLM tests share: the engine (or the test's failure or skip without it), a
``headroom serve`` process in front of it, and the readings compared on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.overload import _child
from bench.vllm_engine import VllmEngine, VllmServer, cached_vllm, metric_value

__all__ = ["gateway", "metric_value", "need_vllm", "normalize_sse", "wait_for"]

#: Fields that differ between two runs of the same request: ids and timestamps.
RUN_FIELDS = frozenset({"id", "created"})


def need_vllm() -> VllmEngine:
    """The installed engine; without it the test fails under CI (``.ci/run`` installs it
    first) and is skipped elsewhere."""
    engine = cached_vllm()
    if engine is None:
        message = "vLLM is not installed: python -m bench.vllm_engine (a few minutes)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return engine


@contextlib.asynccontextmanager
async def gateway(
    engine: VllmServer, routes: list[dict[str, Any]], *, cap: int
) -> AsyncIterator[str]:
    """``headroom serve`` (a child process) with one pool of one replica, ``engine`` at
    ``max_sessions=cap``, no queue; yields its URL. Metrics are on the client port. On
    the way out the last lines of the gateway's log and of the engine's are printed (the
    test's captured output), so a failing test shows why a session ended as it did."""
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},
        "log_level": "info",
        "log_format": "text",
        "pools": [{"name": "main", "queue": {"max_depth": 0, "max_wait_s": 10},
                   "replicas": [{"name": "vllm0", "url": engine.url, "max_sessions": cap}]}],
        "routes": [{"pool": "main", **route} for route in routes],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "headroom.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = [sys.executable, "-m", "proxy.process.cli", "serve", "--config", str(path)]
        log: deque[str] = deque(maxlen=200)
        try:
            async with _child(serve, "stderr", "headroom: serving on ", keep=log) as banner:
                yield banner.rsplit(" ", 1)[-1]
        finally:
            print("headroom's log:", *log, sep="\n")
            with contextlib.suppress(OSError):
                engine_log = engine.log.read_text(errors="replace").splitlines()[-40:]
                print("the engine's log:", *engine_log, sep="\n")


def normalize_sse(lines: list[str]) -> list[Any]:
    """An SSE body's events in order: each ``data:`` payload parsed as JSON without the
    fields that differ between runs, or the literal ``[DONE]``; other lines are kept as
    they are (blank separators dropped)."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        if line.startswith("data: ") and line != "data: [DONE]":
            data = json.loads(line[len("data: ") :])
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k not in RUN_FIELDS}
            events.append(data)
        else:
            events.append(line)
    return events


async def wait_for(
    read: Callable[[], Any], done: Callable[[Any], bool], *, within_s: float = 30.0
) -> Any:
    """Read until ``done(value)`` or ``within_s`` passed; return the last value read (the
    caller asserts on it, so a value that never came shows in the failure)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        value = await read()
        if done(value) or loop.time() > deadline:
            return value
        await asyncio.sleep(0.1)
