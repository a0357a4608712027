"""Multi-gateway chaos run: three ``headroom serve`` processes sharing one set of caps
through one Redis (``admission.backend: redis``) in front of simulated GPUs, offered 3x
the total cap by closed-loop clients while the run kills, pauses and cuts gateways and
restarts Redis (issue 15, docs/reliability.md "The multi-gateway chaos run").

    python bench/chaos_shared.py --duration 75                  # a short run
    python bench/chaos_shared.py --duration 600 --json shared.json --markdown shared.md

Everything listens on 127.0.0.1 ports chosen by the OS; every process is started by the
run and stopped at its end; the run stops by itself after ``--duration`` seconds plus a
bounded settle. The exit status is 0 only if the safety invariants held (0 samples over
cap, 0 leaked slots, every reclaim after kill -9 within ``lease_ttl_s + renew_interval_s``).

Processes::

    clients (this process) ──> gateway 0..G-1 (headroom serve) ──> sim process (GPUs 0..N-1)
                                   │ redis://  (one TCP forwarder per gateway, in this
                                   │            process, which can black-hole it)
                                   └──────────────> redis-server (no persistence)

* **The simulator** runs in its own process (``--sim-child``: ``proxy.sim`` GPUs with a
  small ASGI middleware that records every session's start and end on the session paths,
  with the client's ``cid`` from the query string). Inside that process a sampler reads
  every GPU's engine streams (``Runner.open_streams``: sequences the GPU is serving) and
  sessions (connections on the session paths) every ``--sample-ms`` (20 ms); every
  stream opened is also checked against the cap at once.
* **Faults**, one at a time, rotating, every ``--fault-every`` seconds: ``kill9`` (SIGKILL a
  gateway, restart it later on the same port), ``sigstop`` (pause a gateway for
  ``lease_ttl_s + --pause-extra`` seconds, then SIGCONT), ``redis_restart`` (SIGKILL
  redis-server, start it again empty on the same port), ``cutoff`` (black-hole one
  gateway's Redis connections for ``lease_ttl_s + --pause-extra`` seconds).
* **Clients**: ``--clients`` (default 3 x total cap) closed loops; each session picks the
  next gateway in turn, runs the vLLM-Omni speech WebSocket (config, text, flush, read to
  ``session.done``, close) and starts the next one at once (after a short back-off when
  refused).

Reported: samples over cap (engine streams and connections, from the simulator; held
slots from Redis), leaked slots after the run, reclaim time after each kill -9, FIFO
inversions across gateways, slot-idle-while-queued time, and what each fault did to the
sessions live when it struck (their outcomes and close codes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

SELF = Path(__file__).resolve()
BENCH = SELF.parent
ROOT = BENCH.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SPEECH_WS = "/v1/audio/speech/stream"
SESSION_PATHS = frozenset({SPEECH_WS, "/v1/audio/speech"})
FAULT_KINDS = ("kill9", "sigstop", "redis_restart", "cutoff")
POOL = "tts"
PREFIX = "headroom:"
TEXT = "Headroom keeps every GPU under its knee."
LONG_TEXT = f"{TEXT} One cap holds across every gateway, through crashes and cuts. {TEXT}"


@dataclass(slots=True)
class SharedChaosConfig:
    duration_s: float = 600.0
    gateways: int = 3
    gpus: int = 3
    cap: int = 4
    clients: int = 0  # 0: 3 x total cap
    preset: str = "l4-cosyvoice2-0.5b"
    lease_ttl_s: float = 4.0
    renew_interval_s: float = 1.0
    fence_margin_s: float = 1.0
    redis_timeout_s: float = 0.5
    long_share: float = 0.25  # sessions that send LONG_TEXT (longer than a lease TTL)
    queue_depth: int = 12
    queue_wait_s: float = 5.0
    first_fault_s: float = 8.0
    fault_every_s: float = 15.0
    faults: tuple[str, ...] = FAULT_KINDS
    pause_extra_s: float = 2.0  # SIGSTOP and cut-off last lease_ttl_s + this
    redis_down_s: float = 0.5
    sample_ms: float = 20.0
    fifo_margin_s: float = 0.05
    seed: int = 0
    settle_s: float = 30.0
    workdir: str | None = None

    @property
    def total_cap(self) -> int:
        return self.gpus * self.cap

    @property
    def offered(self) -> int:
        return self.clients or 3 * self.total_cap

    @property
    def reclaim_bound_s(self) -> float:
        return self.lease_ttl_s + self.renew_interval_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


# -- the simulator's process ----------------------------------------------------------------


class _SessionLog:
    """ASGI middleware on one simulated GPU: sessions in progress on the session paths,
    with every start and end (monotonic time, the client's ``cid``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.active = 0
        self.events: list[tuple[float, int, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] not in SESSION_PATHS:
            await self.app(scope, receive, send)
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        cid = query.get("cid", [""])[0]
        self.active += 1
        self.events.append((time.monotonic(), 1, cid))
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            self.events.append((time.monotonic(), -1, cid))


async def _sim_child(args: argparse.Namespace) -> None:
    """Serve the GPUs; sample them; answer ``report`` on stdin with one JSON line."""
    from proxy.sim.gpu import SimGpu, Timeouts
    from proxy.sim.presets import get_preset

    preset = get_preset(args.preset)
    timeouts = Timeouts(speech_config_s=3.0, speech_idle_s=4.0)
    gpus = [SimGpu(preset, index=i, seed=args.seed, timeouts=timeouts) for i in range(args.gpus)]
    logs: list[_SessionLog] = []
    audit = {"opened": 0, "over_cap": 0, "peak": [0] * len(gpus)}
    for gpu in gpus:
        gpu.cluster = gpus
        log = _SessionLog(gpu.app)
        gpu.app = log  # type: ignore[assignment]
        logs.append(log)
        _audit_streams(gpu, args.cap, audit)
    for gpu in gpus:
        await gpu.start()
    period = args.sample_ms / 1000
    stats: dict[str, Any] = {
        "samples": 0, "over_cap_streams": 0, "over_cap_sessions": 0, "max_gap_s": 0.0,
        "max_streams": [0] * len(gpus), "max_sessions": [0] * len(gpus), "over": [],
    }  # fmt: skip

    async def sampler() -> None:
        due = last = time.monotonic()
        while True:
            due += period
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            stats["max_gap_s"] = max(stats["max_gap_s"], now - last)
            last = now
            if now - due > period:  # a stalled loop: do not burst to catch up
                due = now
            stats["samples"] += 1
            for i, (gpu, log) in enumerate(zip(gpus, logs, strict=True)):
                streams, sessions = gpu.runner.open_streams, log.active
                stats["max_streams"][i] = max(stats["max_streams"][i], streams)
                stats["max_sessions"][i] = max(stats["max_sessions"][i], sessions)
                if streams > args.cap:
                    stats["over_cap_streams"] += 1
                if sessions > args.cap:
                    stats["over_cap_sessions"] += 1
                if (streams > args.cap or sessions > args.cap) and len(stats["over"]) < 50_000:
                    stats["over"].append([round(now, 4), i, streams, sessions])

    task = asyncio.ensure_future(sampler())
    print(json.dumps({"urls": [g.url for g in gpus], "pid": os.getpid()}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or line.strip() == "stop":
                break
            if line.strip() == "report":
                report = {
                    **stats,
                    "audit": audit,
                    "active_sessions": [log.active for log in logs],
                    "open_streams": [g.runner.open_streams for g in gpus],
                    "events": [[[round(t, 5), d, c] for t, d, c in log.events] for log in logs],
                }
                print(json.dumps(report), flush=True)
    finally:
        task.cancel()
        for gpu in reversed(gpus):
            await gpu.stop()


def _audit_streams(gpu: Any, cap: int, audit: dict[str, Any]) -> None:
    """Check the GPU's engine streams against the cap every time one opens."""
    runner = gpu.runner
    opened = runner.open

    def open_checked(*args: Any, **kwargs: Any) -> Any:
        stream = opened(*args, **kwargs)
        n = runner.open_streams
        audit["opened"] += 1
        audit["peak"][gpu.index] = max(audit["peak"][gpu.index], n)
        if n > cap:
            audit["over_cap"] += 1
        return stream

    runner.open = open_checked


class SimProcess:
    def __init__(self, cfg: SharedChaosConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.urls: list[str] = []

    async def start(self) -> None:
        cmd = [sys.executable, str(SELF), "--sim-child",
               "--preset", self.cfg.preset, "--gpus", str(self.cfg.gpus),
               "--cap", str(self.cfg.cap), "--sample-ms", str(self.cfg.sample_ms),
               "--seed", str(self.cfg.seed)]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 -- returns at once
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT
            )
        info = await self._line(60)
        self.urls = info["urls"]

    async def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        line = await asyncio.wait_for(loop.run_in_executor(None, self.proc.stdout.readline),
                                      timeout)  # fmt: skip
        if not line:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the simulator exited; its log ends with:\n{tail}")
        result: dict[str, Any] = json.loads(line)
        return result

    async def report(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"report\n")
        self.proc.stdin.flush()
        return await self._line(60)

    async def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"stop\n")
            self.proc.stdin.close()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await loop.run_in_executor(None, self.proc.wait, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


# -- redis-server and the forwarders that can cut a gateway off it ------------------------


class RedisProcess:
    """redis-server on a fixed free port, no persistence; :meth:`restart` loses every key."""

    def __init__(self, log_path: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.port = _free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 -- returns at once
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                stdout=log, stderr=log,
            )  # fmt: skip
        for _ in range(1000):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.01)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def cpu_s(self) -> float:
        if self.proc is None:
            return 0.0
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return 0.0


class Forwarder:
    """A TCP forwarder between one gateway and Redis. :meth:`cut` black-holes it: bytes of
    live connections are read and dropped both ways and new connections are accepted and
    never answered; :meth:`restore` resets every connection that lived through the cut
    (its protocol stream lost bytes), so the client reconnects cleanly."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.is_cut = False
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter | None]] = set()
        self._tainted: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self) -> None:
        self.is_cut = True
        for client, upstream in self._links:
            self._tainted.add(client)
            if upstream is not None:
                self._tainted.add(upstream)

    def restore(self) -> None:
        self.is_cut = False
        for writer in list(self._tainted):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._tainted.clear()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for client, upstream in list(self._links):
            client.transport.abort()
            if upstream is not None:
                upstream.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._tasks.discard(task)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:  # accepted, never answered
            self._tainted.add(writer)
            with contextlib.suppress(Exception):
                while await reader.read(65536):
                    pass
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            return
        link = (writer, up_writer)
        self._links.add(link)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if self.is_cut:
                        continue
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.transport.abort()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            self._links.discard(link)
            self._tainted.discard(writer)
            self._tainted.discard(up_writer)
            up_writer.transport.abort()


# -- the gateways --------------------------------------------------------------------------


def gateway_settings(cfg: SharedChaosConfig, port: int, redis_url: str,
                     gpu_urls: list[str]) -> dict[str, Any]:  # fmt: skip
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"enabled": False},
        "metrics": {"client_port": True},  # scraped on the client listener
        "log_level": "info",
        "log_format": "json",
        "drain_timeout_s": 5,
        "admission": {
            "backend": "redis",
            "redis": {
                "url": redis_url,
                "lease_ttl_s": cfg.lease_ttl_s,
                "renew_interval_s": cfg.renew_interval_s,
                "fence_margin_s": cfg.fence_margin_s,
                "timeout_s": cfg.redis_timeout_s,
            },
            "on_backend_loss": "close",
        },
        "limits": {
            "handshake_timeout_s": 3,
            "upstream_connect_timeout_s": 1,
            "idle_timeout_s": 6,
            "max_session_s": 30,
            "ping_interval_s": 2,
            "ping_timeout_s": 2,
            "client_write_timeout_s": 2,
        },
        "health": {"recheck_interval_s": 0.5},
        "guard": {"mode": "observe"},
        "pools": [
            {
                "name": POOL,
                "replicas": [
                    {"name": f"gpu{i}", "url": url, "max_sessions": cfg.cap}
                    for i, url in enumerate(gpu_urls)
                ],
                "queue": {"max_depth": cfg.queue_depth, "max_wait_s": cfg.queue_wait_s},
                "session_estimate_s": 2,
            }
        ],
        "routes": [{"path": SPEECH_WS, "pool": POOL, "protocol": "vllm-omni-speech-ws"}],
    }


class GatewayProcess:
    """``headroom serve`` in a child process (its pid names its leases in Redis)."""

    def __init__(self, index: int, config_path: Path, log_path: Path, port: int,
                 args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.index = index
        self.config_path = config_path
        self.log_path = log_path
        self.port = port
        self.args = args  # more `headroom serve` arguments (e.g. --workers 2)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []

    async def start(self, timeout: float = 60.0) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 -- returns at once
                [sys.executable, "-m", "proxy.process.cli", "serve",
                 "--config", str(self.config_path), *self.args],
                stdout=log, stderr=log, cwd=ROOT, start_new_session=True,
            )  # fmt: skip
        self.pids.append(self.proc.pid)
        import httpx

        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/readyz")).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"gateway {self.index} did not become ready; its log ends:\n{tail}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def reap(self) -> None:
        if self.proc is not None:
            self.proc.wait()
            self.proc = None

    async def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        proc = self.proc
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        try:
            code: int | None = await loop.run_in_executor(None, proc.wait, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            await loop.run_in_executor(None, proc.wait, 10)
            code = None
        self.proc = None
        return code


# -- clients -------------------------------------------------------------------------------


@dataclass(slots=True)
class Session:
    cid: str
    gateway: int
    sent: float
    ended: float = 0.0
    outcome: str = ""
    opened: float | None = None  # the client's handshake completed
    long: bool = False


@dataclass
class _Run:
    cfg: SharedChaosConfig
    ports: list[int]
    rng: random.Random
    sessions: list[Session] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = 0.0


async def _one_session(run: _Run, client: int, n: int) -> Session:
    import websockets
    from websockets.exceptions import InvalidMessage, InvalidStatus

    gw = (client + n) % len(run.ports)
    s = Session(f"{client}-{n}", gw, time.monotonic(), long=run.rng.random() < run.cfg.long_share)
    url = f"ws://127.0.0.1:{run.ports[gw]}{SPEECH_WS}?cid={s.cid}"
    try:
        async with asyncio.timeout(run.cfg.queue_wait_s + run.cfg.lease_ttl_s + 25):
            try:
                ws = await websockets.connect(url, open_timeout=run.cfg.queue_wait_s + 15,
                                              close_timeout=2, max_size=2**24)  # fmt: skip
            except InvalidStatus as exc:
                reason = exc.response.headers.get("x-headroom-reason", "")
                s.outcome = f"refused:{exc.response.status_code}:{reason}"
                return s
            except InvalidMessage:  # the gateway went away during the handshake
                s.outcome = "handshake_dropped"
                return s
            except OSError:
                s.outcome = "connect_failed"
                return s
            s.opened = time.monotonic()
            s.outcome = await speak(ws, LONG_TEXT if s.long else TEXT)
    except TimeoutError:
        s.outcome = s.outcome or "hung"
    except Exception as exc:
        s.outcome = f"client_error:{type(exc).__name__}"
    finally:
        s.ended = time.monotonic()
    return s


async def speak(ws: Any, text: str) -> str:
    """One utterance on an open vLLM-Omni speech WebSocket (config, text, done, read to
    ``session.done``), then close. Returns the outcome: ``ok``, ``upstream_error`` or
    ``closed:<code>``."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ws.send(json.dumps({"type": "session.config", "response_format": "pcm",
                                  "stream_audio": True}))  # fmt: skip
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        while True:
            msg = await ws.recv()
            if isinstance(msg, str):
                kind = json.loads(msg).get("type")
                if kind in ("session.done", "error"):
                    return "ok" if kind == "session.done" else "upstream_error"
    except ConnectionClosed as exc:
        return f"closed:{exc.rcvd.code if exc.rcvd is not None else 1006}"
    finally:
        await ws.close()


