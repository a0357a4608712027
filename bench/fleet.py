"""A fleet of shared gates against one redis-server, then a 3-primary Redis Cluster.

    python bench/fleet.py --quick [--json out.json]      # about a minute
    python bench/fleet.py [--gateways 120 --procs 4 ...]   # the full run, several minutes

``--gateways`` gateway identities spread over ``--procs`` processes: each identity is a
real :class:`~proxy.admission.shared_gate.SharedGate` with its own
:class:`~proxy.admission.redis_backend.RedisAdmission` (its own connections, leases,
renewal loop and wake-up loops), serving every pool. Each process offers session starts
at its share of a target rate (open loop: arrivals do not wait for earlier sessions),
round robin over its gates and over the pools; a session holds its slot for a random
time, then releases it. The engines' stand-in is one shared array of running streams
per process, pool and replica: every start checks the sum against the replica's cap,
and the parent samples it every 20 ms (a killed process's streams end with it).

Per phase it reports the starts held per second against the target, acquire and
release latency at the gateway (p50/p99/p99.9; acquire includes the queue wait of a
session that queued), renewal lag (how far past its interval a pool's last renewal
is, sampled every 250 ms) and misses (a renewal more than one interval late), fences
(and the sessions they ended), refusals by reason, samples over the cap, Redis CPU
(``INFO cpu`` deltas, primaries only) per 1k starts and as a share of one core, the
calls of each command per start and the CPU inside them (``INFO commandstats``, in the
JSON), and memory per 10k leases (``INFO memory`` against the figure before the load).
The saturation point is the first rate whose starts held fall under 90 % of the target
or whose acquire p99 passes ``--p99-limit-ms``. Faults (``--faults`` picks which run): a
10x burst of starts, 20 % of the gateway processes SIGKILLed at once (their load moves
to the others), and on the cluster a primary SIGKILLed (its replica promoted,
``cluster-node-timeout`` 1 s; the row counts the sessions running on its shard at the
kill). Recovery is the time from the fault to the first of two consecutive half-second
windows that are healthy again (no ``backend_unavailable``, refusals no higher than
before, starts held).

The bench's client processes share the machine's cores with Redis: on a small machine
they, not Redis, are usually what saturates first, which the Redis CPU share shows;
bench/redis_saturation.py measures Redis's own limit with a client in C.
Everything runs on 127.0.0.1, is bounded and stops by itself. Prints a markdown table
and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WINDOW_S = 0.5  # the reporting window
READY_BOUND_S = 120.0  # every bounded wait of the parent
REPLICAS = 4  # per pool


# -- Redis side -----------------------------------------------------------------------


class SingleRedis:
    """One redis-server on a free 127.0.0.1 port, no persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.workdir = tempfile.mkdtemp(prefix="headroom-fleet-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir, "--maxclients", "20000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            time.sleep(0.02)
        self.stop()
        raise SystemExit("redis-server did not start within 10 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def primaries(self) -> list[int]:
        return [self.port]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _info(port: int) -> tuple[float, int]:
    """(used CPU seconds, used memory bytes) of the node on ``port``; (nan, 0) when it
    does not answer."""
    import redis

    client = redis.Redis(port=port, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        cpu = client.info("cpu")
        mem = client.info("memory")
        return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), int(mem["used_memory"])
    except Exception:
        return float("nan"), 0
    finally:
        client.close()


def _redis_cpu(ports: list[int]) -> dict[int, float]:
    """Used CPU seconds per answering node."""
    out = {}
    for port in ports:
        cpu, _ = _info(port)
        if cpu == cpu:  # a dead node (nan) is left out
            out[port] = cpu
    return out


def _command_stats(ports: list[int]) -> dict[str, tuple[int, int]]:
    """``INFO commandstats`` summed over ``ports``: command -> (calls, microseconds inside
    the command); nodes that do not answer are left out."""
    import redis

    out: dict[str, tuple[int, int]] = {}
    for port in ports:
        client = redis.Redis(port=port, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            stats = client.info("commandstats")
        except Exception:
            continue
        finally:
            client.close()
        for key, value in stats.items():
            name = key.removeprefix("cmdstat_")
            calls, usec = out.get(name, (0, 0))
            out[name] = (calls + int(value["calls"]), usec + int(value["usec"]))
    return out


def _lease_data_bytes(ports: list[int], pools: list[str]) -> int:
    """``MEMORY USAGE`` summed over the pools' keys on the nodes that hold them: what the
    leases, queues and views take, without the clients' buffers."""
    import redis

    total = 0
    for port in ports:
        client = redis.Redis(port=port, socket_timeout=5.0, socket_connect_timeout=2.0)
        try:
            for pool in pools:
                for key in client.scan_iter(match=f"headroom:{{{pool}}}:*", count=1000):
                    total += int(client.memory_usage(key, samples=0) or 0)
        except Exception:
            continue
        finally:
            client.close()
    return total


def _seed(url: str, pools: list[str], ports: list[int], cluster: bool) -> None:
    """Mark each pool's data generation as long established (a brand-new Redis blocks
    grants for one TTL)."""
    import redis

    if cluster:
        from redis.cluster import ClusterNode, RedisCluster

        client: Any = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", ports[0])],
                                   socket_timeout=5.0, socket_connect_timeout=5.0)  # fmt: skip
    else:
        client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        for pool in pools:
            client.hset(f"headroom:{{{pool}}}:gen", mapping={"id": "seed", "since": 0})
    finally:
        client.close()


# -- one gateway process --------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _window() -> dict[str, Any]:
    return {"offered": 0, "dropped": 0, "admitted": 0, "queued": 0, "acquire": [], "release": [],
            "refused": Counter(), "lag": [], "misses": 0, "fences": 0, "fenced": 0, "over": 0,
            "samples": 0}  # fmt: skip


def _worker(cfg: dict[str, Any], w: int, counts: Any, alive: Any, go: Any, out: Any) -> None:
    # A gateway process: its own event loop, no state of the parent's but the shared
    # counts (os.fork keeps nothing running).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.disable(logging.CRITICAL)  # fences and refusals are counted, not logged
    asyncio.run(_worker_async(cfg, w, counts, alive, go, out))


async def _worker_async(
    cfg: dict[str, Any], w: int, counts: Any, alive: Any, go: Any, out: Any
) -> None:
    from proxy.admission import QueuePolicy, ReplicaSpec
    from proxy.admission.redis_backend import RedisAdmission
    from proxy.admission.shared_gate import SharedGate, SharedPoolSpec
    from proxy.clock import LoopClock
    from proxy.errors import Refused

    pools: list[str] = cfg["pools"]
    cap: int = cfg["cap"]
    procs: int = cfg["procs"]
    stride = len(pools) * REPLICAS
    replicas = tuple(ReplicaSpec(f"gpu{i}", cap) for i in range(REPLICAS))
    ttl, renew, margin = cfg["ttl_s"], cfg["renew_s"], cfg["margin_s"]
    hold_lo, hold_hi = cfg["hold_s"]
    gates: list[Any] = []
    running: dict[tuple[int, str], set[asyncio.Event]] = {}
    windows: dict[int, dict[str, Any]] = {}
    t0 = 0.0
    loop = asyncio.get_running_loop()

    def win() -> dict[str, Any]:
        i = int((time.time() - t0) // WINDOW_S) if t0 else -1
        if i not in windows:
            windows[i] = _window()
        return windows[i]

    def fenced(g: int, pool: str) -> None:
        w_ = win()
        w_["fences"] += 1
        for ended in running.get((g, pool), set()):
            w_["fenced"] += not ended.is_set()
            ended.set()

    for g in range(cfg["gates_per_proc"][w]):
        store = RedisAdmission(cfg["url"], gateway_id=f"p{w}g{g}", lease_ttl_s=ttl,
                               heartbeat_ttl_s=renew * 2.5, timeout_s=cfg["timeout_s"])  # fmt: skip
        gate = SharedGate(
            [SharedPoolSpec(p, replicas, QueuePolicy(cfg["queue"], 2.0), None,
                            (hold_lo + hold_hi) / 2, ()) for p in pools],
            backend=store, clock=LoopClock(), renew_interval_s=renew,
            fence_margin_s=margin, lease_ttl_s=ttl,
        )  # fmt: skip
        gate.on_fence(lambda pool, _why, g=g: fenced(g, pool))
        await gate.start()
        gates.append(gate)
    out.send(("ready", w, None))
    if not await asyncio.to_thread(go.wait, READY_BOUND_S):
        return  # the parent gave up on the start
    t0 = cfg["t0_cell"].value
    rng = random.Random(w)
    sessions: set[asyncio.Task[None]] = set()
    acquiring = 0

    async def session(g: int, pool: str) -> None:
        gate = gates[g]
        queued = False

        def on_position(_pos: int, _wait: float) -> None:
            nonlocal queued
            queued = True

        nonlocal acquiring
        start = time.perf_counter()
        acquiring += 1
        try:
            lease = await gate.acquire(pool, on_position=on_position)
        except Refused as exc:
            win()["refused"][exc.reason] += 1
            return
        finally:
            acquiring -= 1
        w_ = win()
        w_["acquire"].append(time.perf_counter() - start)
        w_["admitted"] += 1
        w_["queued"] += queued
        slot = w * stride + pools.index(pool) * REPLICAS + int(lease.replica[3:])
        counts[slot] += 1
        column = slot - w * stride
        if sum(counts[k * stride + column] for k in range(procs)) > cap:
            w_["over"] += 1
        w_["samples"] += 1
        ended = asyncio.Event()
        running.setdefault((g, pool), set()).add(ended)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), rng.uniform(hold_lo, hold_hi))
        finally:
            running[(g, pool)].discard(ended)
            counts[slot] -= 1
            before = set(gate.store.tasks)
            begun = time.perf_counter()
            lease.release()
            landing = set(gate.store.tasks) - before
            if landing:
                await asyncio.wait(landing, timeout=10.0)
                win()["release"].append(time.perf_counter() - begun)

    async def renewals() -> None:
        while True:
            w_ = win()
            for gate in gates:
                now = gate.store.clock.now()
                for p in gate.store.pools.values():
                    if p.last_renewed is None or not p.leases:
                        continue
                    late = max(0.0, now - p.last_renewed - renew)
                    w_["lag"].append(late)
                    w_["misses"] += late > renew
            await asyncio.sleep(0.25)

    async def report() -> None:
        while True:
            await asyncio.sleep(WINDOW_S)
            done = int((time.time() - t0) // WINDOW_S)
            for i in sorted(k for k in windows if k < done):
                out.send(("window", w, (i, _ship(windows.pop(i)))))

    side = [asyncio.ensure_future(renewals()), asyncio.ensure_future(report())]
    schedule: list[tuple[float, float, float]] = cfg["schedule"]
    end = max(e for _, e, _ in schedule)
    owed, n, tick = 0.0, 0, 0.005
    last = loop.time()
    while (now := time.time() - t0) < end:
        await asyncio.sleep(tick)
        rate = sum(r for s, e, r in schedule if s <= now < e)
        t = loop.time()
        owed += rate / max(1, alive.value) * (t - last)
        last = t
        while owed >= 1.0:
            owed -= 1.0
            win()["offered"] += 1
            if acquiring >= cfg["max_inflight"]:  # this process cannot keep up
                win()["dropped"] += 1
                continue
            task = asyncio.ensure_future(
                session(n % len(gates), pools[(n // len(gates)) % len(pools)])
            )
            n += 1
            sessions.add(task)
            task.add_done_callback(sessions.discard)
    # The load ends: sessions finish their holds (bounded), then the gates stop.
    if sessions:
        await asyncio.wait(set(sessions), timeout=hold_hi + 10.0)
    for task in list(sessions) + side:
        task.cancel()
    for gate in gates:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gate.stop(), 15.0)
    for i in sorted(windows):
        out.send(("window", w, (i, _ship(windows[i]))))
    out.send(("done", w, None))


def _ship(window: dict[str, Any]) -> dict[str, Any]:
    window = dict(window)
    window["refused"] = dict(window["refused"])
    return window


# -- the parent -----------------------------------------------------------------------


class Run:
    """One backend's run: gateway processes, the schedule, the faults, the samples."""

    def __init__(self, args: argparse.Namespace, backend: str, url: str, ports: list[int],
                 pools: list[str], phases: list[dict[str, Any]],
                 cluster: Any = None) -> None:  # fmt: skip
        self.args, self.backend, self.url, self.ports = args, backend, url, ports
        self.pools, self.phases, self.cluster = pools, phases, cluster
        peak = max(p["rate"] for p in phases if p["kind"] == "rate")
        mean_hold = sum(args.hold_s) / 2
        # Caps for 1.2x the sessions the peak rate keeps running.
        self.cap = max(2, round(1.2 * peak * mean_hold / (len(pools) * REPLICAS)))
        self.procs = args.procs
        per, extra = divmod(args.gateways, self.procs)
        self.gates_per_proc = [per + (1 if i < extra else 0) for i in range(self.procs)]
        ctx = mp.get_context("fork")
        self.ctx = ctx
        self.counts = ctx.Array("i", self.procs * len(pools) * REPLICAS, lock=False)
        self.alive = ctx.Value("i", self.procs, lock=False)
        self.t0_cell = ctx.Value("d", 0.0, lock=False)
        self.go = ctx.Event()
        #: worker -> the read end of its own pipe. One channel per process, not a shared
        #: queue: a process killed while writing to a shared multiprocessing.Queue keeps
        #: its write lock (and may leave half a message), so the survivors could no
        #: longer report; a killed process here breaks only its own pipe.
        self.reads: dict[int, multiprocessing.connection.Connection] = {}
        self.windows: dict[int, dict[str, Any]] = {}
        self.over_sampled: Counter[int] = Counter()
        self.samples_sampled: Counter[int] = Counter()
        #: name -> (time, Redis CPU s per node, lease data bytes, sessions running)
        self.marks: dict[str, tuple[float, dict[int, float], int, int]] = {}
        self.events: dict[str, float] = {}
        #: name -> ``INFO commandstats`` of the live primaries at that mark
        self.commands: dict[str, dict[str, tuple[int, int]]] = {}
        self._fault_thread: threading.Thread | None = None

    def schedule(self) -> list[tuple[float, float, float]]:
        out = []
        for p in self.phases:
            out.append((p["start"], p["end"], p["rate"]))
            if p.get("fault") == "burst":
                out.append((p["start"] + p["at"], p["start"] + p["at"] + p["burst_s"],
                            p["rate"] * 9))  # fmt: skip
        return out

    def execute(self) -> dict[str, Any]:
        cfg = {
            "url": self.url, "pools": self.pools, "cap": self.cap, "procs": self.procs,
            "gates_per_proc": self.gates_per_proc, "ttl_s": self.args.ttl_s,
            "renew_s": self.args.renew_s, "margin_s": self.args.margin_s,
            "hold_s": tuple(self.args.hold_s), "timeout_s": 1.0, "queue": 20,
            "schedule": self.schedule(), "t0_cell": self.t0_cell,
            "max_inflight": self.args.max_inflight,
        }  # fmt: skip
        workers = []
        for w in range(self.procs):
            read, write = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_worker,
                args=(cfg, w, self.counts, self.alive, self.go, write),
                daemon=True,
            )
            proc.start()
            write.close()  # the worker holds the only write end: its exit ends the pipe
            self.reads[w] = read
            workers.append(proc)
        try:
            return self._drive(workers)
        finally:
            for proc in workers:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)

    def _take(self, timeout: float) -> list[tuple[str, int, Any]]:
        """What the workers have sent, waiting up to ``timeout`` for the first message.
        A worker whose pipe ends before it said "done" has died: the run stops."""
        items: list[tuple[str, int, Any]] = []
        ready = multiprocessing.connection.wait(list(self.reads.values()), timeout)
        for w, read in list(self.reads.items()):
            while read in ready and read.poll():
                try:
                    item: tuple[str, int, Any] = read.recv()
                except (EOFError, OSError):
                    del self.reads[w]
                    raise SystemExit(f"{self.backend}: gateway process {w} ended before it "
                                     f"was done") from None  # fmt: skip
                items.append(item)
                if item[0] == "done":
                    del self.reads[w]
                    break
        return items

    def _absorb(self, item: tuple[str, int, Any]) -> str:
        kind, _w, body = item
        if kind == "window":
            i, window = body
            into = self.windows.setdefault(i, _window())
            for key, value in window.items():
                if key == "refused":
                    into["refused"].update(value)
                elif isinstance(value, list):
                    into[key].extend(value)
                else:
                    into[key] += value
        return kind

    def _mark(self, name: str) -> None:
        live = sum(self.counts[k] for k in range(len(self.counts)))
        ports = self._live_primaries()
        mem = _lease_data_bytes(ports, self.pools) if name.endswith(":end") else 0
        self.marks[name] = (time.time(), _redis_cpu(ports), mem, live)
        self.commands[name] = _command_stats(ports)

    def _live_primaries(self) -> list[int]:
        if self.cluster is None:
            return self.ports
        with contextlib.suppress(Exception):
            return self.cluster.primary_ports()
        return [n.port for n in self.cluster.nodes if n.alive]

    def _drive(self, workers: list[Any]) -> dict[str, Any]:
        ready, deadline = 0, time.monotonic() + READY_BOUND_S
        while ready < self.procs:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.backend}: {ready}/{self.procs} gateway processes "
                                 f"ready after {READY_BOUND_S:g} s")  # fmt: skip
            for item in self._take(1.0):
                if self._absorb(item) == "ready":
                    ready += 1
        self._mark("baseline")
        t0 = time.time() + 0.5
        self.t0_cell.value = t0
        self.go.set()
        pending = sorted(
            [(p["start"], "begin", p) for p in self.phases]
            + [(p["end"], "end", p) for p in self.phases]
            + [(p["start"] + p["at"], "fault", p) for p in self.phases if p.get("fault")],
            key=lambda x: (x[0], x[1] != "end"),
        )
        end = max(p["end"] for p in self.phases)
        dead: set[int] = set()
        done = 0
        hard_stop = time.monotonic() + end + sum(self.args.hold_s) + 60.0
        stride = len(self.pools) * REPLICAS
        while done < self.procs - len(dead):
            if time.monotonic() > hard_stop:
                raise SystemExit(f"{self.backend}: gateway processes not done in time")
            now = time.time() - t0
            while pending and pending[0][0] <= now:
                _, what, phase = pending.pop(0)
                if what == "fault":
                    self._fault(phase, workers, dead)
                    self.events[phase["name"]] = time.time() - t0
                else:
                    self._mark(f"{phase['name']}:{what}")
            # The engines' view: every 20 ms, the sum over the live processes.
            if 0 <= now < end:
                i = int(now // WINDOW_S)
                for column in range(stride):
                    total = sum(self.counts[k * stride + column] for k in range(self.procs))
                    self.samples_sampled[i] += 1
                    if total > self.cap:
                        self.over_sampled[i] += 1
            for item in self._take(0.02):
                if self._absorb(item) == "done":
                    done += 1
        if self._fault_thread is not None:
            self._fault_thread.join(timeout=30.0)
        return self._summarise(t0)

    def _fault(self, phase: dict[str, Any], workers: list[Any], dead: set[int]) -> None:
        fault = phase["fault"]
        if fault == "gateways":
            victims = list(range(self.procs))[-max(1, self.procs // 5) :]
            for w in victims:
                os.kill(workers[w].pid, signal.SIGKILL)
            stride = len(self.pools) * REPLICAS
            for w in victims:
                workers[w].join(timeout=10)
                dead.add(w)
                self.reads.pop(w).close()  # what it was writing when killed is dropped
                for k in range(stride):  # their streams end with them
                    self.counts[w * stride + k] = 0
            self.alive.value = self.procs - len(dead)
            phase["killed"] = (
                f"{len(victims)}/{self.procs} processes, "
                f"{sum(self.gates_per_proc[w] for w in victims)} gateways"
            )
        elif fault == "primary":  # in a thread: the sampling goes on meanwhile
            self._fault_thread = threading.Thread(target=self._kill_primary, args=(phase,))
            self._fault_thread.start()

    def _kill_primary(self, phase: dict[str, Any]) -> None:
        cluster = self.cluster
        from tests.redis_cluster_support import pool_slot

        slot = pool_slot(self.pools[0])
        primary = cluster.slot_owner(slot)
        stride = len(self.pools) * REPLICAS
        shard = [
            i for i, pool in enumerate(self.pools) if cluster.slot_owner(pool_slot(pool)) == primary
        ]
        phase["on_shard"] = sum(
            self.counts[w * stride + i * REPLICAS + r]
            for w in range(self.procs)
            for i in shard
            for r in range(REPLICAS)
        )
        began = time.monotonic()
        cluster.kill(primary)
        with contextlib.suppress(RuntimeError):
            cluster.wait_owner_change(slot, primary, timeout_s=20.0)
            phase["promoted_s"] = round(time.monotonic() - began, 2)
        phase["killed"] = f"primary :{primary}"

    def _summarise(self, t0: float) -> dict[str, Any]:
        rows = []
        for p in self.phases:
            warm = p["start"] + (p.get("warmup", 1.0) if p["kind"] == "rate" else 0.0)
            idx = [
                i for i in self.windows if warm <= i * WINDOW_S and (i + 1) * WINDOW_S <= p["end"]
            ]
            ws = [self.windows[i] for i in sorted(idx)]
            span = max(WINDOW_S, len(ws) * WINDOW_S)
            acq = [x for w in ws for x in w["acquire"]]
            rel = [x for w in ws for x in w["release"]]
            lag = [x for w in ws for x in w["lag"]]
            admitted = sum(w["admitted"] for w in ws)
            refused: Counter[str] = Counter()
            for w in ws:
                refused.update(w["refused"])
            b, e = self.marks.get(f"{p['name']}:begin"), self.marks.get(f"{p['name']}:end")
            # Nodes that answered at both marks (a killed primary's CPU is gone with it;
            # its promoted replica's counts from its promotion).
            cpu = (sum(e[1][n] - b[1][n] for n in e[1] if n in b[1])
                   if b and e else float("nan"))  # fmt: skip
            wall = (e[0] - b[0]) if b and e else float("nan")
            starts_all = sum(self.windows[i]["admitted"] for i in self.windows
                             if p["start"] <= i * WINDOW_S < p["end"])  # fmt: skip
            row: dict[str, Any] = {
                "backend": self.backend,
                "phase": p["name"],
                "target_per_s": p["rate"],
                "held_per_s": round(admitted / span, 1),
                "acquire_ms": [round(_pct(acq, q) * 1000, 2) for q in (0.5, 0.99, 0.999)],
                "release_ms": [round(_pct(rel, q) * 1000, 2) for q in (0.5, 0.99, 0.999)],
                "queued": sum(w["queued"] for w in ws),
                "renewal_lag_p99_ms": round(_pct(lag, 0.99) * 1000, 1),
                "renewal_misses": sum(w["misses"] for w in ws),
                "fences": sum(w["fences"] for w in ws),
                "fenced_sessions": sum(w["fenced"] for w in ws),
                "refused": dict(refused),
                "over_cap": sum(w["over"] for w in ws) + sum(self.over_sampled[i] for i in idx),
                "samples": sum(w["samples"] for w in ws)
                + sum(self.samples_sampled[i] for i in idx),
                "redis_cpu_pct": round(100 * cpu / wall, 1) if wall == wall else None,
                "redis_cpu_s": cpu,
                "redis_cpu_pct_busiest_node": (
                    round(
                        100 * max((e[1][n] - b[1][n] for n in e[1] if n in b[1]), default=0) / wall,
                        1,
                    )
                    if b and e
                    else None
                ),
                "wall_s": wall,
                "starts": starts_all,
                "dropped": sum(w["dropped"] for w in ws),
                "redis_cpu_ms_per_1k_starts": (
                    round(1e6 * cpu / starts_all, 1) if starts_all and cpu == cpu else None
                ),
            }
            if e is not None and p["kind"] == "rate" and e[3] >= 100:
                row["mem_per_10k_leases_kb"] = round(e[2] / e[3] * 10000 / 1024, 1)
                row["leases_at_end"] = e[3]
            if starts_all:
                row["commands_per_start"] = self._commands_per(p, starts_all)
            elif wall == wall:
                row["commands_per_s"] = self._commands_per(p, wall)
            if p.get("fault"):
                row.update({k: p[k] for k in ("killed", "promoted_s", "on_shard") if k in p})
                row["recovery_s"] = self._recovery(p)
                row["timeline"] = self._timeline(p)
            rows.append(row)
        # Redis CPU per 1k starts net of what the fleet costs idle (renewals, wake-up
        # loops, heartbeats): the idle phase's CPU rate times the phase's length.
        idle = next((r for r in rows if r["phase"].startswith("idle")), None)
        if idle is not None and idle["wall_s"] == idle["wall_s"] and idle["wall_s"] > 0:
            per_s = idle["redis_cpu_s"] / idle["wall_s"]
            for r in rows:
                if r is not idle and r["starts"] and r["redis_cpu_s"] == r["redis_cpu_s"]:
                    net = r["redis_cpu_s"] - per_s * r["wall_s"]
                    r["redis_cpu_ms_per_1k_starts_net"] = round(1e6 * net / r["starts"], 1)
        return {"backend": self.backend, "cap_per_replica": self.cap, "rows": rows}

    def _commands_per(self, phase: dict[str, Any], per: float) -> dict[str, Any]:
        """Per session start of the phase (``per`` its starts), or per second of a phase
        without starts (``per`` its length): the calls of each command and the Redis CPU
        spent inside them (``INFO commandstats``: calls, us). ``evalsha``'s time includes
        the commands its scripts call, which are counted under their own names too; the
        phase's Redis CPU per start less the time in the commands the gateways send
        (``evalsha``, ``blpop``, ``lpop``) is what the server spends around the calls
        (sockets, its event loop, background work). Empty when a primary was killed in
        the phase (its counts are gone with it)."""
        name = phase["name"]
        b, e = self.commands.get(f"{name}:begin"), self.commands.get(f"{name}:end")
        if not b or not e or phase.get("fault") == "primary":
            return {}
        out: dict[str, Any] = {}
        for command, (calls, usec) in sorted(e.items()):
            calls0, usec0 = b.get(command, (0, 0))
            if calls > calls0:
                out[command] = [
                    round((calls - calls0) / per, 2),
                    round((usec - usec0) / per, 1),
                ]
        return out

    def _timeline(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        """The fault phase window by window, from the fault on: seconds after it, starts
        offered and admitted, refusals, fences and the sessions they ended, renewal lag
        p99."""
        at = p["start"] + p["at"]
        out = []
        for i in sorted(self.windows):
            if not at - 1.0 <= i * WINDOW_S < p["end"]:
                continue
            w = self.windows[i]
            out.append({
                "t_s": round(i * WINDOW_S - at, 1), "offered": w["offered"],
                "admitted": w["admitted"], "refused": sum(w["refused"].values()),
                "fences": w["fences"], "fenced": w["fenced"],
                "lag_p99_ms": round(_pct(w["lag"], 0.99) * 1000) if w["lag"] else None,
            })  # fmt: skip
        return out

    def _recovery(self, p: dict[str, Any]) -> float | None:
        """Seconds from the fault (the burst's end for a burst) to the first of two
        healthy windows in a row."""
        at = p["start"] + p["at"] + (p.get("burst_s", 0.0) if p["fault"] == "burst" else 0.0)
        before = [self.windows[i] for i in self.windows
                  if p["start"] + 0.5 <= i * WINDOW_S < p["start"] + p["at"]]  # fmt: skip
        offered = sum(w["offered"] for w in before) or 1
        base_refused = sum(sum(w["refused"].values()) for w in before) / offered

        def healthy(i: int) -> bool:
            w = self.windows.get(i)
            if w is None or w["offered"] == 0:
                return False
            refused = sum(w["refused"].values()) / w["offered"]
            return (not w["refused"].get("backend_unavailable")
                    and refused <= base_refused + 0.02
                    and w["admitted"] >= 0.8 * w["offered"] * (1 - base_refused))  # fmt: skip

        first = int(at // WINDOW_S)
        last = int(p["end"] // WINDOW_S)
        for i in range(first, last):
            if healthy(i) and healthy(i + 1):
                return round(max(0.0, i * WINDOW_S - at), 2)
        return None


def _phases(args: argparse.Namespace, cluster: bool) -> list[dict[str, Any]]:
    phases: list[dict[str, Any]] = [
        {"name": "idle (renewals, wake-up loops)", "kind": "idle", "rate": 0.0, "start": 0.0,
         "end": args.idle_s}
    ]  # fmt: skip
    t = args.idle_s
    for rate in args.rates:
        phases.append({"name": f"{rate:g}/s", "kind": "rate", "rate": rate, "start": t,
                       "end": t + args.phase_s})  # fmt: skip
        t += args.phase_s
    # No starts for one longest hold: the faults begin from a settled fleet, not from
    # the backlog of a rate it could not hold.
    t += args.hold_s[1]
    fault_s = args.fault_s
    base = args.fault_rate
    if cluster and "primary" in args.faults:
        phases.append({"name": "primary killed", "kind": "fault", "fault": "primary",
                       "rate": base, "start": t, "end": t + fault_s, "at": 2.0})  # fmt: skip
        t += fault_s
    if "gateways" in args.faults:
        phases.append({"name": "20% gateways killed", "kind": "fault", "fault": "gateways",
                       "rate": base, "start": t, "end": t + fault_s, "at": 2.0})  # fmt: skip
        t += fault_s
    if "burst" in args.faults:
        phases.append({"name": "10x burst", "kind": "fault", "fault": "burst", "rate": base,
                       "start": t, "end": t + fault_s, "at": 2.0, "burst_s": 1.5})  # fmt: skip
    return phases


def run_backend(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    n_pools = args.pools
    if kind == "single":
        redis_ = SingleRedis()
        try:
            pools = [f"pool-{i}" for i in range(n_pools)]
            _seed(redis_.url, pools, [redis_.port], cluster=False)
            run = Run(args, "1 primary", redis_.url, [redis_.port], pools, _phases(args, False))
            return run.execute()
        finally:
            redis_.stop()
    from tests.redis_cluster_support import LocalCluster, pools_on_primaries

    made = LocalCluster(primaries=3, replicas=1, node_timeout_ms=1000)
    try:
        pools = pools_on_primaries(made, n_pools)
        _seed(made.url, pools, made.primary_ports(), cluster=True)
        run = Run(args, "3 primaries", made.url, made.primary_ports(), pools,
                  _phases(args, True), cluster=made)  # fmt: skip
        return run.execute()
    finally:
        made.stop()


def _fmt(values: list[float]) -> str:
    return " / ".join("-" if v != v else f"{v:.1f}" for v in values)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| backend | phase | target starts/s | held/s | acquire p50/p99/p99.9 ms | "
            "release p50/p99/p99.9 ms | renewal lag p99 ms / misses | fences (sessions) | "
            "refused | over cap / samples | dropped | Redis CPU % | Redis CPU ms / 1k starts "
            "(net of idle) | lease data / 10k leases | recovery |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for result in results:
        for r in result["rows"]:
            fault = ""
            if "recovery_s" in r:
                rec = r["recovery_s"]
                fault = "not within the phase" if rec is None else f"{rec:g} s"
                if "promoted_s" in r:
                    fault += f" (promoted {r['promoted_s']:g} s)"
                if "killed" in r:
                    fault += f"; {r['killed']}"
                if "on_shard" in r:
                    fault += f", {r['on_shard']} sessions on its shard"
            mem = r.get("mem_per_10k_leases_kb")
            lines.append(
                f"| {r['backend']} | {r['phase']} | {r['target_per_s']:g} | {r['held_per_s']:g} | "
                f"{_fmt(r['acquire_ms'])} | {_fmt(r['release_ms'])} | "
                f"{_fmt([r['renewal_lag_p99_ms']])} / {r['renewal_misses']} | {r['fences']} "
                f"({r['fenced_sessions']}) | "
                f"{sum(r['refused'].values())} {r['refused'] or ''} | "
                f"{r['over_cap']} / {r['samples']} | {r['dropped']} | {r['redis_cpu_pct']} | "
                f"{r['redis_cpu_ms_per_1k_starts']} "
                f"({r.get('redis_cpu_ms_per_1k_starts_net', '-')}) | "
                f"{'-' if mem is None else f'{mem:g} KB'} | {fault or '-'} |"
            )
    return "\n".join(lines)


def saturation(result: dict[str, Any], p99_limit_ms: float) -> dict[str, Any]:
    """The highest rate held (90 % of the target, acquire p99 under the limit) and the
    first that was not."""
    held, broke, limit = None, None, None
    for r in result["rows"]:
        if r["phase"].endswith("/s"):
            ok = r["held_per_s"] >= 0.9 * r["target_per_s"] and r["acquire_ms"][1] <= p99_limit_ms
            if ok and broke is None:
                held = r["target_per_s"]
            elif not ok and broke is None:
                broke = r["target_per_s"]
                busiest = r["redis_cpu_pct_busiest_node"] or 0.0
                limit = (f"a Redis primary ({busiest:g} % of a core)" if busiest >= 80 else
                         f"the bench's gateway processes (busiest Redis node {busiest:g} % "
                         "of a core)")  # fmt: skip
    return {"backend": result["backend"], "held_per_s": held, "saturated_at_per_s": broke,
            "limited_by": limit}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute in all")
    parser.add_argument("--gateways", type=int, default=120)
    parser.add_argument("--procs", type=int, default=5)
    parser.add_argument("--pools", type=int, default=6)
    parser.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 2000, 3300])
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--fault-s", type=float, default=30.0)
    parser.add_argument("--fault-rate", type=float, default=500.0)
    parser.add_argument("--hold-s", type=float, nargs=2, default=[10.0, 40.0])
    parser.add_argument("--ttl-s", type=float, default=10.0)
    parser.add_argument("--renew-s", type=float, default=1.0)
    parser.add_argument("--margin-s", type=float, default=1.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=300,
        help="acquires in flight per process; arrivals past it are dropped",
    )
    parser.add_argument("--p99-limit-ms", type=float, default=100.0)
    parser.add_argument("--backends", nargs="+", default=["single", "cluster"],
                        choices=["single", "cluster"])  # fmt: skip
    parser.add_argument("--faults", nargs="*", default=["primary", "gateways", "burst"],
                        choices=["primary", "gateways", "burst"],
                        help="the fault phases to run (primary: the cluster only)")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rates, args.phase_s, args.fault_s, args.fault_rate = [300, 1000, 2000], 4.0, 8.0, 300
        args.hold_s, args.ttl_s, args.idle_s = [1.0, 3.0], 6.0, 3.0
    started = time.time()
    load_before = os.getloadavg()
    results = [run_backend(args, kind) for kind in args.backends]
    load_after = os.getloadavg()
    sat = [saturation(r, args.p99_limit_ms) for r in results]
    print(table(results))
    print()
    for s in sat:
        print(f"{s['backend']}: held up to {s['held_per_s']} starts/s; "
              f"first rate not held: {s['saturated_at_per_s']}, "
              f"limited by {s['limited_by']}")  # fmt: skip
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"{os.cpu_count()} cores shared by Redis and the bench's gateway processes; "
          f"{time.time() - started:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results, "saturation": sat,
            "load_average": {"before": load_before, "after": load_after},
            "cores": os.cpu_count(),
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
