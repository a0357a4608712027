"""A reload of ``headroom serve --workers 2`` reaches every worker or none (real processes,
a real redis-server, engines that count their concurrent streams exactly)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.process.serving import RunningServer, running_server
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation
from tests.shared_admission.test_workers import Served, _gone, _lease_holders, _wait_ready


class CountingEngine:
    """An engine stand-in: ``POST /sse`` streams until the client leaves; it counts the
    streams open at once, and the most ever open (``peak``), exactly."""

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] != "/sse":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
        finally:
            self.active -= 1


@pytest.fixture
async def engines() -> AsyncIterator[list[tuple[RunningServer, CountingEngine]]]:
    apps = [CountingEngine(), CountingEngine()]
    async with running_server(apps[0]) as a, running_server(apps[1]) as b:
        yield [(a, apps[0]), (b, apps[1])]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def write_config(path: Path, urls: list[str], redis_url: str, cap: int) -> str:
    config = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": True, "host": "127.0.0.1", "port": 0},
        "drain_timeout_s": 60,
        "health": {"recheck_interval_s": 30, "engine_metrics_interval_s": 0},
        "pools": [{"name": "main",
                   "replicas": [{"name": f"gpu{i}", "url": url, "max_sessions": cap}
                                for i, url in enumerate(urls)],
                   "queue": {"max_depth": 0, "max_wait_s": 1}}],
        "routes": [{"path": "/sse", "pool": "main", "protocol": "passthrough-http"}],
        "admission": {"backend": "redis",
                      "redis": {"url": redis_url, "lease_ttl_s": 10, "renew_interval_s": 2,
                                "fence_margin_s": 1, "timeout_s": 0.5}},
    }  # fmt: skip
    text = yaml.safe_dump(config)
    path.write_text(text)
    return text


async def _start(config: Path) -> tuple[Served, str, str, list[int]]:
    served = Served(config, workers=2)
    port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
    admin = served.wait_for(r"admin listener on http://127\.0\.0\.1:(\d+) \(worker 0\)")
    url = f"http://127.0.0.1:{port}"
    pids = await _wait_ready(url, 2, served)
    return served, url, f"http://127.0.0.1:{admin[0].group(1)}", pids


async def _sessions_on(
    client: httpx.AsyncClient, url: str, count: int, stack: contextlib.AsyncExitStack
) -> int:
    """Open ``count`` sessions at once; the admitted ones stay open in ``stack``."""
    held: list[AsyncIterator[bytes]] = []  # (a dropped iterator would close its stream)

    async def one() -> bool:
        response = await stack.enter_async_context(client.stream("POST", url + "/sse"))
        if response.status_code != 200:
            assert response.headers["x-headroom-reason"] == "pool_full", response.status_code
            return False
        chunks = response.aiter_raw()
        held.append(chunks)
        await anext(chunks)  # the engine holds it now
        stack.push_async_callback(_drop, chunks)
        return True

    return sum(await asyncio.gather(*(one() for _ in range(count))))


async def _drop(chunks: AsyncIterator[bytes]) -> None:
    """Keeps ``chunks`` referenced until the session is closed."""
    del chunks


async def _idle(engines: list[CountingEngine], redis_url: str) -> None:
    for _ in range(600):
        if all(e.active == 0 for e in engines) and not await _lease_holders(redis_url):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("sessions did not end")


async def test_a_lowered_cap_holds_on_every_worker_and_the_answer_lists_them(
    tmp_path: Path, engines: list[tuple[RunningServer, CountingEngine]], redis: RedisServer
) -> None:
    """3+3 -> 1+1 by POST /admin/reload: each worker alone, given twelve sessions, gets
    the engines to one stream each at most, and the answer says both run the new file."""
    await seed_generation(redis.url, pool="main")
    urls = [server.http_url for server, _ in engines]
    counters = [engine for _, engine in engines]
    config = tmp_path / "shared.yaml"
    write_config(config, urls, redis.url, cap=3)
    served, url, admin, pids = await _start(config)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            text = write_config(config, urls, redis.url, cap=1)
            reloaded = await client.post(admin + "/admin/reload")
            assert reloaded.status_code == 200, reloaded.text
            for worker in pids:
                other = next(p for p in pids if p != worker)
                os.kill(other, signal.SIGSTOP)  # only `worker` accepts on the socket
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        admitted = await _sessions_on(client, url, 12, stack)
                        assert [e.peak for e in counters] == [1, 1], (worker, admitted)
                        assert admitted == 2
                finally:
                    os.kill(other, signal.SIGCONT)
                await _idle(counters, redis.url)
            body = reloaded.json()
            assert body["reloaded"] is True
            sha256 = hashlib.sha256(text.encode()).hexdigest()
            assert body["config_sha256"] == sha256
            workers = body["workers"]
            assert sorted(w["pid"] for w in workers) == sorted(pids)
            for w in workers:
                assert w["applied"] is True
                assert w["generation"] == body["generation"] == 1
                assert w["config_sha256"] == sha256
                assert f"-{w['pid']}-" in w["gateway"]  # <host>-<pid>-<random>
                assert "pool main: updated" in w["changes"]
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
        served.stop()


async def test_sighup_and_a_cut_short_file_go_to_every_worker_or_none(
    tmp_path: Path, engines: list[tuple[RunningServer, CountingEngine]], redis: RedisServer
) -> None:
    """SIGHUP to the supervisor runs the same round; so does one sent to a worker. A file
    cut short is refused whole, on every worker."""
    await seed_generation(redis.url, pool="main")
    urls = [server.http_url for server, _ in engines]
    config = tmp_path / "shared.yaml"
    started = write_config(config, urls, redis.url, cap=3)
    served, _, admin, pids = await _start(config)
    try:
        # Every worker started on the text the supervisor read (generation 0), and a
        # file every worker refuses changes nothing.
        write_config(config, urls, redis.url, cap=0)
        async with httpx.AsyncClient(timeout=60) as client:
            refused = await client.post(admin + "/admin/reload")
        assert refused.status_code == 400, refused.text
        assert refused.json()["problems"][0]["field"] == "pools[0].replicas[0].max_sessions"
        workers = refused.json()["workers"]
        assert sorted(w["pid"] for w in workers) == sorted(pids)
        sha256 = hashlib.sha256(started.encode()).hexdigest()
        assert [(w["generation"], w["config_sha256"], w["applied"]) for w in workers] == [
            (0, sha256, False), (0, sha256, False)]  # fmt: skip

        write_config(config, urls, redis.url, cap=2)
        served.process.send_signal(signal.SIGHUP)
        every = rf"on worker 0 \(pid {pids[0]}\), worker 1 \(pid {pids[1]}\)"
        served.wait_for(rf"reload \(SIGHUP to the supervisor\) applied: generation 1 .*{every}")
        served.wait_for(r"configuration reloaded: pool main: updated", 2)

        os.kill(pids[1], signal.SIGHUP)  # to a worker: forwarded, never applied alone
        on_worker = rf"SIGHUP on worker 1 \(pid {pids[1]}\)"
        served.wait_for(rf"reload \({on_worker}\) applied: generation 2 .*{every}")

        text = write_config(config, urls, redis.url, cap=1)
        config.write_text(text[: text.index("max_sessions: 1") + len("max_sessions: 1")])
        async with httpx.AsyncClient(timeout=60) as client:
            refused = await client.post(admin + "/admin/reload")
            assert refused.status_code == 400
            (problem,) = refused.json()["problems"]
            assert problem["field"] == "<file>"
            assert "does not end with a newline" in problem["reason"]
            status = (await client.get(admin + "/admin/status")).json()
            caps = [r["cap"] for r in status["pools"]["main"]["replicas"]]
            assert caps == [2, 2]
            config.write_text(text)
            again = await client.post(admin + "/admin/reload")
            assert again.status_code == 200
            assert again.json()["generation"] == 3
    finally:
        served.stop()


async def test_a_stopped_worker_means_no_worker_applies_the_reload(
    tmp_path: Path, engines: list[tuple[RunningServer, CountingEngine]], redis: RedisServer
) -> None:
    """Worker 1 stopped (SIGSTOP) through a reload's deadline: 503 naming it, and neither
    worker lowered its caps -- the resumed worker 1 still admits 3+3. The next reload,
    with both running, reaches both."""
    await seed_generation(redis.url, pool="main")
    urls = [server.http_url for server, _ in engines]
    counters = [engine for _, engine in engines]
    config = tmp_path / "shared.yaml"
    write_config(config, urls, redis.url, cap=3)
    served, url, admin, pids = await _start(config)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            write_config(config, urls, redis.url, cap=1)
            os.kill(pids[1], signal.SIGSTOP)
            try:
                refused = await client.post(admin + "/admin/reload")
            finally:
                os.kill(pids[1], signal.SIGCONT)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["type"] == "worker_unavailable"
            assert f"worker 1 (pid {pids[1]}): did not answer within 10 s" in error["message"]
            status = (await client.get(admin + "/admin/status")).json()
            assert [r["cap"] for r in status["pools"]["main"]["replicas"]] == [3, 3]
            os.kill(pids[0], signal.SIGSTOP)  # only worker 1 accepts sessions
            try:
                async with contextlib.AsyncExitStack() as stack:
                    assert await _sessions_on(client, url, 12, stack) == 6
                    assert [e.peak for e in counters] == [3, 3]  # the caps it started on
            finally:
                os.kill(pids[0], signal.SIGCONT)
            await _idle(counters, redis.url)
            reloaded = await client.post(admin + "/admin/reload")
            assert reloaded.status_code == 200, reloaded.text
            assert [w["generation"] for w in reloaded.json()["workers"]] == [1, 1]
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
        served.stop()