async def _client(run: _Run, client: int) -> None:
    n = 0
    await asyncio.sleep(run.rng.uniform(0, 1.0))
    while not run.stop.is_set():
        s = await _one_session(run, client, n)
        run.sessions.append(s)
        n += 1
        if s.outcome != "ok":  # refused or failed: a short back-off, then again
            await asyncio.sleep(run.rng.uniform(0.2, 0.6))


# -- Redis-side sampler and fault driver --------------------------------------------------------


def _keys(name: str) -> str:
    return f"{PREFIX}{{{POOL}}}:{name}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _redis_sampler(run: _Run, url: str, state: dict[str, Any]) -> None:
    """Held slots (every replica, from Redis) and queue depth every sample period."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=0.5)
    period = run.cfg.sample_ms / 1000
    try:
        while True:
            await asyncio.sleep(period)
            try:
                held = await client.hgetall(_keys("held"))
                depth = await client.zcard(_keys("queue"))
            except Exception:
                state["errors"] += 1
                continue
            state["samples"] += 1
            state["max_queue"] = max(state["max_queue"], depth)
            for replica, value in held.items():
                v = int(value)
                name = _text(replica)
                state["max_held"][name] = max(state["max_held"].get(name, 0), v)
                if v > run.cfg.cap:
                    state["over_cap"] += 1
                if v < 0:
                    state["negative"] += 1
    finally:
        await client.aclose()


async def _lease_ids(client: Any, pid: int) -> set[str]:
    pattern = re.compile(rf"-{pid}-[0-9a-f]+:")
    owners = await client.hkeys(_keys("owner"))
    return {_text(k) for k in owners if pattern.search(_text(k))}


async def _measure_reclaim(url: str, pid: int, killed: float, cfg: SharedChaosConfig,
                           out: dict[str, Any]) -> None:  # fmt: skip
    """Until the leases the killed gateway held are gone from Redis, and until no lease of
    it is left (slots handed to its dead waiters come back one TTL later)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=0.5)
    try:
        held = await _lease_ids(client, pid)
        out["held_at_kill"] = len(held)
        limit = killed + 4 * cfg.lease_ttl_s + 10
        while time.monotonic() < limit:
            now_ids = await _lease_ids(client, pid)
            if out.get("reclaim_s") is None and not (held & now_ids):
                out["reclaim_s"] = round(time.monotonic() - killed, 3)
            if not now_ids:
                out["all_gone_s"] = round(time.monotonic() - killed, 3)
                return
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def _faults(run: _Run, redis: RedisProcess, gateways: list[GatewayProcess],
                  forwarders: list[Forwarder], log: list[dict[str, Any]]) -> None:  # fmt: skip
    cfg = run.cfg
    hold_s = cfg.lease_ttl_s + cfg.pause_extra_s
    k = 0
    while True:
        at = cfg.first_fault_s + k * cfg.fault_every_s
        kind = cfg.faults[k % len(cfg.faults)]
        target = k % len(gateways)
        if at + hold_s + cfg.reclaim_bound_s + 3 > cfg.duration_s:
            return
        await asyncio.sleep(max(0.0, run.t0 + at - time.monotonic()))
        start = time.monotonic()
        event: dict[str, Any] = {"kind": kind, "at_s": round(start - run.t0, 2)}
        if kind == "kill9":
            g = gateways[target]
            event["gateway"] = target
            pid = g.pid
            g.signal(signal.SIGKILL)
            killed = time.monotonic()
            reclaim: dict[str, Any] = {}
            measuring = asyncio.ensure_future(
                _measure_reclaim(redis.url, pid, killed, cfg, reclaim)
            )
            await asyncio.get_running_loop().run_in_executor(None, g.reap)
            await asyncio.sleep(cfg.reclaim_bound_s + 1)
            await g.start()
            await measuring
            event.update(reclaim)
        elif kind == "sigstop":
            g = gateways[target]
            event["gateway"] = target
            g.signal(signal.SIGSTOP)
            await asyncio.sleep(hold_s)
            g.signal(signal.SIGCONT)
        elif kind == "redis_restart":
            redis.kill()
            await asyncio.sleep(cfg.redis_down_s)
            await redis.start()
        elif kind == "cutoff":
            event["gateway"] = target
            forwarders[target].cut()
            await asyncio.sleep(hold_s)
            forwarders[target].restore()
        event["until_s"] = round(time.monotonic() - run.t0, 2)
        log.append(event)
        k += 1


