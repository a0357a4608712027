"""``headroom serve --workers N`` as real processes: one listen socket, N gateways sharing
one cap through a real redis-server, signals reaching every worker."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import yaml

from proxy.process.serving import RunningServer, running_server
from tests.integration.upstream import FakeEngine
from tests.redis_support import RedisServer
from tests.shared_admission.conftest import seed_generation


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[RunningServer, FakeEngine]]:
    app = FakeEngine()
    async with running_server(app) as server:
        yield server, app


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def write_config(
    path: Path, upstream_url: str, redis_url: str | None, cap: int = 1, admin: bool = False
) -> None:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": admin, "host": "127.0.0.1", "port": 0},
        "drain_timeout_s": 60,
        "health": {"recheck_interval_s": 30, "engine_metrics_interval_s": 0},
        "pools": [{"name": "main", "replicas": [{"name": "gpu0", "url": upstream_url,
                                                   "max_sessions": cap}],
                   "queue": {"max_depth": 0, "max_wait_s": 1}}],
        "routes": [{"path": "/sse", "pool": "main", "protocol": "passthrough-http"}],
    }  # fmt: skip
    if redis_url is not None:
        config["admission"] = {
            "backend": "redis",
            "redis": {"url": redis_url, "lease_ttl_s": 10, "renew_interval_s": 2,
                      "fence_margin_s": 1, "timeout_s": 0.5},
        }  # fmt: skip
    path.write_text(yaml.safe_dump(config))


class Served:
    """``headroom serve --workers N`` with its stderr collected line by line."""

    def __init__(self, config: Path, workers: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config),
             "--workers", str(workers)],
            stderr=subprocess.PIPE, text=True, cwd=os.getcwd(), start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern`` in stderr, waiting for them (bounded:
        a broken worker fails the test instead of hanging it)."""
        regex = re.compile(pattern)
        with self._changed:
            for _ in range(600):
                found = [m for m in map(regex.search, self.lines) if m]
                if len(found) >= count:
                    return found[:count]
                if self.process.poll() is not None and not self._reader.is_alive():
                    break  # exited and all of stderr read: it will not come
                self._changed.wait(0.5)
        raise AssertionError(f"{pattern!r} x{count} not seen in:\n{''.join(self.lines)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(30)
        assert self.process.stderr is not None
        self.process.stderr.close()


async def _lease_holders(redis_url: str) -> list[str]:
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        return list(await client.zrange("headroom:{main}:leases", 0, -1))
    finally:
        await client.aclose()


async def _wait_ready(url: str, expected_workers: int, served: Served) -> list[int]:
    match = served.wait_for(
        r"serving on http://127\.0\.0\.1:(\d+) with (\d+) workers \(pids ([\d ]+)\)"
    )
    assert int(match[0].group(2)) == expected_workers
    # Every worker announces itself once its gateway is built, and logs once its gate has
    # started and its replicas are checked: only then may a test stop one (SIGSTOP) without
    # its start-up connect timing out on resume and ejecting the replicas.
    served.wait_for(r"^headroom: serving on http://127\.0\.0\.1:\d+\n$", expected_workers)
    served.wait_for(r"replicas checked at start-up: \d+ of \d+ reachable", expected_workers)
    async with httpx.AsyncClient() as client:
        for _ in range(600):
            try:
                if (await client.get(url + "/readyz")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    return [int(p) for p in match[0].group(3).split()]


def test_workers_are_refused_with_the_memory_backend(tmp_path: Path) -> None:
    config = tmp_path / "memory.yaml"
    write_config(config, "http://127.0.0.1:9", None)
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--workers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--workers 2 needs admission.backend: redis" in result.stderr
    assert "own copy of every per-GPU cap" in result.stderr


async def test_two_workers_share_the_socket_and_one_cap_and_all_get_signals(
    tmp_path: Path, upstream: Any, redis: RedisServer
) -> None:
    server, app = upstream
    await seed_generation(redis.url, pool="main")
    config = tmp_path / "shared.yaml"
    write_config(config, server.http_url, redis.url, cap=1)
    served = Served(config, workers=2)
    workers: list[int] = []
    try:
        port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
        url = f"http://127.0.0.1:{port}"
        workers += await _wait_ready(url, 2, served)
        a, b = workers
        async with httpx.AsyncClient(timeout=60) as client:
            # b paused: only a accepts on the shared socket, and a admits the session.
            os.kill(b, signal.SIGSTOP)
            async with client.stream("POST", url + "/sse") as held:
                chunks = held.aiter_raw()
                await anext(chunks)
                (lease,) = await _lease_holders(redis.url)
                assert f"-{a}-" in lease.split(":")[0]  # a's own gateway id: <host>-<pid>-<rnd>
                # Now a paused and b running: b refuses, because a's session holds the cap.
                os.kill(b, signal.SIGCONT)
                os.kill(a, signal.SIGSTOP)
                refused = await client.post(url + "/sse")
                assert refused.status_code == 503
                assert refused.headers["x-headroom-reason"] == "pool_full"
                os.kill(a, signal.SIGCONT)

                # SIGHUP to the supervisor: every worker reloads the file.
                write_config(config, server.http_url, redis.url, cap=2)
                served.process.send_signal(signal.SIGHUP)
                served.wait_for(r"configuration reloaded", 2)

                # SIGTERM to the supervisor: every worker drains. b holds nothing and
                # exits; a keeps serving its session until it ends.
                served.process.send_signal(signal.SIGTERM)
                served.wait_for(r"draining: \d+ active sessions", 2)
                for _ in range(600):
                    if _gone(b):
                        break
                    await asyncio.sleep(0.05)
                assert _gone(b)
                assert not _gone(a)
                assert served.process.poll() is None
                refused = await client.post(url + "/sse")
                assert refused.status_code == 503
                assert refused.headers["x-headroom-reason"] == "draining"
                app.controls.release.set()
                async for _ in chunks:
                    pass
        assert await asyncio.to_thread(served.process.wait, 60) == 0
        assert _gone(a)
        assert await _lease_holders(redis.url) == []
    finally:
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
        served.stop()


async def test_the_admin_listener_reloads_and_drains_every_worker(
    tmp_path: Path, upstream: Any, redis: RedisServer
) -> None:
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    config = tmp_path / "shared.yaml"
    write_config(config, server.http_url, redis.url, cap=1, admin=True)
    served = Served(config, workers=2)
    try:
        port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
        admin_port = served.wait_for(r"admin listener on http://127\.0\.0\.1:(\d+) \(worker 0\)")
        admin = f"http://127.0.0.1:{admin_port[0].group(1)}"
        await _wait_ready(f"http://127.0.0.1:{port}", 2, served)
        async with httpx.AsyncClient(timeout=60) as client:
            write_config(config, server.http_url, redis.url, cap=3, admin=True)
            reloaded = await client.post(admin + "/admin/reload")
            assert reloaded.status_code == 200, reloaded.text
            assert reloaded.json()["reloaded"] is True
            # worker 0 reloaded for the request, the supervisor had worker 1 reload too
            served.wait_for(r"configuration reloaded", 2)
            assert (await client.post(admin + "/admin/drain")).status_code == 202
        served.wait_for(r"draining: \d+ active sessions", 2)
        code = await asyncio.to_thread(served.process.wait, 60)
        served.stop()  # the rest of stderr
        assert code == 0, "".join(served.lines)
    finally:
        served.stop()


async def test_workers_of_a_killed_supervisor_drain_and_exit(
    tmp_path: Path, upstream: Any, redis: RedisServer
) -> None:
    server, _ = upstream
    await seed_generation(redis.url, pool="main")
    config = tmp_path / "shared.yaml"
    write_config(config, server.http_url, redis.url, cap=1)
    served = Served(config, workers=2)
    workers: list[int] = []
    try:
        port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
        workers += await _wait_ready(f"http://127.0.0.1:{port}", 2, served)
        served.process.send_signal(signal.SIGKILL)
        served.wait_for(r"supervisor \(pid \d+\) is gone: draining", 2)
        for _ in range(600):
            if all(_gone(pid) for pid in workers):
                break
            await asyncio.sleep(0.05)
        assert all(_gone(pid) for pid in workers)
    finally:
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        served.stop()


def _gone(pid: int) -> bool:
    """Whether the worker ``pid`` has exited (a zombie until the supervisor reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


async def test_ctrl_c_drains_and_an_orphaned_worker_drains_too(
    tmp_path: Path, upstream: Any, redis: RedisServer
) -> None:
    """SIGINT to the terminal's process group reaches the supervisor only (the workers
    have their own group), so the workers get one SIGTERM: they drain, the held session
    runs on. Then the supervisor is SIGKILLed: the workers notice and drain on their own."""
    server, app = upstream
    await seed_generation(redis.url, pool="main")
    config = tmp_path / "shared.yaml"
    write_config(config, server.http_url, redis.url, cap=1)
    served = Served(config, workers=2)
    workers: list[int] = []
    try:
        port = int(served.wait_for(r"serving on http://127\.0\.0\.1:(\d+) with")[0].group(1))
        url = f"http://127.0.0.1:{port}"
        workers += await _wait_ready(url, 2, served)
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", url + "/sse") as held,
        ):
            chunks = held.aiter_raw()
            await anext(chunks)
            os.killpg(served.process.pid, signal.SIGINT)  # a Ctrl-C
            served.wait_for(r"draining: \d+ active sessions", 2)
            assert "second signal" not in "".join(served.lines)
            os.kill(served.process.pid, signal.SIGKILL)
            # The worker holding the session notices; the idle one may have drained
            # and exited before the supervisor died (its drain has nothing to wait for).
            served.wait_for(r"supervisor \(pid \d+\) is gone; draining goes on")
            assert any(not _gone(pid) for pid in workers)  # the one holding the session
            app.controls.release.set()
            async for _ in chunks:  # served to its end: nobody closed it early
                pass
        assert "second signal" not in "".join(served.lines)
        for _ in range(600):
            if all(_gone(pid) for pid in workers):
                break
            await asyncio.sleep(0.05)
        assert all(_gone(pid) for pid in workers)
    finally:
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        served.stop()
