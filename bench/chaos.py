"""Chaos soak: thousands of sessions through Headroom while everything around it fails,
checking that no slot leaks, no cap is crossed and the process never falls over.

    python bench/chaos.py --sessions 10000 --concurrency 48 --seed 1 --json out.json
    python bench/chaos.py --sessions 300 --concurrency 24          # about half a minute

What runs (all on 127.0.0.1):

* a simulated cluster (``proxy.sim``, in this process): ``--gpus`` GPUs serving the
  pool ``tts`` (capped at ``--cap`` sessions each, small so that queueing, refusals and
  failover happen all the time) and one more GPU for the fallback pool ``lite``; each
  GPU counts the sessions it is serving (its own view, cross-checked with the gate's);
* a fault-injecting TCP proxy (``bench/faultproxy.py``) in front of every ``tts`` GPU
  but the first: latency, stalls, resets mid-stream, half-open, slow reads, refused and
  black-holed connects, one drawn per connection;
* the simulator's own faults flipped live (``Cluster.set_faults`` and ``POST
  /sim/faults``): dropped TCP, stalls, slow starts, error events, 503 handshakes,
  unhealthy, refused connects;
* Headroom as ``headroom serve`` in its own process (``bench/chaos_proc.py``), so its
  RSS and descriptors are its own and a crash is a process exit, with an audit of every
  admission event and a probe port;
* ``--concurrency`` clients at a time drawn from the mix in ``bench/chaos_clients.py``
  (well-behaved sessions on every protocol, and clients that leave while queued, during
  the handshake or mid-stream, never read, read slowly, or send garbage).

Checked continuously: every admission event (the audit) and every ``--sample-ms`` (the
sampler) each replica's active sessions against its cap; the simulator's own session
counts against the cap (they may lag a close: an excess must end within
``upstream_grace_s``); the Headroom process is alive. Checked at the end, once every
client is gone and faults are cleared (bounded settle): zero active sessions (no leaked
slot), an empty queue, no live relays, asyncio tasks and file descriptors back to their
baseline (within a small tolerance), no ERROR log line, a clean session on every
protocol, and a clean exit on SIGTERM. Exit status 0 when every invariant held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_clients import (  # type: ignore[import-not-found,unused-ignore]
    BEHAVIOURS,
    FEEDBACK_WS,
    REALTIME,
    SPEECH_HTTP,
    SPEECH_WS,
    ClientContext,
    choose,
    flagged,
    http_speech,
    realtime,
    run_client,
    ws_speech,
)
from faultproxy import FaultPlan, FaultProxy  # type: ignore[import-not-found,unused-ignore]

from proxy.sim.cluster import Cluster
from proxy.sim.faults import Faults
from proxy.sim.gpu import SimGpu, Timeouts
from proxy.sim.presets import get_preset

__all__ = ["BEHAVIOURS", "ChaosConfig", "format_report", "headroom_settings", "main", "run_soak"]

BENCH = Path(__file__).resolve().parent
SESSION_PATHS = frozenset({SPEECH_WS, SPEECH_HTTP, REALTIME})

#: The fault proxies' plan during the soak (weights per connection).
PROXY_WEIGHTS = {
    "none": 4.0,
    "latency": 1.0,
    "stall": 1.0,
    "reset": 1.0,
    "half_open": 0.6,
    "slow_reader": 1.0,
    "refuse": 0.4,
    "blackhole": 0.25,
}
#: The simulator's faults flipped live, by weight.
SIM_FAULTS = {
    "clear": 4.0,
    "drop_after_chunks": 2.0,
    "stall": 2.0,
    "slow_start": 1.5,
    "error_after_chunks": 1.5,
    "handshake_503": 1.0,
    "unhealthy": 0.7,
    "refuse_connections": 0.8,
}


@dataclass(slots=True)
class ChaosConfig:
    sessions: int = 1000
    concurrency: int = 32
    seed: int = 0
    preset: str = "l4-cosyvoice2-0.5b"
    gpus: int = 3  # pool tts; one more GPU serves the fallback pool lite
    cap: int = 3
    lite_cap: int = 2
    queue_depth: int = 6
    queue_wait_s: float = 1.5
    guard: str = "enforce"
    proxy_faults: bool = True
    sim_faults: bool = True
    sim_fault_every_s: tuple[float, float] = (0.2, 1.2)
    sample_interval_s: float = 0.05
    settle_s: float = 40.0
    upstream_grace_s: float = 8.0
    task_tolerance: int = 3
    fd_tolerance: int = 6
    client_deadline_s: float = 45.0
    refused_backoff_s: tuple[float, float] = (0.2, 1.5)
    progress_s: float = 0.0  # print progress to stderr every N s (0: quiet)
    workdir: str | None = None


# -- the simulated cluster, counting its own sessions ----------------------------------------


class UpstreamCounter:
    """ASGI middleware: sessions in progress on one simulated GPU (HTTP requests and
    WebSockets on the session paths), as the upstream itself sees them."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.active = 0
        self.peak = 0
        self.total = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] not in SESSION_PATHS:
            await self.app(scope, receive, send)
            return
        self.active += 1
        self.total += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