async def _leak_check(url: str, gateways: list[GatewayProcess]) -> dict[str, Any]:
    import httpx
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=2)
    try:
        held = {_text(k): int(v) for k, v in (await client.hgetall(_keys("held"))).items()}
        out: dict[str, Any] = {
            "redis_leases": await client.zcard(_keys("leases")),
            "redis_owner": await client.hlen(_keys("owner")),
            "redis_held": held,
            "redis_queue": await client.zcard(_keys("queue")),
        }
    finally:
        await client.aclose()
    active = []
    async with httpx.AsyncClient(timeout=5) as http:
        for g in gateways:
            text = (await http.get(f"{g.url}/metrics")).text
            total = 0.0
            for line in text.splitlines():
                if line.startswith("headroom_sessions_active{"):
                    total += float(line.rsplit(" ", 1)[1])
            active.append(int(total))
    out["gateway_active"] = active
    out["leaked"] = sum(max(0, v) for v in held.values()) + out["redis_owner"] + sum(active)
    return out


# -- analysis --------------------------------------------------------------------------------


Starts = dict[str, tuple[int, float]]


def _grants(sim: dict[str, Any]) -> tuple[Starts, list[list[tuple[float, int]]]]:
    """cid -> (gpu, upstream start) for every session that reached a GPU; per GPU the
    start (+1) and end (-1) events in time order."""
    starts: dict[str, tuple[int, float]] = {}
    per_gpu: list[list[tuple[float, int]]] = []
    for gpu, events in enumerate(sim["events"]):
        seq = []
        for t, d, cid in events:
            seq.append((t, d))
            if d == 1 and cid:
                starts.setdefault(cid, (gpu, t))
        per_gpu.append(sorted(seq))
    return starts, per_gpu


