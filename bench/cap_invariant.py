"""Randomized cap-invariant run: two gateways on one Redis -- one of them ``headroom serve
--workers 2`` -- in front of simulated GPUs, driven by a seeded generator through
arbitrary interleavings of sessions, gang reservations claimed on either gateway, live
reloads that lower and raise the caps, event-loop stalls, Redis restarts and gateway
kills, while the simulated engine counts its concurrent upstream sessions exactly
(docs/reliability.md, "The cap-invariant run").

    python bench/cap_invariant.py --duration 60                 # a short run
    python bench/cap_invariant.py --duration 600 --seed 7 --json ci.json --markdown ci.md

Everything listens on 127.0.0.1 ports chosen by the OS; every process is started by the
run and stopped at its end, and the run stops by itself after ``--duration`` seconds
plus a bounded settle. The exit status is 0 only if the invariants held:

* **no admission over the cap in force**: every session that reaches a GPU finds at
  most the cap in force there (the simulator logs every upstream session's start and
  end; a reload's new cap is in force once every gateway has answered it, the higher of
  the two before; a start is judged against the highest cap in force during the
  ``upstream_connect_timeout_s`` before it, the time an admitted session may take to
  reach the engine);
* **never over the highest cap**: no sample and no stream opened above it;
* **no slot leaked**: after the clients stop, Redis holds no lease, owner or waiter, and
  the engine no session or stream;
* **a stalled loop fences nothing**: no gateway ends its sessions for lost leases while
  one of its event loops is stalled (for ``2 x lease_ttl_s``) or just after.

Faults and operations, one at a time at seeded random intervals (each kind once in a
random order first, then any): ``kill9`` (SIGKILL a
gateway -- for the workers gateway the supervisor and its workers, like a pod kill --
then start it again on the same ports), ``redis_restart`` (SIGKILL redis-server, start
it again empty), ``stall`` (block one gateway process's event loop -- one worker of the
workers gateway -- for ``2 x lease_ttl_s``: the run starts gateways with a
``sitecustomize`` whose SIGUSR1 handler sleeps on the main thread, releasing the GIL),
``gil_stall`` (the same, but the SIGUSR2 handler calls libc ``sleep`` through
:class:`ctypes.PyDLL`, which holds the GIL: no thread of the process runs),
``sigstop`` (SIGSTOP a gateway -- the workers gateway's supervisor and workers -- for
``2 x lease_ttl_s``, then SIGCONT), ``reload`` (write new caps, each GPU's drawn from 1
to ``--cap``, into both gateways' files and ``POST /admin/reload`` to each),
``big_body`` (a 480 MB JSON body with no key to one gateway's reservation endpoint, the
control-plane attack of a loop stalled by its input), ``nan_page`` and ``slow_page``
(one GPU's engine ``/metrics`` page reports ``vllm:num_requests_running`` as NaN, or
drips one byte every 1.5 s, for ``2 x lease_ttl_s``: ``POST /sim/metrics_page``). The
gateways scrape every engine page each second with ``engine_reconcile`` on, and a
fifth invariant joins the four above:

* **engine scraping outlives a bad page**: each bad page is counted by some gateway
  (``headroom_engine_scrape_errors_total``, reason ``not_finite`` or ``timeout``) and,
  a few seconds after the page is honest again, every gateway has fresh figures from
  every GPU (``headroom_engine_figures_age_seconds``).

The stall hooks are installed only by this run's launcher (the ``sitecustomize`` in its
work directory, active only with ``HEADROOM_BENCH_STALL_S`` set); a gateway started
otherwise has none.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import chaos_shared as cs  # noqa: E402

KINDS = ("kill9", "redis_restart", "stall", "gil_stall", "sigstop", "reload", "big_body",
         "nan_page", "slow_page")  # fmt: skip
#: The kinds that freeze a gateway's loop: none may end in a fence.
STALLS = ("stall", "gil_stall", "sigstop")
#: The error each bad engine page must be counted as.
PAGE_ERRORS = {"nan_page": "not_finite", "slow_page": "timeout"}
RESERVATIONS = "/v1/headroom/reservations"
#: The gateways' engine scrape interval (s), and how old a figure may be after a bad
#: page is honest again: an interval, the scrape's own bound (2 s), and slack.
SCRAPE_S = 1.0
FRESH_S = SCRAPE_S + 2.0 + 3.0

STALL_HOOK = """\
import os
import signal
import time