@contextlib.asynccontextmanager
async def counted_cluster(
    preset: str, gpus: int, seed: int
) -> Any:  # AsyncIterator[tuple[Cluster, list[UpstreamCounter]]]
    """``running_cluster`` with an :class:`UpstreamCounter` in front of every GPU."""
    chosen = get_preset(preset)
    timeouts = Timeouts(speech_config_s=3.0, speech_idle_s=4.0)
    members = [SimGpu(chosen, index=i, seed=seed, timeouts=timeouts) for i in range(gpus)]
    counters = []
    for member in members:
        member.cluster = members
        counter = UpstreamCounter(member.app)
        member.app = counter  # type: ignore[assignment,unused-ignore]
        counters.append(counter)
    try:
        for member in members:
            await member.start()
        yield Cluster(chosen, members), counters
    finally:
        for member in reversed(members):
            await member.stop()


def headroom_settings(cfg: ChaosConfig, tts_urls: list[str], lite_url: str) -> dict[str, Any]:
    """The gateway configuration of the soak (written as YAML for the child)."""
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"enabled": False},
        "log_level": "info",
        "log_format": "json",
        "drain_timeout_s": 5,
        "limits": {
            "handshake_timeout_s": 3,
            "upstream_connect_timeout_s": 1,
            "idle_timeout_s": 4,
            "max_session_s": 20,
            "ping_interval_s": 2,
            "ping_timeout_s": 2,
            "client_write_timeout_s": 2,
            "max_message_bytes": 1024 * 1024,
        },
        "health": {"recheck_interval_s": 0.5},
        "guard": {"mode": cfg.guard, "hold_s": 2, "min_samples": 20},
        "meter": {"window_s": 5},
        "pools": [
            {
                "name": "tts",
                "replicas": [
                    {"name": f"gpu{i}", "url": url, "max_sessions": cfg.cap}
                    for i, url in enumerate(tts_urls)
                ],
                "queue": {"max_depth": cfg.queue_depth, "max_wait_s": cfg.queue_wait_s},
                "fallback": {"voice": "lite-1", "pool": "lite"},
                "session_estimate_s": 2,
            },
            {
                "name": "lite",
                "replicas": [{"name": "lite0", "url": lite_url, "max_sessions": cfg.lite_cap}],
                "queue": {"max_depth": 0},
            },
        ],
        "routes": [
            {"path": SPEECH_WS, "pool": "tts", "protocol": "vllm-omni-speech-ws"},
            {"path": SPEECH_HTTP, "pool": "tts", "protocol": "openai-speech-http"},
            {"path": REALTIME, "pool": "tts", "protocol": "vllm-realtime"},
            {
                "path": FEEDBACK_WS,
                "pool": "tts",
                "protocol": "vllm-omni-speech-ws",
                "refusal": "close",
                "queue_feedback": True,
                "upstream_path": SPEECH_WS,
            },
        ],
    }


# -- the Headroom process ------------------------------------------------------------------------