def _in_fault(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in windows)


def _cause(t: float, faults: list[dict[str, Any]], t0: float, extra_s: float) -> str:
    """The fault whose window (start to end + ``extra_s``) holds ``t``, else ``none``."""
    for f in faults:
        if t0 + f["at_s"] <= t <= t0 + f["until_s"] + extra_s:
            return str(f["kind"])
    return "none"


def classify_over_cap(over: list[list[Any]], sim_events: list[list[list[Any]]],
                      sessions: list[Session], faults: list[dict[str, Any]], t0: float,
                      cap: int) -> dict[str, Any]:  # fmt: skip
    """Explain each sample over cap from who held the GPU's connections at that instant:

    * ``paused_gateway``: one of them came through a gateway that was SIGSTOPped then
      (it cannot close its upstream connections while paused; docs/shared-admission.md);
    * ``ended_session_upstream_lag``: one of them belonged to a session that had already
      ended at the client (closed by the gateway, e.g. 1012 after a fence, and released
      in Redis) while the simulator had not yet noticed (it reads its socket only
      between sentences);
    * ``unexplained``: neither -- a session holding a slot beside ``cap`` others.

    ``live_over_cap`` counts samples where the connections of sessions still running at
    the client, through gateways that were not paused, exceeded the cap: that is the
    shared cap failing."""
    by_cid = {s.cid: s for s in sessions}
    paused = [(t0 + f["at_s"], t0 + f["until_s"], f["gateway"]) for f in faults
              if f["kind"] == "sigstop"]  # fmt: skip
    streams: Counter[str] = Counter()
    connections: Counter[str] = Counter()
    live_over = 0
    rows = sorted((row[1], row[0], row[2], row[3]) for row in over)
    pos = [0] * len(sim_events)
    open_: list[set[str]] = [set() for _ in sim_events]
    for gpu, t, n_streams, n_conns in rows:
        events = sim_events[gpu]
        while pos[gpu] < len(events) and events[pos[gpu]][0] <= t:
            _, d, cid = events[pos[gpu]]
            (open_[gpu].add if d == 1 else open_[gpu].discard)(cid)
            pos[gpu] += 1
        in_pause = ended = 0
        for cid in open_[gpu]:
            s = by_cid.get(cid)
            if s is None:
                continue
            if any(a <= t <= b and g == s.gateway for a, b, g in paused):
                in_pause += 1
            elif s.ended < t:
                ended += 1
        cause = ("paused_gateway" if in_pause else
                 "ended_session_upstream_lag" if ended else "unexplained")  # fmt: skip
        if n_streams > cap:
            streams[cause] += 1
        if n_conns > cap:
            connections[cause] += 1
        if n_conns - in_pause - ended > cap:
            live_over += 1
    return {"streams": dict(streams), "connections": dict(connections),
            "live_over_cap": live_over}  # fmt: skip


