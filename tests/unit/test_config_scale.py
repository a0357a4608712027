"""A large configuration costs work in proportion to its size, and a reload does that work
off the event loop.

The work is counted, not timed: the Python function calls a load makes, per mapping key
of documents of several sizes (``bench/config_apply.py`` times the same documents and
``bench/RESULTS.md`` has the figures). Which thread parses is recorded on a running
gateway, for the SIGHUP path and ``POST /admin/reload``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest

from bench.config_apply import generate, mapping_keys
from proxy.process.gateway import Gateway
from proxy.settings import load_settings, settings_from_text, strict_yaml

KiB = 1024
#: Python function calls per mapping key, at most: a load builds a document from the
#: parser's events (a few calls a scalar); PyYAML's pure-Python parser made over 300.
PARSE_CALLS_PER_KEY = 10
#: The same for parsing and validating a whole configuration.
SETTINGS_CALLS_PER_KEY = 15


def python_calls(work: Callable[[], Any]) -> int:
    """How many Python functions ``work()`` called (C functions not counted)."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(before)
    return calls


def python_lines(work: Callable[[], Any]) -> int:
    """How many lines of Python ``work()`` ran (a loop's body counts once a turn)."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(before)
    return lines


@pytest.mark.parametrize(
    ("work", "bound"),
    [
        (lambda text: strict_yaml.load(text), PARSE_CALLS_PER_KEY),
        (lambda text: settings_from_text(text, env={}), SETTINGS_CALLS_PER_KEY),
    ],
    ids=["parse", "parse-and-validate"],
)
def test_the_work_per_key_is_bounded_whatever_the_size(
    work: Callable[[str], Any], bound: int
) -> None:
    counts = []  # (mapping keys, calls) by size
    for size in (32 * KiB, 128 * KiB, 512 * KiB):
        text, api_keys = generate(size)
        keys = mapping_keys(strict_yaml.load(text))
        assert keys > 4 * api_keys  # the API keys are most of the document
        counts.append((keys, python_calls(lambda text=text: work(text))))
    assert counts[-1][1] <= bound * counts[-1][0], counts
    # linear: what a key added costs does not grow with the number of keys already there
    added = [(c2 - c1) / (k2 - k1) for (k1, c1), (k2, c2) in itertools.pairwise(counts)]
    assert max(added) <= bound and added[1] <= 1.1 * added[0], added


def test_a_duplicate_in_a_large_document_is_found_with_bounded_work() -> None:
    """The repeated key sends the load to the node-based path, which names it: more work
    a key than the event path, still bounded (PyYAML's pure-Python path made over 300
    calls a key)."""
    text, _ = generate(256 * KiB)
    text += "    - name: tenant-000000\n      name: again\n      sha256: " + "0" * 64 + "\n"
    keys = text.count(": ")

    def load() -> None:
        with pytest.raises(strict_yaml.DuplicateKeyError):
            strict_yaml.load(text)

    assert python_calls(load) <= 4 * PARSE_CALLS_PER_KEY * keys


# -- off the event loop ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_gateway(path: Path) -> AsyncIterator[Gateway]:
    gateway = Gateway(load_settings(path, env={}), config_path=str(path), env={})
    task = asyncio.ensure_future(gateway.serve(install_signals=False))
    ready = asyncio.ensure_future(gateway.server.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    assert gateway.server.started
    try:
        yield gateway
    finally:
        ready.cancel()
        gateway.stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 15)


@pytest.fixture
def parse_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads :func:`proxy.settings.strict_yaml.load` runs in, in order."""
    threads: list[int] = []
    load = strict_yaml.load

    def recording(text: str, name: str | None = None) -> Any:
        threads.append(threading.get_ident())
        return load(text, name)

    monkeypatch.setattr(strict_yaml, "load", recording)
    return threads


async def test_a_sighup_reload_parses_off_the_event_loop(
    tmp_path: Path, parse_threads: list[int]
) -> None:
    path = tmp_path / "headroom.yaml"
    path.write_text(generate(4 * KiB)[0])
    async with running_gateway(path) as gateway:
        before = len(gateway.runtime.settings.auth.keys)  # type: ignore[union-attr]
        path.write_text(generate(64 * KiB)[0])
        parse_threads.clear()
        await gateway._on_sighup()
        assert parse_threads and threading.get_ident() not in parse_threads
        assert len(gateway.runtime.settings.auth.keys) > before  # type: ignore[union-attr]


async def test_an_admin_reload_parses_off_the_event_loop(
    tmp_path: Path, parse_threads: list[int]
) -> None:
    path = tmp_path / "headroom.yaml"
    path.write_text(generate(4 * KiB)[0])
    async with running_gateway(path) as gateway:
        path.write_text(generate(64 * KiB)[0])
        parse_threads.clear()
        async with httpx.AsyncClient() as client:
            answer = await client.post(f"http://127.0.0.1:{gateway.admin_port}/admin/reload")
        assert answer.status_code == 200 and answer.json()["reloaded"] is True
        assert parse_threads and threading.get_ident() not in parse_threads


def test_a_key_is_found_without_scanning_the_keys() -> None:
    """The API key lookup (every authenticated request) costs the same with ten keys as
    with thousands, after a reload as before it."""
    settings = settings_from_text(generate(512 * KiB)[0], env={})
    auth = settings.auth
    assert auth is not None and len(auth.keys) > 3000
    last = auth.keys[-1]
    assert auth.key_for(last.sha256) is last  # the index is built on the first lookup
    assert python_lines(lambda: auth.key_for(last.sha256)) <= 10
    assert auth.key_for("0" * 64) is None
    fewer = auth.model_copy(update={"keys": auth.keys[:10]})  # a copy with other keys
    assert fewer.key_for(last.sha256) is None
    assert fewer.key_for(auth.keys[0].sha256) is auth.keys[0]