class HeadroomProcess:
    """``bench/chaos_proc.py`` in a child process; logs go to ``log_path``."""

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.probe_port = 0
        self.exit_code: int | None = None

    async def start(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 -- returns at once; waits are off-loop
                [sys.executable, str(BENCH / "chaos_proc.py"), "--config", str(self.config_path)],
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, self.proc.stdout.readline),
                                          timeout)  # fmt: skip
        except TimeoutError:
            line = b""
        if not line:
            await self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"Headroom did not start; its log ends with:\n{tail}")
        info = json.loads(line)
        self.port, self.probe_port = info["port"], info["probe"]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (Headroom drains and exits), SIGKILL past ``timeout``."""
        if self.proc is None:
            return self.exit_code
        proc = self.proc
        loop = asyncio.get_running_loop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = await loop.run_in_executor(None, proc.wait, timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await loop.run_in_executor(None, proc.wait, 10)
            self.exit_code = None  # did not exit on its own
        if proc.stdout is not None:
            proc.stdout.close()
        self.proc = None
        return self.exit_code


def proc_figures(pid: int) -> dict[str, int]:
    """Open descriptors, RSS and peak RSS (kB) of a process, from /proc."""
    out = {"fds": 0, "rss_kb": 0, "hwm_kb": 0}
    with contextlib.suppress(OSError):
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_kb"] = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                out["hwm_kb"] = int(line.split()[1])
    return out


_SESSION_ID = re.compile(r"\b[0-9a-f]{6}-\d+\b")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Disconnected|Closed)\b")


def read_log(path: Path) -> dict[str, Any]:
    """Levels, ERROR messages and the proxy's session decisions from the child's log."""
    levels: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    decisions: Counter[str] = Counter()
    closes: Counter[str] = Counter()
    other = 0
    with path.open(errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                # not JSON: uvicorn's own format, a traceback printed with it, a crash
                other += 1
                text = line.rstrip()
                if text.startswith(("INFO:", "WARNING:")):
                    warnings[f"(not JSON) {text[:100]}"] += 1
                elif text.startswith(("ERROR:", "CRITICAL:")):
                    errors[f"(not JSON) {text[:120]}"] += 1
                elif _EXCEPTION_LINE.match(text):  # the last line of a traceback
                    errors[f"(traceback) {text[:120]}"] += 1
                elif text and not text.startswith((" ", "Traceback", "During handling")):
                    errors[f"(not JSON) {text[:120]}"] += 1
                continue
            level = str(record.get("level", "?"))
            levels[level] += 1
            msg = str(record.get("msg", ""))
            if level in ("error", "critical"):
                errors[_SESSION_ID.sub("<session>", msg)[:160]] += 1
            elif level == "warning":
                # collapse per-replica and per-session details
                warnings[" ".join(w for w in msg.split()[:6] if not any(c.isdigit() for c in w))
                         ] += 1  # fmt: skip
            if record.get("event") == "session_end":
                decisions[str(record.get("decision"))] += 1
                if record.get("client_close") is not None:
                    closes[str(record.get("client_close"))] += 1
    return {
        "levels": dict(levels),
        "errors": dict(errors.most_common(20)),
        "warnings": dict(warnings.most_common(12)),
        "decisions": dict(decisions),
        "client_close_codes": dict(closes),
        "non_json_lines": other,
    }


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class _ReplicaWatch:
    cap: int
    max_sampled: int = 0
    upstream_peak: int = 0
    upstream_max_excess: int = 0
    upstream_longest_excess_s: float = 0.0
    excess_since: float | None = None
    gate_minus_upstream_max: int = 0
    upstream_minus_gate_max: int = 0


@dataclass
class _State:
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    kinds: Counter[str] = field(default_factory=Counter)
    flagged_examples: list[str] = field(default_factory=list)
    sim_faults: Counter[str] = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    probe_failures: int = 0
    crashed: bool = False
    peak: dict[str, int] = field(default_factory=lambda: {"tasks": 0, "fds": 0, "rss_kb": 0})
    max_queue: int = 0
    done: int = 0
    #: (seconds, sessions done, RSS kB, fds, tasks), about every 2 s: growth would show
    trend: list[tuple[float, int, int, int, int]] = field(default_factory=list)


async def _probe(client: httpx.AsyncClient, gc: bool = False) -> dict[str, Any]:
    response = await client.get("/probe", params={"gc": "1"} if gc else None)
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


async def _sampler(
    cfg: ChaosConfig,
    headroom: HeadroomProcess,
    probe: httpx.AsyncClient,
    counters: dict[str, UpstreamCounter],
    watch: dict[str, _ReplicaWatch],
    state: _State,
    stop: asyncio.Event,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    next_trend = started
    while not stop.is_set():
        if not headroom.alive():
            state.crashed = True
            return
        try:
            snap = await _probe(probe)
        except (httpx.HTTPError, ValueError):
            state.probe_failures += 1
            snap = None
        now = loop.time()
        if snap is not None:
            state.samples += 1
            fds = proc_figures(headroom.pid)["fds"]
            for key in ("tasks", "rss_kb"):
                state.peak[key] = max(state.peak[key], int(snap[key]))
            state.peak["fds"] = max(state.peak["fds"], fds)
            if now >= next_trend:
                next_trend = now + 2.0
                state.trend.append(
                    (round(now - started, 1), state.done, snap["rss_kb"], fds, snap["tasks"])
                )
            for pool in snap["pools"].values():
                state.max_queue = max(state.max_queue, pool["queue"])
                if pool["queue"] > pool["max_depth"]:
                    state.violations.append({"queue": pool["queue"], "at": now})
                for name, r in pool["replicas"].items():
                    w = watch[name]
                    w.max_sampled = max(w.max_sampled, r["active"])
                    if r["active"] > r["cap"]:
                        state.violations.append({"replica": name, "active": r["active"],
                                                 "cap": r["cap"], "source": "sampler"})  # fmt: skip
                    counter = counters.get(name)
                    if counter is None:
                        continue
                    up = counter.active
                    w.upstream_peak = max(w.upstream_peak, counter.peak)
                    w.gate_minus_upstream_max = max(w.gate_minus_upstream_max, r["active"] - up)
                    w.upstream_minus_gate_max = max(w.upstream_minus_gate_max, up - r["active"])
                    if up > w.cap:
                        w.upstream_max_excess = max(w.upstream_max_excess, up - w.cap)
                        if w.excess_since is None:
                            w.excess_since = now
                        w.upstream_longest_excess_s = max(
                            w.upstream_longest_excess_s, now - w.excess_since
                        )
                    else:
                        w.excess_since = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), cfg.sample_interval_s)


def _sim_fault(kind: str, rng: random.Random) -> Faults:
    if kind == "drop_after_chunks":
        return Faults(drop_after_chunks=rng.randint(0, 5))
    if kind == "stall":
        return Faults(stall_after_chunks=rng.randint(0, 4), stall_s=rng.uniform(0.3, 3.0))
    if kind == "slow_start":
        return Faults(slow_start_s=rng.uniform(0.1, 1.5))
    if kind == "error_after_chunks":
        return Faults(error_after_chunks=rng.randint(0, 4))
    if kind == "handshake_503":
        return Faults(handshake_503=True)
    if kind == "unhealthy":
        return Faults(unhealthy=True)
    if kind == "refuse_connections":
        return Faults(refuse_connections=True, refuse_for_s=rng.uniform(0.2, 2.0))
    return Faults()


async def _flip_sim_faults(
    cfg: ChaosConfig,
    cluster: Cluster,
    http: httpx.AsyncClient,
    state: _State,
    stop: asyncio.Event,
) -> None:
    """Change one GPU's faults at random intervals; a quarter of the changes go through
    the live HTTP API (``POST``/``DELETE /sim/faults?gpu=N``, sent to the lite GPU)."""
    rng = random.Random(f"{cfg.seed}:sim-faults")
    kinds = list(SIM_FAULTS)
    admin = cluster.urls[-1]  # the lite GPU: never faulted, so always reachable
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(*cfg.sim_fault_every_s))
        if stop.is_set():
            return
        gpu = rng.choices(range(cfg.gpus), [1.0] + [2.0] * (cfg.gpus - 1))[0]
        kind = rng.choices(kinds, [SIM_FAULTS[k] for k in kinds])[0]
        faults = _sim_fault(kind, rng)
        state.sim_faults[kind] += 1
        if rng.random() < 0.25:
            url = f"{admin}/sim/faults?gpu={gpu}"
            with contextlib.suppress(httpx.HTTPError):
                if kind == "clear":
                    await http.delete(url)
                else:
                    default = Faults().as_json()
                    changes = {k: v for k, v in faults.as_json().items() if v != default[k]}
                    await http.delete(url)
                    await http.post(url, json=changes)
        else:
            await cluster.set_faults(faults, gpu=gpu)


async def _settle(
    cfg: ChaosConfig,
    headroom: HeadroomProcess,
    probe: httpx.AsyncClient,
    counters: dict[str, UpstreamCounter],
    baseline: dict[str, Any] | None,
) -> tuple[dict[str, Any], float]:
    """Poll until the process is back to rest (or ``settle_s`` passes): the last snapshot
    and how long it took. Without a ``baseline``, tasks and descriptors are not compared."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    snap: dict[str, Any] = {}
    while True:
        snap = await _probe(probe, gc=True)
        snap["proc"] = proc_figures(headroom.pid)
        healthy = all(r["healthy"] for p in snap["pools"].values() for r in p["replicas"].values())
        rest = (
            snap["active"] == 0
            and snap["queued"] == 0
            and snap["live_sessions"] == 0
            and healthy
            and all(c.active == 0 for c in counters.values())
            and (
                baseline is None
                or (
                    snap["tasks"] <= baseline["tasks"] + cfg.task_tolerance
                    and _fd_growth(snap, baseline) <= cfg.fd_tolerance
                )
            )
        )
        if rest or loop.time() - start > cfg.settle_s:
            return snap, loop.time() - start
        await asyncio.sleep(0.25)