def read_logs(workdir: Path) -> dict[str, Any]:
    """Levels and the most frequent error and warning messages of the gateways' logs
    (numbers masked), and tracebacks in any log."""
    levels: Counter[str] = Counter()
    messages: dict[str, Counter[str]] = {"error": Counter(), "warning": Counter()}
    tracebacks = 0
    for path in sorted(workdir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            tracebacks += line.startswith("Traceback")
            if not path.name.startswith("gateway") or not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                level = str(record.get("level", ""))
                levels[level] += 1
                if level in messages:
                    messages[level][re.sub(r"\d+", "N", str(record.get("msg", "")))[:160]] += 1
    return {
        "levels": dict(levels),
        "errors": dict(messages["error"].most_common(12)),
        "warnings": dict(messages["warning"].most_common(12)),
        "tracebacks": tracebacks,
    }


def fifo_inversions(
    sessions: list[Session], starts: Starts, margin_s: float, windows: list[tuple[float, float]]
) -> dict[str, Any]:
    """Pairs (A, B) of sessions that reached a GPU where A was sent before B but B reached
    its GPU first. Counted for all pairs, and for pairs where A was sent more than
    ``margin_s`` earlier (beyond the race of two arrivals to Redis), split by whether A
    waited through a fault and whether A and B came through the same gateway."""
    rows = sorted((s.sent, starts[s.cid][1], s.gateway) for s in sessions if s.cid in starts)
    inversions = 0
    beyond: Counter[str] = Counter()
    lag: list[float] = []
    later_starts: list[float] = []  # starts of sessions sent after the current one
    # Walk from the latest arrival backwards, counting later arrivals that started earlier.
    for i in range(len(rows) - 1, -1, -1):
        start = rows[i][1]
        n = bisect_left(later_starts, start)
        inversions += n
        later_starts.insert(bisect_right(later_starts, start), start)
    # Beyond the margin, with explanations (quadratic only over near neighbours).
    for sent_a, start_a, gw_a in rows:
        j = bisect_right(rows, (sent_a + margin_s, float("inf"), 99))
        for sent_b, start_b, gw_b in rows[j:]:
            if sent_b > start_a:
                break
            if start_b < start_a:
                why = (
                    "fault"
                    if _in_fault(start_a, windows) or _in_fault(sent_a, windows)
                    else ("same_gateway" if gw_a == gw_b else "across_gateways")
                )
                beyond[why] += 1
                lag.append(start_a - start_b)
    return {
        "admitted": len(rows),
        "inversions": inversions,
        "beyond_margin": sum(beyond.values()),
        "beyond_margin_by_cause": dict(beyond),
        "margin_ms": margin_s * 1000,
        "beyond_margin_lag_ms_p50": _ms(_pct(lag, 0.5)),
        "beyond_margin_lag_ms_max": _ms(max(lag) if lag else None),
    }


def idle_while_queued(sessions: list[Session], starts: Starts,
                      per_gpu: list[list[tuple[float, int]]], cap: int,
                      windows: list[tuple[float, float]]) -> dict[str, Any]:  # fmt: skip
    """Time from a session leaving a GPU to the next session starting on it, counted when
    the GPU then had a free slot (fewer than ``cap`` connections: an end that leaves it
    at or over its cap frees nothing) and someone was waiting: a client that had sent its
    request and later reached a GPU. Never more idle slots than such waiters: a waiter
    counts for one freed slot, on whichever GPU it lands."""
    waits = sorted((s.sent, starts[s.cid][1]) for s in sessions if s.cid in starts)
    sent_times = [w[0] for w in waits]
    start_times = sorted(w[1] for w in waits)

    def waiting(t: float) -> int:
        return bisect_right(sent_times, t) - bisect_right(start_times, t)

    events = sorted((t, d, gpu) for gpu, seq in enumerate(per_gpu) for t, d in seq)
    held = [0] * len(per_gpu)
    pending: list[tuple[float, int]] = []  # (freed at, gpu), oldest first
    idle: list[float] = []
    idle_clean: list[float] = []
    for t, d, gpu in events:
        held[gpu] += d
        if d == -1:
            if held[gpu] < cap and waiting(t) > len(pending):
                pending.append((t, gpu))
            continue
        mine = next((i for i, (_, g) in enumerate(pending) if g == gpu), None)
        if mine is not None:
            freed, _ = pending.pop(mine)
            idle.append(t - freed)
            if not _in_fault(freed, windows):
                idle_clean.append(t - freed)
        while len(pending) > waiting(t):  # the waiter went elsewhere: not idle here
            pending.pop()
    return {
        "count": len(idle),
        "p50_ms": _ms(_pct(idle, 0.5)),
        "p99_ms": _ms(_pct(idle, 0.99)),
        "max_ms": _ms(max(idle) if idle else None),
        "outside_faults_count": len(idle_clean),
        "outside_faults_p50_ms": _ms(_pct(idle_clean, 0.5)),
        "outside_faults_p99_ms": _ms(_pct(idle_clean, 0.99)),
        "outside_faults_max_ms": _ms(max(idle_clean) if idle_clean else None),
    }


def fault_effects(sessions: list[Session], faults: list[dict[str, Any]], t0: float,
                  settle_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Per fault: the sessions live (handshake done, not ended) on the affected gateways
    when it struck, by outcome; and how new sessions fared until it had settled."""
    out = []
    for f in faults:
        a = t0 + f["at_s"]
        b = t0 + f["until_s"] + settle_s
        hit = (lambda s: True) if "gateway" not in f else (lambda s, g=f["gateway"]: s.gateway == g)
        live = Counter(
            s.outcome
            for s in sessions
            if hit(s) and s.opened is not None and s.opened <= a < s.ended
        )
        new = Counter(s.outcome for s in sessions if hit(s) and a <= s.sent <= b)
        out.append({**f, "live_sessions": sum(live.values()), "live_outcomes": dict(live),
                    "new_sessions_outcomes": dict(new)})  # fmt: skip
    return out


# -- the run ----------------------------------------------------------------------------------


async def run_shared_chaos(cfg: SharedChaosConfig) -> dict[str, Any]:
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="headroom-chaos-shared-"))
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 -- once, at start-up
    load_before = os.getloadavg()
    redis = RedisProcess(workdir / "redis.log")
    sim = SimProcess(cfg, workdir / "sim.log")
    forwarders = [Forwarder(0) for _ in range(cfg.gateways)]
    gateways: list[GatewayProcess] = []
    tasks: list[asyncio.Task[Any]] = []
    try:
        await redis.start()
        await sim.start()
        for fwd in forwarders:
            fwd.target_port = redis.port
            await fwd.start()
        ports = [_free_port() for _ in range(cfg.gateways)]
        for i, port in enumerate(ports):
            path = workdir / f"gateway{i}.yaml"
            path.write_text(json.dumps(gateway_settings(cfg, port, forwarders[i].url, sim.urls)))
            gateways.append(GatewayProcess(i, path, workdir / f"gateway{i}.log", port))
        await asyncio.gather(*(g.start() for g in gateways))
        # A brand-new Redis blocks grants for one TTL (it looks like a data loss).
        await asyncio.sleep(cfg.lease_ttl_s + 0.2)
        run = _Run(cfg, ports, random.Random(cfg.seed))
        redis_state: dict[str, Any] = {"samples": 0, "errors": 0, "over_cap": 0,
                                       "negative": 0, "max_held": {}, "max_queue": 0}  # fmt: skip
        fault_log: list[dict[str, Any]] = []
        run.t0 = time.monotonic()
        cpu_redis0 = redis.cpu_s()
        tasks.append(asyncio.ensure_future(_redis_sampler(run, redis.url, redis_state)))
        faults = asyncio.ensure_future(_faults(run, redis, gateways, forwarders, fault_log))
        tasks.append(faults)
        clients = [asyncio.ensure_future(_client(run, i)) for i in range(cfg.offered)]
        await asyncio.sleep(max(0.0, run.t0 + cfg.duration_s - time.monotonic()))
        run.stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(faults, cfg.lease_ttl_s * 3 + 30)
        _, pending = await asyncio.wait(clients, timeout=cfg.settle_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        clients_stopped = time.monotonic()
        # Leases of killed gateways' dead waiters lapse within one TTL; then check.
        await asyncio.sleep(cfg.lease_ttl_s + 2 * cfg.renew_interval_s + 0.5)
        leaks = await _leak_check(redis.url, gateways)
        sim_report = await sim.report()
        for task in tasks:
            task.cancel()
        cpu_redis = redis.cpu_s() - cpu_redis0
        exit_codes = [await g.stop() for g in gateways]
        return _report(cfg, run, sim_report, redis_state, fault_log, leaks, exit_codes,
                       load_before, clients_stopped, cpu_redis, workdir)  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        for g in gateways:
            with contextlib.suppress(Exception):
                await g.stop()
        for fwd in forwarders:
            await fwd.stop()
        with contextlib.suppress(Exception):
            await sim.stop()
        redis.kill()


def _report(cfg: SharedChaosConfig, run: _Run, sim: dict[str, Any], redis_state: dict[str, Any],
            faults: list[dict[str, Any]], leaks: dict[str, Any], exit_codes: list[int | None],
            load_before: tuple[float, float, float], clients_stopped: float, cpu_redis: float,
            workdir: Path) -> dict[str, Any]:  # fmt: skip
    starts, per_gpu = _grants(sim)
    raw = {
        "t0": run.t0,
        "sessions": [asdict(s) for s in run.sessions],
        "sim": sim["events"],
        "over": sim["over"],
        "faults": faults,
    }
    (workdir / "raw.json").write_text(json.dumps(raw))
    windows = [(run.t0 + f["at_s"], run.t0 + f["until_s"] + cfg.reclaim_bound_s + 1)
               for f in faults]  # fmt: skip
    outcomes = Counter(s.outcome for s in run.sessions)
    lengths = {
        kind: [
            s.ended - s.opened
            for s in run.sessions
            if s.outcome == "ok" and s.opened is not None and s.long == (kind == "long")
        ]
        for kind in ("short", "long")
    }
    reclaims = [f for f in faults if f["kind"] == "kill9"]
    reclaim_ok = all(f.get("reclaim_s") is not None and f["reclaim_s"] <= cfg.reclaim_bound_s
                     for f in reclaims)  # fmt: skip
    over = {
        "samples": sim["samples"],
        "sample_ms": cfg.sample_ms,
        "max_sample_gap_ms": _ms(sim["max_gap_s"]),
        "over_cap_streams": sim["over_cap_streams"],
        "over_cap_streams_at_open": sim["audit"]["over_cap"],
        "streams_opened": sim["audit"]["opened"],
        "max_streams": sim["max_streams"],
        "over_cap_connections": sim["over_cap_sessions"],
        "max_connections": sim["max_sessions"],
        "over_samples": sim["over"][:50],
        "redis_samples": redis_state["samples"],
        "redis_over_cap": redis_state["over_cap"],
        "redis_negative_held": redis_state["negative"],
        "redis_max_held": redis_state["max_held"],
        "redis_max_queue": redis_state["max_queue"],
    }
    extra = cfg.reclaim_bound_s + 1
    streams_by: Counter[str] = Counter()
    connections_by: Counter[str] = Counter()
    for t, _, streams, conns in sim["over"]:
        if streams > cfg.cap:
            streams_by[_cause(t, faults, run.t0, extra)] += 1
        if conns > cfg.cap:
            connections_by[_cause(t, faults, run.t0, extra)] += 1
    over["over_cap_streams_by_fault"] = dict(streams_by)
    over["over_cap_connections_by_fault"] = dict(connections_by)
    explained = classify_over_cap(sim["over"], sim["events"], run.sessions, faults, run.t0,
                                  cfg.cap)  # fmt: skip
    over["over_cap_streams_by_cause"] = explained["streams"]
    over["over_cap_connections_by_cause"] = explained["connections"]
    over["live_over_cap"] = explained["live_over_cap"]
    if len(sim["over"]) >= 50_000:
        over["truncated"] = True  # the simulator keeps the first 50,000 rows
    for row in over["over_samples"]:
        row[0] = round(row[0] - run.t0, 3)
    invariants = {
        "over_cap_streams": over["over_cap_streams"] == 0 and over["over_cap_streams_at_open"] == 0,
        "over_cap_live_sessions": over["live_over_cap"] == 0
        and "unexplained" not in explained["streams"],
        "over_cap_redis": redis_state["over_cap"] == 0 and redis_state["negative"] == 0,
        "leaked_slots": leaks["leaked"] == 0
        and leaks["redis_queue"] == 0
        and sum(sim["active_sessions"]) == 0
        and sum(sim["open_streams"]) == 0,
        "reclaim_within_ttl_plus_renewal": reclaim_ok,
        "no_client_error": not any(o.startswith("client_error") for o in outcomes),
    }
    return {
        "config": {
            **asdict(cfg),
            "faults": list(cfg.faults),
            "offered": cfg.offered,
            "total_cap": cfg.total_cap,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "workdir": str(workdir),
        "ran_s": round(clients_stopped - run.t0, 1),
        "sessions": {
            "total": len(run.sessions),
            "by_outcome": dict(outcomes.most_common()),
            "ok_length_s": {
                k: {"n": len(v), "p50": _pct(v, 0.5), "p90": _pct(v, 0.9)}
                for k, v in lengths.items()
            },
        },
        "over_cap": over,
        "leaks": {
            **leaks,
            "sim_sessions": sim["active_sessions"],
            "sim_streams": sim["open_streams"],
        },
        "reclaim_after_kill9": [
            {k: f.get(k) for k in ("at_s", "gateway", "held_at_kill", "reclaim_s", "all_gone_s")}
            for f in reclaims
        ],
        "reclaim_bound_s": cfg.reclaim_bound_s,
        "fifo": fifo_inversions(run.sessions, starts, cfg.fifo_margin_s, windows),
        "idle_while_queued": idle_while_queued(run.sessions, starts, per_gpu, cfg.cap, windows),
        "faults": fault_effects(run.sessions, faults, run.t0, cfg.lease_ttl_s + 1),
        "gateway_exit_codes": exit_codes,
        "logs": read_logs(workdir),
        "redis_cpu_s": round(cpu_redis, 2),
        "invariants": invariants,
        "passed": all(invariants.values()),
    }


def format_report(r: dict[str, Any]) -> str:
    c, o, lk = r["config"], r["over_cap"], r["leaks"]
    lines = [
        f"# Multi-gateway chaos run: {c['gateways']} gateways, {c['gpus']} GPUs x cap "
        f"{c['cap']} = {c['total_cap']}, {c['offered']} closed-loop clients, "
        f"{r['ran_s']} s",
        "",
        f"lease_ttl_s {c['lease_ttl_s']}, renew_interval_s {c['renew_interval_s']}, "
        f"fence_margin_s {c['fence_margin_s']}; load average before/after "
        f"{r['machine']['loadavg_before'][0]:.2f}/{r['machine']['loadavg_after'][0]:.2f} on "
        f"{r['machine']['cpus']} CPUs",
        "",
        "| invariant | result |",
        "|---|---|",
    ]
    for name, ok in r["invariants"].items():
        lines.append(f"| {name} | {'PASS' if ok else 'FAIL'} |")
    lines += [
        "",
        f"- samples every {o['sample_ms']:.0f} ms: {o['samples']} (longest gap "
        f"{o['max_sample_gap_ms']} ms); engine streams over cap: {o['over_cap_streams']} "
        f"(and {o['over_cap_streams_at_open']} of {o['streams_opened']} stream opens); "
        f"max streams per GPU {o['max_streams']}; by cause {o['over_cap_streams_by_cause']}",
        f"- samples where the connections of sessions still running (not ended at the "
        f"client, not behind a paused gateway) exceeded the cap: {o['live_over_cap']}",
        f"- connections over cap (the simulator's open sessions on the session paths, "
        f"idle ones included): {o['over_cap_connections']} GPU-samples, by fault "
        f"{o['over_cap_connections_by_fault']}, by cause {o['over_cap_connections_by_cause']}; "
        f"max {o['max_connections']}",
        f"- Redis held over cap: {o['redis_over_cap']} of {o['redis_samples']} samples; max held "
        f"{o['redis_max_held']}; max queue {o['redis_max_queue']}",
        f"- leaked after the run: {lk['leaked']} (Redis leases {lk['redis_leases']}, "
        f"held {lk['redis_held']}, queue {lk['redis_queue']}; gateways {lk['gateway_active']}; "
        f"sim sessions {lk['sim_sessions']}, streams {lk['sim_streams']})",
    ]
    for k in r["reclaim_after_kill9"]:
        lines.append(
            f"- kill -9 gateway {k['gateway']} at {k['at_s']} s: held "
            f"{k['held_at_kill']}, reclaimed in {k['reclaim_s']} s (bound "
            f"{r['reclaim_bound_s']} s); its last lease gone after {k['all_gone_s']} s"
        )
    f = r["fifo"]
    lines.append(
        f"- FIFO: {f['admitted']} sessions reached a GPU; inverted pairs "
        f"{f['inversions']}; beyond {f['margin_ms']:.0f} ms of arrival race "
        f"{f['beyond_margin']} {f['beyond_margin_by_cause']}"
    )
    i = r["idle_while_queued"]
    lines.append(
        f"- slot idle while queued (release to next start on the GPU): n {i['count']}, "
        f"p50 {i['p50_ms']} ms, p99 {i['p99_ms']} ms, max {i['max_ms']} ms; outside "
        f"fault windows p50 {i['outside_faults_p50_ms']} ms, p99 "
        f"{i['outside_faults_p99_ms']} ms"
    )
    lines.append(f"- sessions {r['sessions']['total']}: {r['sessions']['by_outcome']}")
    ln = r["sessions"]["ok_length_s"]
    lines.append(
        "- length of ok sessions (handshake to end), p50/p90 s: "
        + ", ".join(
            f"{k} {_round(v['p50'])}/{_round(v['p90'])} (n {v['n']})" for k, v in ln.items()
        )
    )
    lg = r["logs"]
    lines.append(
        f"- gateway logs: {lg['levels']}; tracebacks {lg['tracebacks']}; errors {lg['errors']}"
    )
    lines.append(
        f"- gateway exit codes (SIGTERM at the end): {r['gateway_exit_codes']}; "
        f"redis-server CPU {r['redis_cpu_s']} s"
    )
    lines += [
        "",
        "| fault | at s | until s | gateway | live sessions | how they ended | "
        "new sessions until settled |",
        "|---|---|---|---|---|---|---|",
    ]
    for fx in r["faults"]:
        lines.append(
            f"| {fx['kind']} | {fx['at_s']} | {fx['until_s']} | "
            f"{fx.get('gateway', 'all')} | {fx['live_sessions']} | "
            f"{fx['live_outcomes']} | {fx['new_sessions_outcomes']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SharedChaosConfig()
    parser.add_argument("--sim-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    parser.add_argument("--gateways", type=int, default=d.gateways)
    parser.add_argument("--gpus", type=int, default=d.gpus)
    parser.add_argument("--cap", type=int, default=d.cap, help="max_sessions per GPU")
    parser.add_argument("--clients", type=int, default=0, help="closed loops (0: 3 x total cap)")
    parser.add_argument("--preset", default=d.preset)
    parser.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s)
    parser.add_argument("--renew-interval", type=float, default=d.renew_interval_s)
    parser.add_argument("--fence-margin", type=float, default=d.fence_margin_s)
    parser.add_argument(
        "--redis-timeout",
        type=float,
        default=d.redis_timeout_s,
        help="admission.redis.timeout_s (below the renewal interval)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=d.settle_s,
        help="at the end, seconds the running sessions may take to finish",
    )
    parser.add_argument(
        "--long-share",
        type=float,
        default=d.long_share,
        help="share of sessions with a long text (longer than a lease TTL)",
    )
    parser.add_argument("--queue-depth", type=int, default=d.queue_depth)
    parser.add_argument("--queue-wait", type=float, default=d.queue_wait_s)
    parser.add_argument("--first-fault", type=float, default=d.first_fault_s)
    parser.add_argument("--fault-every", type=float, default=d.fault_every_s)
    parser.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help="comma-separated, in rotation: " + ", ".join(FAULT_KINDS),
    )
    parser.add_argument(
        "--pause-extra",
        type=float,
        default=d.pause_extra_s,
        help="SIGSTOP and cut-off last lease TTL + this many seconds",
    )
    parser.add_argument("--sample-ms", type=float, default=d.sample_ms)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--workdir", help="keep configurations and logs here")
    parser.add_argument("--json", help="write the full report here")
    parser.add_argument("--markdown", help="write the summary here")
    args = parser.parse_args(argv)
    if args.sim_child:
        asyncio.run(_sim_child(args))
        return 0
    faults = tuple(f for f in args.faults.split(",") if f)
    if unknown := set(faults) - set(FAULT_KINDS):
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    cfg = SharedChaosConfig(
        duration_s=args.duration, gateways=args.gateways, gpus=args.gpus, cap=args.cap,
        clients=args.clients, preset=args.preset, long_share=args.long_share,
        lease_ttl_s=args.lease_ttl, renew_interval_s=args.renew_interval,
        fence_margin_s=args.fence_margin, redis_timeout_s=args.redis_timeout,
        queue_depth=args.queue_depth, queue_wait_s=args.queue_wait,
        first_fault_s=args.first_fault, fault_every_s=args.fault_every, faults=faults,
        pause_extra_s=args.pause_extra, sample_ms=args.sample_ms, seed=args.seed,
        workdir=args.workdir, settle_s=args.settle,
    )  # fmt: skip
    report = asyncio.run(run_shared_chaos(cfg))
    return emit(report, format_report(report), args.json, args.markdown)


def emit(report: dict[str, Any], text: str, json_path: str | None,
         markdown_path: str | None) -> int:  # fmt: skip
    """Print a run's summary, write its report and summary where asked; the exit status:
    0 only if the run's invariants held."""
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str))
    if markdown_path:
        Path(markdown_path).write_text(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