_STALL_S = os.environ.get("HEADROOM_BENCH_STALL_S")
if _STALL_S:
    def _stall(signum, frame):
        time.sleep(float(_STALL_S))

    def _gil_stall(signum, frame):
        import ctypes

        ctypes.PyDLL(None).sleep(ctypes.c_uint(round(float(_STALL_S))))

    signal.signal(signal.SIGUSR1, _stall)
    signal.signal(signal.SIGUSR2, _gil_stall)
"""


@dataclass(slots=True)
class InvariantConfig:
    duration_s: float = 600.0
    gpus: int = 2
    cap: int = 3
    clients: int = 0  # 0: 2 x gpus x cap
    think_s: float = 1.0  # a client's pause after a session, drawn from 0 to this
    preset: str = "l4-cosyvoice2-0.5b"
    lease_ttl_s: float = 4.0
    renew_interval_s: float = 1.0
    fence_margin_s: float = 1.0
    reserve_share: float = 0.3
    long_share: float = 0.25
    long_repeat: int = 8  # a long session's text: the chaos run's short text this many times
    queue_depth: int = 8
    queue_wait_s: float = 4.0
    big_body_mb: int = 480
    first_op_s: float = 6.0
    op_gap_s: tuple[float, float] = (4.0, 12.0)
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    settle_s: float = 30.0
    workdir: str | None = None

    @property
    def offered(self) -> int:
        return self.clients or 2 * self.gpus * self.cap

    @property
    def stall_s(self) -> float:
        return 2 * self.lease_ttl_s

    def chaos(self) -> cs.SharedChaosConfig:
        """The chaos run's configuration its building blocks read."""
        return cs.SharedChaosConfig(
            duration_s=self.duration_s, gateways=2, gpus=self.gpus, cap=self.cap,
            preset=self.preset, lease_ttl_s=self.lease_ttl_s,
            renew_interval_s=self.renew_interval_s, fence_margin_s=self.fence_margin_s,
            queue_depth=self.queue_depth, queue_wait_s=self.queue_wait_s, seed=self.seed,
        )  # fmt: skip


def gateway_config(cfg: InvariantConfig, port: int, admin_port: int, redis_url: str,
                   gpu_urls: list[str], caps: list[int]) -> dict[str, Any]:  # fmt: skip
    data = cs.gateway_settings(cfg.chaos(), port, redis_url, gpu_urls)
    data["admin"] = {"enabled": True, "host": "127.0.0.1", "port": admin_port}
    # A stalled loop must be measured against the fence alone, not the idle timeout.
    data["limits"]["idle_timeout_s"] = cfg.stall_s + 10
    data["health"]["engine_metrics_interval_s"] = SCRAPE_S
    data["pools"][0]["engine_reconcile"] = True
    data["pools"][0]["engine_reconcile_hold_s"] = 5 * SCRAPE_S
    data["limits"]["max_session_s"] = 60
    for replica, cap in zip(data["pools"][0]["replicas"], caps, strict=True):
        replica["max_sessions"] = cap
    return data