def _fd_growth(snap: dict[str, Any], baseline: dict[str, Any]) -> int:
    """Descriptor growth, not counting the upstream HTTP pool's keep-alive connections
    (bounded by httpx; they come and go with the upstreams' keep-alive timeouts)."""
    now = snap["proc"]["fds"] - snap["upstream_pool_connections"]
    then = baseline["proc"]["fds"] - baseline["upstream_pool_connections"]
    return int(now - then)


async def _warm_up(ctx: ClientContext, seed: int) -> list[str]:
    """One clean session of each protocol (no faults yet), in order."""
    rng = random.Random(f"{seed}:warm")
    calls: list[Callable[[], Awaitable[str]]] = [
        lambda: ws_speech(ctx, rng),
        lambda: ws_speech(ctx, rng, path=FEEDBACK_WS),
        lambda: http_speech(ctx, rng, sse=True),
        lambda: http_speech(ctx, rng, sse=False),
        lambda: realtime(ctx, rng),
    ]
    out = []
    for call in calls:
        async with asyncio.timeout(ctx.deadline_s):
            out.append(await call())
    return out


async def run_soak(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the soak described by ``cfg``; returns the report (see :func:`format_report`)."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    state = _State()
    with contextlib.ExitStack() as exits:
        workdir = Path(cfg.workdir) if cfg.workdir else Path(
            exits.enter_context(tempfile.TemporaryDirectory(prefix="headroom-chaos-"))
        )  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            cluster, counters_list = await stack.enter_async_context(
                counted_cluster(cfg.preset, cfg.gpus + 1, cfg.seed)
            )
            plan = FaultPlan(PROXY_WEIGHTS) if cfg.proxy_faults else FaultPlan.clean()
            proxies: list[FaultProxy] = []
            tts_urls = [cluster.urls[0]]
            for i in range(1, cfg.gpus):
                gpu = cluster.gpus[i]
                # clean until the warm-up is done: it checks Headroom, not the faults
                fp = FaultProxy((gpu.host, gpu.port), FaultPlan.clean(), seed=cfg.seed * 101 + i)
                await stack.enter_async_context(fp)
                proxies.append(fp)
                tts_urls.append(fp.url)
            settings = headroom_settings(cfg, tts_urls, cluster.urls[-1])
            config_path = workdir / "headroom.yaml"
            config_path.write_text(yaml.safe_dump(settings, sort_keys=False))
            headroom = HeadroomProcess(config_path, workdir / "headroom.log")
            await headroom.start()
            stack.push_async_callback(headroom.stop)
            probe = await stack.enter_async_context(
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{headroom.probe_port}",
                                  timeout=10.0, trust_env=False)
            )  # fmt: skip
            admin_http = await stack.enter_async_context(
                httpx.AsyncClient(timeout=5.0, trust_env=False)
            )
            model = cluster.preset.model
            ctx = ClientContext("127.0.0.1", headroom.port, model,
                                deadline_s=cfg.client_deadline_s)  # fmt: skip
            counters = {f"gpu{i}": counters_list[i] for i in range(cfg.gpus)}
            counters["lite0"] = counters_list[-1]
            caps = {f"gpu{i}": cfg.cap for i in range(cfg.gpus)} | {"lite0": cfg.lite_cap}
            watch = {name: _ReplicaWatch(cap) for name, cap in caps.items()}

            warm = await _warm_up(ctx, cfg.seed)
            await _settle(cfg, headroom, probe, counters, None)
            await asyncio.sleep(0.5)  # let closing keep-alive connections finish
            baseline = await _baseline(probe, headroom)
            for fp in proxies:  # the faults start with the chaos
                fp.plan = plan

            stop = asyncio.Event()
            sampler = asyncio.ensure_future(
                _sampler(cfg, headroom, probe, counters, watch, state, stop)
            )
            flipper = asyncio.ensure_future(
                _flip_sim_faults(cfg, cluster, admin_http, state, stop)
                if cfg.sim_faults else stop.wait()
            )  # fmt: skip
            next_index = 0
            run_start = loop.time()

            async def worker() -> None:
                nonlocal next_index
                while next_index < cfg.sessions and not state.crashed:
                    i = next_index
                    next_index += 1
                    rng = random.Random(f"{cfg.seed}:{i}")
                    kind = choose(rng)
                    outcome = await run_client(ctx, kind, rng)
                    state.kinds[kind] += 1
                    state.outcomes[outcome.split(":", 1)[0]] += 1
                    state.by_kind.setdefault(kind, Counter())[outcome] += 1
                    if flagged(outcome) and len(state.flagged_examples) < 30:
                        state.flagged_examples.append(f"#{i} {kind}: {outcome}")
                    state.done += 1
                    if outcome.startswith("refused"):
                        # a refused client comes back later (Retry-After, scaled down), so
                        # the run is not one long refusal storm
                        await asyncio.sleep(rng.uniform(*cfg.refused_backoff_s))

            async def progress() -> None:
                while cfg.progress_s > 0:
                    await asyncio.sleep(cfg.progress_s)
                    rate = state.done / max(loop.time() - run_start, 1e-9)
                    line = f"chaos: {state.done}/{cfg.sessions} sessions ({rate:.1f}/s), "
                    print(line + f"outcomes {dict(state.outcomes)}", file=sys.stderr, flush=True)

            reporter = asyncio.ensure_future(progress())
            workers = [asyncio.ensure_future(worker()) for _ in range(cfg.concurrency)]
            try:
                await asyncio.gather(*workers)
            finally:
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                run_s = loop.time() - run_start
                stop.set()
                reporter.cancel()
                await asyncio.gather(sampler, flipper, reporter, return_exceptions=True)

            # -- settle: faults off, every client gone ---------------------------------
            await cluster.clear_faults()
            for fp in proxies:
                fp.plan = FaultPlan.clean()
            alive_before_settle = headroom.alive()
            final: dict[str, Any] = {}
            settle_s = 0.0
            after: list[str] = []
            if alive_before_settle:
                final, settle_s = await _settle(cfg, headroom, probe, counters, baseline)
                after = await _warm_up(ctx, cfg.seed + 1)
                final_audit = (await _probe(probe))["audit"]
            else:
                final_audit = {"violations": [], "max_active": {}, "checks": 0}
            hwm = proc_figures(headroom.pid)["hwm_kb"] if headroom.alive() else 0
            exit_code = await headroom.stop()
            fault_counts = {
                "proxy_chosen": dict(sum((Counter(fp.chosen) for fp in proxies), Counter())),
                "proxy_triggered": dict(sum((Counter(fp.triggered) for fp in proxies), Counter())),
                "proxy_connections": sum(sum(fp.chosen.values()) for fp in proxies),
                "proxy_expired": sum(fp.expired for fp in proxies),
                "sim": dict(state.sim_faults),
            }
            log = read_log(headroom.log_path)
    return _report(cfg, state, watch, baseline, final, final_audit, warm, after, log,
                   fault_counts, run_s, settle_s, hwm, exit_code, alive_before_settle,
                   time.monotonic() - started)  # fmt: skip


async def _baseline(probe: httpx.AsyncClient, headroom: HeadroomProcess) -> dict[str, Any]:
    snap = await _probe(probe, gc=True)
    snap["proc"] = proc_figures(headroom.pid)
    return snap


def _report(
    cfg: ChaosConfig,
    state: _State,
    watch: dict[str, _ReplicaWatch],
    baseline: dict[str, Any],
    final: dict[str, Any],
    audit: dict[str, Any],
    warm: list[str],
    after: list[str],
    log: dict[str, Any],
    faults: dict[str, Any],
    run_s: float,
    settle_s: float,
    hwm_kb: int,
    exit_code: int | None,
    alive: bool,
    total_s: float,
) -> dict[str, Any]:
    replicas = {}
    for name, w in watch.items():
        replicas[name] = {
            "cap": w.cap,
            "max_active_audit": audit.get("max_active", {}).get(
                f"{'lite' if name == 'lite0' else 'tts'}/{name}", 0
            ),
            "max_active_sampled": w.max_sampled,
            "upstream_peak": w.upstream_peak,
            "upstream_max_excess": w.upstream_max_excess,
            "upstream_longest_excess_s": round(w.upstream_longest_excess_s, 3),
            "gate_minus_upstream_max": w.gate_minus_upstream_max,
            "upstream_minus_gate_max": w.upstream_minus_gate_max,
        }
    violations = list(audit.get("violations", [])) + state.violations
    flagged_total = sum(n for o, n in state.outcomes.items() if flagged(o))
    final_tasks = final.get("tasks", -1)
    fd_growth = _fd_growth(final, baseline) if final else None
    invariants = {
        "process_never_crashed": alive and not state.crashed,
        "clean_exit_on_sigterm": exit_code == 0,
        "cap_never_exceeded": not violations
        and all(r["max_active_audit"] <= r["cap"] for r in replicas.values()),
        "upstream_excess_transient": all(
            r["upstream_longest_excess_s"] <= cfg.upstream_grace_s for r in replicas.values()
        ),
        "zero_leaked_slots": bool(final) and final["active"] == 0 and final["live_sessions"] == 0,
        "empty_queue": bool(final) and final["queued"] == 0,
        "no_task_growth": bool(final) and final_tasks <= baseline["tasks"] + cfg.task_tolerance,
        "no_fd_growth": fd_growth is not None and fd_growth <= cfg.fd_tolerance,
        "no_flagged_sessions": flagged_total == 0,
        "no_error_logs": not log["errors"],
        "serves_after_chaos": bool(after) and all(o == "ok" for o in after),
        "warm_up_clean": all(o == "ok" for o in warm),
    }
    return {
        "config": asdict(cfg),
        "duration_s": round(total_s, 1),
        "run_s": round(run_s, 1),
        "settle_s": round(settle_s, 2),
        "sessions": sum(state.kinds.values()),
        "sessions_per_s": round(sum(state.kinds.values()) / max(run_s, 1e-9), 2),
        "clients_by_kind": dict(state.kinds.most_common()),
        "outcomes": dict(state.outcomes.most_common()),
        "outcomes_by_kind": {k: dict(v.most_common()) for k, v in sorted(state.by_kind.items())},
        "flagged_examples": state.flagged_examples,
        "proxy_decisions": log["decisions"],
        "client_close_codes": log["client_close_codes"],
        "faults": faults,
        "replicas": replicas,
        "cap_violations": violations[:20],
        "audit_checks": audit.get("checks", 0),
        "samples": state.samples,
        "probe_failures": state.probe_failures,
        "max_queue_depth": state.max_queue,
        "leaked_slots": final.get("active"),
        "final_queue": final.get("queued"),
        "final_live_sessions": final.get("live_sessions"),
        "tasks": {"baseline": baseline["tasks"], "peak": state.peak["tasks"],
                  "final": final_tasks, "final_names": final.get("task_names")},
        "fds": {"baseline": baseline["proc"]["fds"], "peak": state.peak["fds"],
                "final": final.get("proc", {}).get("fds"), "growth_net_of_pool": fd_growth,
                "upstream_pool_final": final.get("upstream_pool_connections")},
        "rss_kb": {"baseline": baseline["proc"]["rss_kb"], "peak": max(hwm_kb,
                   state.peak["rss_kb"]), "final": final.get("proc", {}).get("rss_kb")},
        "trend": {"fields": ["s", "sessions_done", "rss_kb", "fds", "tasks"],
                  "samples": state.trend},
        "log_levels": log["levels"],
        "error_logs": log["errors"],
        "warning_logs": log["warnings"],
        "exit_code": exit_code,
        "warm_up": warm,
        "after_chaos": after,
        "invariants": invariants,
        "ok": all(invariants.values()),
    }  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"chaos soak: {report['sessions']} sessions in {report['run_s']} s "
        f"({report['sessions_per_s']}/s), concurrency {report['config']['concurrency']}, "
        f"seed {report['config']['seed']}; settled in {report['settle_s']} s",
        "",
        "sessions by outcome:",
    ]
    lines += [f"  {k:<18} {v:>7}" for k, v in report["outcomes"].items()]
    lines += ["", "clients by kind:"]
    lines += [f"  {k:<22} {v:>6}  {report['outcomes_by_kind'].get(k, {})}"
              for k, v in report["clients_by_kind"].items()]  # fmt: skip
    lines += ["", "proxy decisions (session log):"]
    lines += [f"  {k:<26} {v:>7}" for k, v in sorted(report["proxy_decisions"].items())]
    faults = report["faults"]
    lines += ["", f"faults injected (fault proxy, {faults['proxy_connections']} connections):"]
    for kind, n in sorted(faults["proxy_chosen"].items()):
        lines.append(f"  {kind:<14} drawn {n:>6}  took effect "
                     f"{faults['proxy_triggered'].get(kind, 0):>6}")  # fmt: skip
    lines += ["", "faults injected (simulator, live changes):"]
    lines += [f"  {k:<20} {v:>6}" for k, v in sorted(faults["sim"].items())]
    lines += ["", "replica    cap  max(audit)  max(sampled)  upstream peak  excess(max, longest s)"]
    for name, r in report["replicas"].items():
        lines.append(
            f"  {name:<8} {r['cap']:>3}  {r['max_active_audit']:>10}  {r['max_active_sampled']:>12}"
            f"  {r['upstream_peak']:>13}  {r['upstream_max_excess']}, "
            f"{r['upstream_longest_excess_s']}"
        )
    t, f, m = report["tasks"], report["fds"], report["rss_kb"]
    trend = report["trend"]["samples"]
    if len(trend) >= 4:
        quarter = [trend[i * (len(trend) - 1) // 4] for i in range(5)]
        rss_line = "  ".join(f"{done} sess {rss / 1024:.1f} MiB" for _, done, rss, _, _ in quarter)
    else:
        rss_line = "n/a"

    lines += [
        "",
        f"audit checks {report['audit_checks']}, samples {report['samples']}, cap violations "
        f"{len(report['cap_violations'])}, max queue {report['max_queue_depth']}",
        f"leaked slots {report['leaked_slots']}, queue at end {report['final_queue']}, "
        f"live relays at end {report['final_live_sessions']}",
        f"tasks  baseline {t['baseline']}  peak {t['peak']}  final {t['final']}",
        f"fds    baseline {f['baseline']}  peak {f['peak']}  final {f['final']}  "
        f"(net growth {f['growth_net_of_pool']}, upstream pool {f['upstream_pool_final']})",
        f"RSS    baseline {m['baseline'] / 1024:.1f} MiB  peak {m['peak'] / 1024:.1f} MiB  "
        f"final {(m['final'] or 0) / 1024:.1f} MiB",
        f"RSS over the run: {rss_line}",
        f"log levels {report['log_levels']}; exit code {report['exit_code']}",
    ]
    if report["error_logs"]:
        lines += ["ERROR log lines:"] + [f"  {n:>5} x {msg}" for msg, n in
                                         report["error_logs"].items()]  # fmt: skip
    if report["flagged_examples"]:
        lines += ["flagged sessions:"] + [f"  {e}" for e in report["flagged_examples"]]
    lines += [f"warm-up {report['warm_up']}, after chaos {report['after_chaos']}"]
    if report["warning_logs"]:
        lines += ["WARNING log lines (top):"] + [f"  {n:>5} x {msg}" for msg, n in
                                                report["warning_logs"].items()]  # fmt: skip
    lines += ["", "invariants:"]
    lines += [f"  {'PASS' if v else 'FAIL'}  {k}" for k, v in report["invariants"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Chaos soak of Headroom (see the module docstring)."
    )
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cap", type=int, default=3, help="sessions per tts replica")
    parser.add_argument("--gpus", type=int, default=3, help="tts replicas")
    parser.add_argument("--preset", default="l4-cosyvoice2-0.5b")
    parser.add_argument("--no-proxy-faults", action="store_true")
    parser.add_argument("--no-sim-faults", action="store_true")
    parser.add_argument("--guard", choices=["off", "observe", "enforce"], default="enforce")
    parser.add_argument("--workdir", help="keep the config and Headroom's log here")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON")
    parser.add_argument("--progress", type=float, default=10.0, metavar="S")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.concurrency < 1 or args.gpus < 2 or args.cap < 1:
        parser.error("--sessions, --concurrency, --cap >= 1 and --gpus >= 2")
    cfg = ChaosConfig(
        sessions=args.sessions,
        concurrency=args.concurrency,
        seed=args.seed,
        cap=args.cap,
        gpus=args.gpus,
        preset=args.preset,
        proxy_faults=not args.no_proxy_faults,
        sim_faults=not args.no_sim_faults,
        guard=args.guard,
        workdir=args.workdir,
        progress_s=args.progress,
    )
    from proxy.process.cli import run_async

    result: dict[str, Any] = {}

    async def run() -> None:
        result.update(await run_soak(cfg))

    run_async(run())
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