@dataclass
class Gateway:
    process: cs.GatewayProcess
    admin_port: int
    config_path: Path
    workers: int

    def pids(self) -> list[int]:
        """The process whose loop serves sessions: the gateway, or each worker."""
        pid = self.process.pid
        if self.workers == 1:
            return [pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            return [int(c) for c in children]
        return []


@dataclass
class CapChange:
    sent: float
    answered: float
    before: list[int]
    after: list[int]
    applied: bool
    answers: list[Any] = field(default_factory=list)


@dataclass
class State:
    cfg: InvariantConfig
    rng: random.Random
    gateways: list[Gateway]
    caps: list[int]
    changes: list[CapChange] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[cs.Session] = field(default_factory=list)
    reservations: Counter[str] = field(default_factory=Counter)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = 0.0
    #: Clients 0 .. active-1 run sessions now; the others wait (load phases).
    active: int = 0


# -- clients ---------------------------------------------------------------------------------


async def _reserve(state: State, gw: int) -> tuple[str | None, str]:
    import httpx

    url = f"{state.gateways[gw].process.url}{RESERVATIONS}"
    try:
        async with httpx.AsyncClient(timeout=5.0) as http:
            r = await http.post(url, json={"pools": [cs.POOL], "hold_s": 5})
    except httpx.HTTPError as exc:
        return None, f"reserve_failed:{type(exc).__name__}"
    if r.status_code == 201:
        return str(r.json()["token"]), "reserved"
    return None, f"reserve_refused:{r.status_code}:{r.headers.get('x-headroom-reason', '')}"


async def _session(state: State, client: int, n: int) -> cs.Session:
    import websockets
    from websockets.exceptions import InvalidMessage, InvalidStatus

    cfg, rng = state.cfg, state.rng
    gw = rng.randrange(len(state.gateways))
    s = cs.Session(f"{client}-{n}", gw, time.monotonic(), long=rng.random() < cfg.long_share)
    headers: dict[str, str] = {}
    claim = ""
    if rng.random() < cfg.reserve_share:
        reserved_on = rng.randrange(len(state.gateways))
        claim = "claim_same_gateway" if reserved_on == gw else "claim_other_gateway"
        token, outcome = await _reserve(state, reserved_on)
        state.reservations[outcome] += 1
        if token is None:
            s.outcome, s.ended = outcome, time.monotonic()
            return s
        headers["X-Headroom-Reservation"] = token
    url = f"ws://127.0.0.1:{state.gateways[gw].process.port}{cs.SPEECH_WS}?cid={s.cid}"
    try:
        async with asyncio.timeout(cfg.queue_wait_s + cfg.stall_s + 40):
            try:
                ws = await websockets.connect(url, additional_headers=headers,
                                              open_timeout=cfg.queue_wait_s + cfg.stall_s + 15,
                                              close_timeout=2, max_size=2**24)  # fmt: skip
            except InvalidStatus as exc:
                reason = exc.response.headers.get("x-headroom-reason", "")
                s.outcome = f"refused:{exc.response.status_code}:{reason}"
                return s
            except (InvalidMessage, OSError):
                s.outcome = "connect_failed"
                return s
            s.opened = time.monotonic()
            text = " ".join([cs.TEXT] * cfg.long_repeat) if s.long else cs.TEXT
            s.outcome = await cs.speak(ws, text)
    except TimeoutError:
        s.outcome = s.outcome or "hung"
    except Exception as exc:
        s.outcome = f"client_error:{type(exc).__name__}"
    finally:
        s.ended = time.monotonic()
        if headers:
            state.reservations[f"{claim}:{s.outcome}"] += 1
    return s


async def _client(state: State, client: int) -> None:
    await asyncio.sleep(state.rng.uniform(0, 1.0))
    n = 0
    while not state.stop.is_set():
        if client >= state.active:
            await asyncio.sleep(0.5)
            continue
        s = await _session(state, client, n)
        state.sessions.append(s)
        n += 1
        if s.outcome != "ok":
            await asyncio.sleep(state.rng.uniform(0.2, 0.6))
        else:
            await asyncio.sleep(state.rng.uniform(0, state.cfg.think_s))


# -- operations ------------------------------------------------------------------------------


async def _load_phases(state: State) -> None:
    """From a quarter of the clients to all of them, changing every 5 to 15 s: calm
    phases leave free slots (where gang reservations succeed), busy ones a queue."""
    n = state.cfg.offered
    while True:
        state.active = state.rng.randint(max(1, n // 4), n)
        await asyncio.sleep(state.rng.uniform(5.0, 15.0))


async def _reload(state: State, urls: list[str], redis_url: str) -> dict[str, Any]:
    import httpx

    before = list(state.caps)
    after = [state.rng.randint(1, state.cfg.cap) for _ in before]
    sent = time.monotonic()
    for g in state.gateways:
        data = gateway_config(state.cfg, g.process.port, g.admin_port, redis_url, urls, after)
        g.config_path.write_text(json.dumps(data) + "\n")
    answers: list[Any] = []
    applied = True
    async with httpx.AsyncClient(timeout=20.0) as http:
        for g in state.gateways:
            try:
                r = await http.post(f"http://127.0.0.1:{g.admin_port}/admin/reload")
                answers.append({"status": r.status_code, "body": r.json()})
                applied = applied and r.status_code == 200
            except (httpx.HTTPError, ValueError) as exc:
                answers.append({"error": f"{type(exc).__name__}: {exc}"})
                applied = False
    state.changes.append(CapChange(sent, time.monotonic(), before, after, applied, answers))
    state.caps = after
    return {"caps": after, "applied": applied}


async def _big_body(state: State, g: Gateway) -> dict[str, Any]:
    """The control-plane attack: a JSON body of ``big_body_mb`` MB (one deep array,
    streamed, with no key) to the reservation endpoint."""
    import httpx

    size = state.cfg.big_body_mb * 1_000_000
    sent = 0

    async def body() -> Any:
        nonlocal sent
        block = b"[" * 65536
        while sent < size:
            sent += len(block)
            yield block

    started = time.monotonic()
    url = f"{g.process.url}{RESERVATIONS}"
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            r = await http.post(url, content=body(), headers={"content-type": "application/json"})
            status: int | str = r.status_code
    except httpx.HTTPError as exc:  # the gateway may close the connection mid-body
        status = type(exc).__name__
    return {"status": status, "sent_mb": round(sent / 1e6, 1),
            "answered_s": round(time.monotonic() - started, 3)}  # fmt: skip


async def _set_page(url: str, page: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=5.0) as http:
        r = await http.post(f"{url}/sim/metrics_page", json={"page": page, "drip_s": 1.5})
        r.raise_for_status()


async def _scrape_figures(state: State) -> dict[str, Any]:
    """Each gateway's engine scrape errors (reason -> replica -> count) and the oldest
    engine figure it has (s), from its ``/metrics``."""
    import httpx

    out: dict[str, Any] = {"errors": {}, "max_age_s": 0.0, "unanswered": 0}
    async with httpx.AsyncClient(timeout=5.0) as http:
        for g in state.gateways:
            try:
                text = (await http.get(f"{g.process.url}/metrics")).text
            except httpx.HTTPError:
                out["unanswered"] += 1
                continue
            for name, labels, value in _samples(text):
                if name == "headroom_engine_scrape_errors_total":
                    by = out["errors"].setdefault(labels.get("reason", ""), {})
                    replica = labels.get("replica", "")
                    by[replica] = by.get(replica, 0) + value
                elif name == "headroom_engine_figures_age_seconds":
                    out["max_age_s"] = max(out["max_age_s"], value)
    return out


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = dict(
            (k, v.strip('"')) for k, _, v in (pair.partition("=") for pair in
                                              rest.rstrip("}").split(",") if pair)
        )  # fmt: skip
        with contextlib.suppress(ValueError):
            out.append((name, labels, float(value)))
    return out


async def _bad_page(state: State, urls: list[str], kind: str) -> dict[str, Any]:
    """One GPU's engine page lies (NaN) or drips for ``2 x lease_ttl_s``; then honest
    again. Counts the scrape errors it caused and the figures' age after it."""
    gpu = state.rng.randrange(len(urls))
    before = await _scrape_figures(state)
    await _set_page(urls[gpu], "nan" if kind == "nan_page" else "slow")
    try:
        await asyncio.sleep(state.cfg.stall_s)
    finally:
        await _set_page(urls[gpu], "honest")
    during = await _scrape_figures(state)
    await asyncio.sleep(FRESH_S)
    after = await _scrape_figures(state)
    reason, replica = PAGE_ERRORS[kind], f"gpu{gpu}"
    counted = during["errors"].get(reason, {}).get(replica, 0) - before["errors"].get(
        reason, {}
    ).get(replica, 0)
    return {"gpu": gpu, "errors_counted": counted, "max_age_after_s": after["max_age_s"],
            "unanswered": after["unanswered"]}  # fmt: skip


async def _kill9(state: State, g: Gateway) -> dict[str, Any]:
    pids = [g.process.pid, *([] if g.workers == 1 else g.pids())]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await asyncio.get_running_loop().run_in_executor(None, g.process.reap)
    await asyncio.sleep(state.cfg.lease_ttl_s + state.cfg.renew_interval_s)
    await g.process.start()
    return {"pids": len(pids)}


async def _ops(state: State, redis: cs.RedisProcess, urls: list[str]) -> None:
    cfg, rng = state.cfg, state.rng
    at = cfg.first_op_s
    first = rng.sample(cfg.kinds, len(cfg.kinds))  # every kind once, then any
    while True:
        kind = first.pop() if first else rng.choice(cfg.kinds)
        bound = cfg.lease_ttl_s * 3 + cfg.stall_s + 10
        if at + bound > cfg.duration_s:
            return
        await asyncio.sleep(max(0.0, state.t0 + at - time.monotonic()))
        target = rng.randrange(len(state.gateways))
        g = state.gateways[target]
        op: dict[str, Any] = {"kind": kind, "at": time.monotonic()}
        if kind == "kill9":
            op["gateway"] = target
            op.update(await _kill9(state, g))
        elif kind == "redis_restart":
            redis.kill()
            await asyncio.sleep(0.5)
            await redis.start()
        elif kind in ("stall", "gil_stall"):
            pids = g.pids()
            pid = rng.choice(pids) if pids else g.process.pid
            op.update(gateway=target, pid=pid)
            os.kill(pid, signal.SIGUSR1 if kind == "stall" else signal.SIGUSR2)
            await asyncio.sleep(cfg.stall_s + cfg.lease_ttl_s)
        elif kind == "sigstop":
            pids = [g.process.pid, *([] if g.workers == 1 else g.pids())]
            op.update(gateway=target, pids=len(pids))
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(cfg.stall_s)
            finally:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(cfg.lease_ttl_s)
        elif kind in PAGE_ERRORS:
            op.update(await _bad_page(state, urls, kind))
        elif kind == "big_body":
            op["gateway"] = target
            op.update(await _big_body(state, g))
        else:
            op.update(await _reload(state, urls, redis.url))
        op["until"] = time.monotonic()
        state.ops.append(op)
        at = op["until"] - state.t0 + rng.uniform(*cfg.op_gap_s)


# -- analysis --------------------------------------------------------------------------------


def caps_in_force(changes: list[CapChange], initial: list[int], gpu: int,
                  since: float, until: float) -> int:  # fmt: skip
    """The highest cap of ``gpu`` that some gateway may have admitted under at any time
    in [since, until]: a reload's old and new caps are both in force from when it was
    sent until every gateway answered it (and after, if one did not apply it)."""
    highest = 0
    current = initial[gpu]
    start = float("-inf")
    for c in changes:
        # [start, c.sent]: current alone; [c.sent, c.answered]: both.
        if start <= until and c.sent >= since:
            highest = max(highest, current)
        if c.sent <= until and c.answered >= since:
            highest = max(highest, current, c.before[gpu], c.after[gpu])
        current = c.after[gpu] if c.applied else max(c.before[gpu], c.after[gpu])
        start = c.answered
    if start <= until:
        highest = max(highest, current)
    return highest


def starts_over_cap(events: list[list[list[Any]]], changes: list[CapChange], initial: list[int],
                    grace_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Every upstream session start that found more sessions on its GPU than any cap in
    force during the ``grace_s`` before it."""
    over = []
    for gpu, seq in enumerate(events):
        active = 0
        for t, d, cid in sorted(seq, key=lambda e: (e[0], e[1])):  # ends first
            active += d
            if d == 1:
                cap = caps_in_force(changes, initial, gpu, t - grace_s, t)
                if active > cap:
                    over.append({"t": t, "gpu": gpu, "sessions": active, "cap": cap, "cid": cid})
    return over


def aborts_after_kills(events: list[list[list[Any]]], ops: list[dict[str, Any]],
                       gateway_of: dict[str, int]) -> list[dict[str, Any]]:  # fmt: skip
    """For each ``kill9``: how long after the kill the engine ended each upstream session
    of the killed gateway that was open at that moment (the engine's abort latency,
    which ``fence_margin_s`` must cover: the killed gateway's keeper hands the leases
    back that long after it sees its gateway gone)."""
    rows = []
    for op in ops:
        if op["kind"] != "kill9":
            continue
        latencies = []
        for seq in events:
            started: dict[str, float] = {}
            for t, d, cid in sorted(seq, key=lambda e: (e[0], e[1])):
                if d == 1:
                    started[cid] = t
                elif cid in started:
                    opened = started.pop(cid)
                    if gateway_of.get(cid) == op["gateway"] and opened <= op["at"] < t:
                        latencies.append(t - op["at"])
        rows.append({"gateway": op["gateway"], "sessions": len(latencies),
                     "max_s": round(max(latencies), 3) if latencies else None})  # fmt: skip
    return rows


def open_after_kill(
    events: list[list[Any]],
    ops: list[dict[str, Any]],
    gateway_of: dict[str, int],
    t: float,
    margin_s: float,
) -> list[str]:
    """The sessions open on one GPU at ``t`` that came through a gateway killed more than
    ``margin_s`` before ``t`` and still open at the engine since then: a start over the
    cap beside one of them is the engine aborting slower than ``fence_margin_s``."""
    kills = [op for op in ops if op["kind"] == "kill9" and op["at"] + margin_s < t]
    started: dict[str, float] = {}
    for when, d, cid in sorted(events, key=lambda e: (e[0], e[1])):
        if when > t:
            break
        if d == 1:
            started[cid] = when
        else:
            started.pop(cid, None)
    return sorted(
        cid for cid, opened in started.items()
        if any(op["gateway"] == gateway_of.get(cid) and opened <= op["at"] for op in kills)
    )  # fmt: skip


def fences(workdir: Path) -> list[tuple[int, float]]:
    """(gateway, wall time) of every "closing this gateway's ... sessions" log line (the
    fence, docs/shared-admission.md)."""
    out = []
    for path in sorted(workdir.glob("gateway*.log")):
        index = int(path.stem.removeprefix("gateway"))
        for line in path.read_text(errors="replace").splitlines():
            if "closing this gateway's" in line and line.startswith("{"):
                with contextlib.suppress(ValueError, KeyError):
                    ts = json.loads(line)["ts"]  # 2026-12-02T17:10:50.123Z
                    whole = calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S"))
                    out.append((index, whole + int(ts[20:23]) / 1000))
    return out


def _timed(op: dict[str, Any], t0: float) -> dict[str, Any]:
    """An operation on the run's clock (seconds from its start)."""
    where = {k: op[k] for k in ("gateway", "gpu") if k in op}
    return {"kind": op["kind"], "at_s": round(op["at"] - t0, 2),
            "until_s": round(op["until"] - t0, 2), **where}  # fmt: skip


def _page_survived(op: dict[str, Any]) -> bool:
    """A bad page was counted and left every figure fresh (other operations: True)."""
    if op["kind"] not in PAGE_ERRORS:
        return True
    return bool(op["errors_counted"] > 0 and op["max_age_after_s"] <= FRESH_S
                and not op["unanswered"])  # fmt: skip


def _cut(workdir: Path) -> int:
    """Sessions the fences ended: the sum of each fence line's count."""
    total = 0
    for path in sorted(workdir.glob("gateway*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "closing this gateway's" in line and line.startswith("{"):
                with contextlib.suppress(ValueError, IndexError):
                    total += int(line.split("closing this gateway's ", 1)[1].split()[0])
    return total


async def run(cfg: InvariantConfig) -> dict[str, Any]:
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="headroom-cap-invariant-"))
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 -- once, at start-up
    hook = workdir / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(STALL_HOOK)
    os.environ["HEADROOM_BENCH_STALL_S"] = str(cfg.stall_s)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(hook), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    load_before = os.getloadavg()
    redis = cs.RedisProcess(workdir / "redis.log")
    sim = cs.SimProcess(cfg.chaos(), workdir / "sim.log")
    state: State | None = None
    tasks: list[asyncio.Task[Any]] = []
    try:
        await redis.start()
        await sim.start()
        caps = [cfg.cap] * cfg.gpus
        gateways = []
        for i, workers in enumerate((1, 2)):
            port, admin = cs._free_port(), cs._free_port()
            path = workdir / f"gateway{i}.yaml"
            data = gateway_config(cfg, port, admin, redis.url, sim.urls, caps)
            path.write_text(json.dumps(data) + "\n")
            args = () if workers == 1 else ("--workers", str(workers))
            gateways.append(Gateway(cs.GatewayProcess(i, path, workdir / f"gateway{i}.log", port,
                                                      args), admin, path, workers))  # fmt: skip
        await asyncio.gather(*(g.process.start() for g in gateways))
        await asyncio.sleep(cfg.lease_ttl_s + 0.2)  # a new Redis blocks grants for one TTL
        state = State(cfg, random.Random(cfg.seed), gateways, caps)
        redis_state: dict[str, Any] = {"samples": 0, "errors": 0, "over_cap": 0,
                                       "negative": 0, "max_held": {}, "max_queue": 0}  # fmt: skip
        chaos_run = cs._Run(cfg.chaos(), [g.process.port for g in gateways], state.rng)
        state.t0 = chaos_run.t0 = time.monotonic()
        wall0 = time.time()
        tasks.append(asyncio.ensure_future(cs._redis_sampler(chaos_run, redis.url, redis_state)))
        ops = asyncio.ensure_future(_ops(state, redis, sim.urls))
        tasks.append(ops)
        tasks.append(asyncio.ensure_future(_load_phases(state)))
        clients = [asyncio.ensure_future(_client(state, i)) for i in range(cfg.offered)]
        await asyncio.sleep(max(0.0, state.t0 + cfg.duration_s - time.monotonic()))
        state.stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ops, cfg.lease_ttl_s * 3 + cfg.stall_s + 30)
        _, pending = await asyncio.wait(clients, timeout=cfg.settle_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        stopped = time.monotonic()
        await asyncio.sleep(cfg.lease_ttl_s + 2 * cfg.renew_interval_s + cfg.queue_wait_s)
        leaks = await _leaks(redis.url)
        sim_report = await sim.report()
        for task in tasks:
            task.cancel()
        exit_codes = [await g.process.stop() for g in gateways]
        return report(cfg, state, sim_report, redis_state, leaks, exit_codes, load_before,
                      stopped, wall0, workdir)  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        if state is not None:
            for g in state.gateways:
                with contextlib.suppress(Exception):
                    await g.process.stop()
        with contextlib.suppress(Exception):
            await sim.stop()
        redis.kill()


async def _leaks(url: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=2)
    try:
        held = {cs._text(k): int(v) for k, v in (await client.hgetall(cs._keys("held"))).items()}
        return {
            "redis_leases": await client.zcard(cs._keys("leases")),
            "redis_owner": await client.hlen(cs._keys("owner")),
            "redis_held": held,
            "redis_queue": await client.zcard(cs._keys("queue")),
        }
    finally:
        await client.aclose()


def report(cfg: InvariantConfig, state: State, sim: dict[str, Any], redis_state: dict[str, Any],
           leaks: dict[str, Any], exit_codes: list[int | None],
           load_before: tuple[float, float, float], stopped: float, wall0: float,
           workdir: Path) -> dict[str, Any]:  # fmt: skip
    grace = float(cs.gateway_settings(cfg.chaos(), 0, "", [])["limits"]
                  ["upstream_connect_timeout_s"]) + 0.5  # fmt: skip
    initial = [cfg.cap] * cfg.gpus
    over = starts_over_cap(sim["events"], state.changes, initial, grace)
    gateway_of = {x.cid: x.gateway for x in state.sessions}
    for o in over:  # when, and what operation it fell in (until one TTL after it)
        o["at_s"] = round(o["t"] - state.t0, 2)
        o["during"] = [op["kind"] for op in state.ops
                       if op["at"] <= o["t"] <= op["until"] + cfg.lease_ttl_s]  # fmt: skip
        o["killed_gateways_sessions_open"] = open_after_kill(
            sim["events"][o["gpu"]], state.ops, gateway_of, o["t"], cfg.fence_margin_s
        )
    stalls = [op for op in state.ops if op["kind"] in STALLS]
    fenced = [(gw, t - wall0 + state.t0) for gw, t in fences(workdir)]
    # A fence from the stall's start until one TTL after the loop ran again (plus a
    # second for the clocks) counts against the stall.
    stall_fences = [
        (gw, t) for gw, t in fenced for op in stalls
        if gw == op["gateway"] and op["at"] - 1 <= t <= op["until"] + cfg.lease_ttl_s + 1
    ]  # fmt: skip
    outcomes = Counter(s.outcome for s in state.sessions)
    leaked = (leaks["redis_leases"] + leaks["redis_owner"] + leaks["redis_queue"]
              + sum(max(0, v) for v in leaks["redis_held"].values())
              + sum(sim["active_sessions"]) + sum(sim["open_streams"]))  # fmt: skip
    invariants = {
        "no_admission_over_cap_in_force": not over,
        "never_over_highest_cap": sim["over_cap_streams"] == 0
        and sim["audit"]["over_cap"] == 0
        and sim["over_cap_sessions"] == 0
        and redis_state["over_cap"] == 0,
        "no_leaked_slot": leaked == 0 and redis_state["negative"] == 0,
        "stalls_fence_nothing": not stall_fences,
        "no_client_error": not any(o.startswith("client_error") for o in outcomes),
        "engine_scraping_outlives_bad_pages": all(map(_page_survived, state.ops)),
    }
    return {
        "config": {**asdict(cfg), "offered": cfg.offered, "stall_s": cfg.stall_s},
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "workdir": str(workdir),
        "ran_s": round(stopped - state.t0, 1),
        "ops": Counter(op["kind"] for op in state.ops),
        "big_bodies": [
            {k: op.get(k) for k in ("gateway", "status", "sent_mb", "answered_s")}
            for op in state.ops
            if op["kind"] == "big_body"
        ],
        "timeline": [_timed(op, state.t0) for op in state.ops],
        "bad_pages": [
            {k: op.get(k) for k in ("kind", "gpu", "errors_counted", "max_age_after_s")}
            for op in state.ops
            if op["kind"] in PAGE_ERRORS
        ],
        "reloads": [
            {
                "at_s": round(c.sent - state.t0, 2),
                "before": c.before,
                "after": c.after,
                "applied": c.applied,
                "took_s": round(c.answered - c.sent, 3),
            }
            for c in state.changes
        ],
        "sessions": {
            "total": len(state.sessions),
            "by_outcome": dict(outcomes.most_common()),
            "ok_length_s": {k: _lengths(state.sessions, k == "long") for k in ("short", "long")},
            "reservations": dict(state.reservations),
        },
        "engine": {
            "samples": sim["samples"],
            "streams_opened": sim["audit"]["opened"],
            "max_streams": sim["max_streams"],
            "max_sessions": sim["max_sessions"],
            "over_highest_cap_samples": sim["over_cap_streams"],
        },
        "starts_over_cap_in_force": over[:50],
        "redis": {k: redis_state[k] for k in ("samples", "over_cap", "negative", "max_held")},
        "leaks": {
            **leaks,
            "sim_sessions": sim["active_sessions"],
            "sim_streams": sim["open_streams"],
            "total": leaked,
        },
        "engine_aborts_after_kill9": aborts_after_kills(sim["events"], state.ops, gateway_of),
        "fences": {"total": len(fenced), "during_stalls": len(stall_fences)},
        "sessions_cut": _cut(workdir),
        "gateway_exit_codes": exit_codes,
        "logs": cs.read_logs(workdir),
        "invariants": invariants,
        "passed": all(invariants.values()),
    }


def _lengths(sessions: list[cs.Session], long: bool) -> dict[str, Any]:
    v = [s.ended - s.opened for s in sessions
         if s.outcome == "ok" and s.opened is not None and s.long == long]  # fmt: skip
    return {"n": len(v), "p50": cs._pct(v, 0.5), "max": max(v) if v else None}


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"# Cap-invariant run: seed {c['seed']}, {r['ran_s']} s, 2 gateways (one with "
        f"--workers 2), {c['gpus']} GPUs x cap 1..{c['cap']}, {c['offered']} clients",
        "",
        f"load average before/after: {r['machine']['loadavg_before'][0]:.2f} / "
        f"{r['machine']['loadavg_after'][0]:.2f}",
        f"operations: {dict(r['ops'])}",
        f"sessions: {r['sessions']['total']} {r['sessions']['by_outcome']}",
        f"reservations: {r['sessions']['reservations']}",
        f"engine: {r['engine']['streams_opened']} streams opened, "
        f"{r['engine']['samples']} samples, max streams {r['engine']['max_streams']}",
        f"starts over the cap in force: {len(r['starts_over_cap_in_force'])}; "
        f"samples over the highest cap: {r['engine']['over_highest_cap_samples']}",
        f"leaked slots: {r['leaks']['total']}; fences: {r['fences']['total']} "
        f"({r['fences']['during_stalls']} during stalls), sessions cut by them: "
        f"{r['sessions_cut']}",
        f"bad engine pages: {r['bad_pages']}",
        f"engine abort after each kill9 (fence_margin_s {c['fence_margin_s']}): "
        f"{r['engine_aborts_after_kill9']}",
        "",
        "| invariant | held |",
        "|---|---|",
        *[f"| {k} | {'yes' if v else '**NO**'} |" for k, v in r["invariants"].items()],
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    d = InvariantConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--cap", type=int, default=d.cap, help="the highest max_sessions per GPU")
    p.add_argument("--clients", type=int, default=0, help="closed loops (0: 2 x gpus x cap)")
    p.add_argument(
        "--think",
        type=float,
        default=d.think_s,
        help="a client's pause after a session, drawn from 0 to this",
    )
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s)
    p.add_argument(
        "--fence-margin",
        type=float,
        default=d.fence_margin_s,
        help="the gateways' fence_margin_s: must cover the simulator's abort latency, which "
        "the report measures after each kill9",
    )
    p.add_argument(
        "--long-share",
        type=float,
        default=d.long_share,
        help="share of sessions sending the long text",
    )
    p.add_argument("--long-repeat", type=int, default=d.long_repeat)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"operations, from {KINDS}")
    p.add_argument(
        "--op-gap",
        default=",".join(str(x) for x in d.op_gap_s),
        help="seconds between operations, drawn from MIN,MAX",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--settle", type=float, default=d.settle_s)
    p.add_argument("--workdir", help="keep configurations and logs here")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--markdown", help="write the summary here")
    a = p.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    try:
        low, high = (float(x) for x in a.op_gap.split(","))
    except ValueError:
        p.error("--op-gap: MIN,MAX in seconds")
    cfg = InvariantConfig(duration_s=a.duration, op_gap_s=(low, high), gpus=a.gpus, cap=a.cap,
                          clients=a.clients, think_s=a.think,
                          lease_ttl_s=a.lease_ttl, fence_margin_s=a.fence_margin,
                          long_share=a.long_share,
                          long_repeat=a.long_repeat, kinds=kinds, seed=a.seed, settle_s=a.settle,
                          workdir=a.workdir)  # fmt: skip
    result = asyncio.run(run(cfg))
    return cs.emit(result, format_report(result), a.json, a.markdown)


if __name__ == "__main__":
    sys.exit(main())
