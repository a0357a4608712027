"""Redis's own saturation point for the admission scripts, driven by redis-benchmark.

    python bench/redis_saturation.py --quick [--json out.json]   # about a minute
    python bench/redis_saturation.py [--backends single cluster]  # a few minutes

bench/fleet.py drives real gateways from Python processes, which on a small machine run
out of CPU long before Redis does. Here the session starts come from ``redis-benchmark``
(C, far cheaper per call than a Python client) replaying the exact calls a gateway
sends, so Redis saturates first:

* The calls are recorded, not rebuilt: one :class:`RedisAdmission` (the gateway's Redis
  client) acquires and releases one lease while a ``MONITOR`` connection on the pool's
  node records the ``EVALSHA`` of each (the script's SHA, its keys, the scheduling
  context, the tenant fields, the replica view with a cap no run reaches). The lease id
  becomes ``redis-benchmark``'s ``__rand_int__`` placeholders, so every replayed acquire
  takes a new slot.
* Per step, one ``redis-benchmark`` replays the acquire and one the release on each
  pool, each with ``-c`` connections, ``-n`` calls each (the same count: one start is
  one acquire and one release). A replayed release names a random id, so it finds no
  lease and runs the rest of release.lua (the purge, the generation, the hand-out); the
  acquired leases lapse after ``--hold-s`` and the next script's purge drops them (the
  same hash and sorted-set removals a release makes). The pool then holds about starts/s
  x ``--hold-s`` leases, as a fleet whose sessions last that long. ``--hold-s`` is kept
  well under a step's length (``--step-s``) so that most of a step runs with as many
  leases lapsing as starting; the leases held at each step's end are reported.
* Meanwhile the fleet's renewals run at their own rate: ``--gateways`` gateways each
  renew every pool every ``--renew-s`` (``RedisAdmission.tick``, renew.lua), together
  keeping ``--sessions`` seeded leases per pool alive. A phase with renewals only comes
  first; its CPU rate is what the steps' "net" figures take away.
* The client counts rise (``--clients``) until the busiest primary's main thread uses
  ``--saturated-pct`` of a core and starts/s rises less than 5 % over the best step so
  far, or starts/s has not risen for two steps, or the list ends. Redis CPU is
  ``INFO cpu`` (sys + user, all threads, and the main thread's), per primary.

Against one redis-server, then a Redis Cluster of three primaries (no replicas) with
one pool on each primary, each primary driven by its own ``redis-benchmark`` pair
directly (every call's keys are in that primary's slots). On a machine with fewer
than four cores the three primaries and the clients share the cores, so the cluster's
aggregate shows the cost per start on each shard, not three times one primary's rate.

Everything runs on 127.0.0.1, is bounded (an unreported 200-call probe sizes the first
step, each step after is sized from the one before, and a step that overruns is
stopped) and stops by itself. Prints a
markdown table and writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPLICAS = 4  # per pool, each with a cap no run reaches
BIG_CAP = 10_000_000
CAPTURE_ID = "capture:1"
#: A placeholder redis-benchmark replaces with 12 random digits, twice in one id.
RAND_ID = "bench:__rand_int____rand_int__"
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')


# -- recording the calls a gateway makes ----------------------------------------------


def _unescape(arg: str) -> str:
    """One argument of a ``MONITOR`` line as sent (Redis escapes quotes, backslashes and
    unprintable bytes)."""
    return arg.encode("latin-1").decode("unicode_escape")


class _Monitor:
    """A raw ``MONITOR`` connection to one node: every command the node runs, as a list
    of arguments, in order."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        self.sock.sendall(b"MONITOR\r\n")
        self.buf = b""
        if self._line() != "+OK":
            raise RuntimeError("MONITOR was refused")

    def _line(self) -> str:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the MONITOR connection closed")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line.decode("latin-1")

    def evalsha_with(self, lease_id: str, count: int) -> list[list[str]]:
        """The first ``count`` ``EVALSHA`` calls whose first argument after the keys is
        ``lease_id``."""
        found: list[list[str]] = []
        while len(found) < count:
            line = self._line()
            if "[" not in line or "lua]" in line:  # a script's own commands
                continue
            args = [_unescape(a) for a in _ARG.findall(line.partition("]")[2])]
            if not args or args[0].upper() != "EVALSHA":
                continue
            numkeys = int(args[2])
            if args[3 + numkeys] == lease_id:
                found.append(args[1:])
        return found

    def close(self) -> None:
        self.sock.close()


def record_calls(url: str, port: int, pool: str, hold_s: float) -> dict[str, list[str]]:
    """The ``EVALSHA`` arguments (SHA, numkeys, keys, args) of one acquire and one
    release of ``pool`` as :class:`RedisAdmission` sends them, with the lease id replaced
    by :data:`RAND_ID`. ``port`` is the node that holds the pool."""
    from proxy.admission.redis_backend import RedisAdmission, ReplicaView

    view = [ReplicaView(f"gpu{i}", BIG_CAP) for i in range(REPLICAS)]

    async def calls(lease_id: str) -> None:
        store = RedisAdmission(url, gateway_id="capture", lease_ttl_s=hold_s, timeout_s=5.0)
        store.configure_pool(pool, session_estimate_s=hold_s)
        try:
            kind, value = await store.acquire(pool, lease_id, view, max_depth=100)
            if kind != "admit":
                raise RuntimeError(f"the recorded acquire was not admitted: {kind} {value}")
            if not await store.release(pool, lease_id, view):
                raise RuntimeError("the recorded release found no lease")
        finally:
            await store.close()

    asyncio.run(calls("capture:0"))  # loads the scripts (a first EVALSHA may miss)
    monitor = _Monitor(port)
    try:
        asyncio.run(calls(CAPTURE_ID))
        acquire, release = monitor.evalsha_with(CAPTURE_ID, 2)
    finally:
        monitor.close()
    if acquire[0] == release[0]:
        raise RuntimeError("the recorded acquire and release ran the same script")
    out = {}
    for name, call in (("acquire", acquire), ("release", release)):
        numkeys = int(call[1])
        call = list(call)
        call[2 + numkeys] = RAND_ID
        out[name] = call
    return out


# -- the Redis side -------------------------------------------------------------------


def _node_info(port: int) -> dict[str, Any]:
    """CPU seconds of the node (all threads, and its main thread), its ``EVALSHA`` calls
    so far and those that failed or were rejected, the seconds spent inside ``EVALSHA``
    (the scripts, with the commands they call), and ``INFO commandstats`` (command ->
    calls, microseconds; a command a script calls is counted under its own name too)."""
    import redis

    client = redis.Redis(port=port, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        cpu = client.info("cpu")
        commands = client.info("commandstats")
        stats = commands.get("cmdstat_evalsha", {})
    finally:
        client.close()
    main = float(cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"]))
    main += float(cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"]))
    return {
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "main_s": main,
        "evalsha": float(stats.get("calls", 0)),
        "errors": float(stats.get("failed_calls", 0)) + float(stats.get("rejected_calls", 0)),
        "scripts_s": float(stats.get("usec", 0)) / 1e6,
        "commands": {
            name.removeprefix("cmdstat_"): (int(c.get("calls", 0)), int(c.get("usec", 0)))
            for name, c in commands.items()
        },
    }


def _commands_per_start(
    before: dict[str, Any], after: dict[str, Any], ports: list[int], starts: int
) -> dict[str, list[float]]:
    """Command -> [calls, microseconds inside it] per start, summed over ``ports``."""
    out: dict[str, list[float]] = {}
    for port in ports:
        b, a = before["nodes"][port]["commands"], after["nodes"][port]["commands"]
        for name, (calls, usec) in a.items():
            calls0, usec0 = b.get(name, (0, 0))
            if calls > calls0:
                total = out.setdefault(name, [0.0, 0.0])
                total[0] += (calls - calls0) / starts
                total[1] += (usec - usec0) / starts
    return {name: [round(c, 2), round(u, 1)] for name, (c, u) in sorted(out.items())}


def _leases(port: int, recorded: dict[str, list[str]]) -> int:
    """The leases the pool of a recorded acquire holds now (its first key)."""
    import redis

    client = redis.Redis(port=port, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        return int(client.zcard(recorded["acquire"][2]))
    finally:
        client.close()


def _snapshot(ports: list[int]) -> dict[str, Any]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "t": time.monotonic(),
        "nodes": {p: _node_info(p) for p in ports},
        "children_cpu_s": children.ru_utime + children.ru_stime,
    }


# -- the fleet's renewals -------------------------------------------------------------


class Renewals:
    """``gateways`` gateways, each renewing every pool once per ``renew_s`` through
    :meth:`RedisAdmission.tick` (renew.lua), the calls spread evenly over the interval;
    together they keep ``sessions`` leases per pool alive, seeded by real acquires. Runs
    in a thread of its own with its own event loop until :meth:`stop`."""

    def __init__(self, url: str, pools: list[str], gateways: int, sessions: int,
                 renew_s: float, ttl_s: float) -> None:  # fmt: skip
        self.url, self.pools, self.gateways = url, pools, gateways
        self.sessions, self.renew_s, self.ttl_s = sessions, renew_s, ttl_s
        self.calls = 0
        self.touches = 0
        self.late = 0  # renewals that came more than one interval late
        self.lost = 0  # leases a renewal no longer found
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self, timeout_s: float = 300.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the renewals' leases were not seeded within {timeout_s:g} s")
        if self.errors:
            raise RuntimeError(f"seeding the renewals' leases failed: {self.errors[0]}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)

    async def _main(self) -> None:
        from proxy.admission.redis_backend import RedisAdmission, ReplicaView

        view = [ReplicaView(f"gpu{i}", BIG_CAP) for i in range(REPLICAS)]
        stores = [RedisAdmission(self.url, gateway_id=f"g{g}", lease_ttl_s=self.ttl_s,
                                 timeout_s=5.0) for g in range(self.gateways)]  # fmt: skip
        held: dict[tuple[int, str], list[tuple[str, str]]] = {}
        try:
            try:

                async def seed(g: int, store: Any, pool: str) -> None:
                    ids = [f"g{g}:{n}" for n in range(g, self.sessions, self.gateways)]
                    for i in range(0, len(ids), 8):  # within a client's connection pool
                        batch = ids[i : i + 8]
                        got = await asyncio.gather(
                            *(store.acquire(pool, x, view, 100) for x in batch)
                        )
                        for x, (kind, replica) in zip(batch, got, strict=True):
                            if kind != "admit":
                                raise RuntimeError(f"seed lease {x}: {kind} {replica}")
                            held.setdefault((g, pool), []).append((x, str(replica)))

                for pool in self.pools:
                    await asyncio.gather(*(seed(g, st, pool) for g, st in enumerate(stores)))
            except Exception as exc:  # reported by start()
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            finally:
                self._ready.set()
            await self._renew(stores, view, held)
        finally:
            for store in stores:
                with contextlib.suppress(Exception):
                    await store.close()

    async def _renew(self, stores: list[Any], view: list[Any],
                     held: dict[tuple[int, str], list[tuple[str, str]]]) -> None:  # fmt: skip
        """One loop per gateway and pool, as a gateway renews: every ``renew_s``, the
        first calls spread evenly over one interval."""
        slots = [(g, pool) for pool in self.pools for g in range(len(stores))]
        begin = time.monotonic()

        async def loop(k: int, g: int, pool: str) -> None:
            due = begin + k * self.renew_s / len(slots)
            generation = ""
            leases = held.get((g, pool), [])
            while not self._stop.is_set():
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                elif now - due > self.renew_s:
                    self.late += 1
                    due = now
                due += self.renew_s
                try:
                    got = await stores[g].tick(pool, generation=generation, view=view,
                                               leases=leases, waiters=(), guards=(),
                                               guard_ttl_s=self.ttl_s)  # fmt: skip
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                generation = got.generation
                self.calls += 1
                self.touches += len(leases)
                self.lost += len(got.lost)

        await asyncio.gather(*(loop(k, g, pool) for k, (g, pool) in enumerate(slots)))


# -- one step of redis-benchmark ------------------------------------------------------


def _benchmark(port: int, clients: int, calls: int, command: list[str]) -> list[str]:
    return ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", str(clients),
            "-n", str(calls), "-r", "2147483647", "--csv", "--precision", "3",
            *command]  # fmt: skip


def _parse_csv(text: str) -> dict[str, float]:
    rows = list(csv.DictReader(io.StringIO(text)))
    if len(rows) != 1:
        raise RuntimeError(f"redis-benchmark printed {len(rows)} result rows: {text[-500:]!r}")
    row = rows[0]
    return {k: float(row[k]) for k in ("rps", "p50_latency_ms", "p99_latency_ms",
                                       "max_latency_ms")}  # fmt: skip


def run_step(targets: list[tuple[int, dict[str, list[str]]]], clients: int, calls: int,
             timeout_s: float, background_s: dict[int, float]) -> dict[str, Any]:  # fmt: skip
    """One acquire and one release ``redis-benchmark`` per (primary port, recorded calls)
    at once; the Redis CPU and the starts over the time until all have finished."""
    ports = [p for p, _ in targets]
    before = _snapshot(ports)
    procs = []
    for port, recorded in targets:
        for name in ("acquire", "release"):
            cmd = _benchmark(port, clients, calls, ["EVALSHA", *recorded[name]])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)  # fmt: skip
            procs.append((port, name, proc))
    deadline = time.monotonic() + timeout_s
    outputs: dict[tuple[int, str], dict[str, float]] = {}
    failed = []
    for port, name, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed.append(f"{name} on :{port} ran past {timeout_s:g} s")
            continue
        if proc.returncode != 0 or "ERR" in err or "NOSCRIPT" in out:
            failed.append(f"{name} on :{port}: exit {proc.returncode} {err[-300:]!r}")
            continue
        outputs[(port, name)] = _parse_csv(out)
    after = _snapshot(ports)
    held = {port: _leases(port, recorded) for port, recorded in targets}
    for port in ports:  # a replayed call the server refused (redis-benchmark counts it too)
        errors = after["nodes"][port]["errors"] - before["nodes"][port]["errors"]
        if errors:
            failed.append(f":{port} answered {errors:g} EVALSHA calls with an error")
    if failed:
        raise RuntimeError("; ".join(failed))
    wall = after["t"] - before["t"]
    starts = calls * len(targets)
    per_node = {}
    for port in ports:
        b, a = before["nodes"][port], after["nodes"][port]
        per_node[port] = {
            "cpu_pct": round(100 * (a["cpu_s"] - b["cpu_s"]) / wall, 1),
            "main_pct": round(100 * (a["main_s"] - b["main_s"]) / wall, 1),
            "cpu_s": a["cpu_s"] - b["cpu_s"],
            "evalsha_calls": int(a["evalsha"] - b["evalsha"]),
            "scripts_s": a["scripts_s"] - b["scripts_s"],
            "leases_at_end": held[port],
        }
    cpu = sum(n["cpu_s"] for n in per_node.values())
    net = cpu - sum(background_s.get(p, 0.0) for p in ports) * wall

    def pct(name: str, q: str) -> float:
        return max(outputs[(p, name)][f"{q}_latency_ms"] for p in ports)

    return {
        "clients_per_benchmark": clients,
        "connections": clients * 2 * len(targets),
        "calls_per_benchmark": calls,
        "wall_s": round(wall, 3),
        "starts_per_s": round(starts / wall, 1),
        "acquire_rps": round(sum(outputs[(p, "acquire")]["rps"] for p in ports), 1),
        "release_rps": round(sum(outputs[(p, "release")]["rps"] for p in ports), 1),
        # The worst primary's percentile (each redis-benchmark reports its own).
        "acquire_ms": [pct("acquire", "p50"), pct("acquire", "p99")],
        "release_ms": [pct("release", "p50"), pct("release", "p99")],
        "redis_cpu_pct": round(100 * cpu / wall, 1),
        "busiest_main_pct": max(n["main_pct"] for n in per_node.values()),
        "per_primary": {str(p): n for p, n in per_node.items()},
        "redis_cpu_us_per_start": round(1e6 * cpu / starts, 1),
        "redis_cpu_us_per_start_net": round(1e6 * net / starts, 1),
        # Inside the scripts (the renewals' included); the rest of the CPU is the
        # server's own work around the calls (sockets, its event loop).
        "scripts_us_per_start": round(
            1e6 * sum(n["scripts_s"] for n in per_node.values()) / starts, 1
        ),
        "commands_per_start": _commands_per_start(before, after, ports, starts),
        "benchmark_cpu_pct": round(
            100 * (after["children_cpu_s"] - before["children_cpu_s"]) / wall, 1
        ),
    }


# -- one backend ----------------------------------------------------------------------


def _renewal_phase(ports: list[int], renewals: Renewals, seconds: float) -> dict[str, Any]:
    before = _snapshot(ports)
    calls0, touches0 = renewals.calls, renewals.touches
    time.sleep(seconds)
    after = _snapshot(ports)
    wall = after["t"] - before["t"]
    calls, touches = renewals.calls - calls0, renewals.touches - touches0
    cpu = {p: after["nodes"][p]["cpu_s"] - before["nodes"][p]["cpu_s"] for p in ports}
    total = sum(cpu.values())
    inside = sum(after["nodes"][p]["scripts_s"] - before["nodes"][p]["scripts_s"]
                 for p in ports)  # fmt: skip
    return {
        "wall_s": round(wall, 3),
        "renew_calls_per_s": round(calls / wall, 1),
        "lease_touches_per_s": round(touches / wall, 1),
        "redis_cpu_pct": round(100 * total / wall, 1),
        "redis_cpu_us_per_renew_call": round(1e6 * total / calls, 1) if calls else None,
        "scripts_pct": round(100 * inside / wall, 1),
        "cpu_rate_per_primary": {p: c / wall for p, c in cpu.items()},
    }


def drive(args: argparse.Namespace, backend: str, url: str, targets: list[tuple[int, str]],
          cluster: bool) -> dict[str, Any]:  # fmt: skip
    """Seed, record, run the renewals alone, then the rising steps, on ``targets``
    ((primary port, pool) pairs)."""
    from bench.fleet import _seed

    ports = [p for p, _ in targets]
    pools = [pool for _, pool in targets]
    _seed(url, pools, ports, cluster=cluster)
    recorded = [(port, record_calls(url, port, pool, args.hold_s)) for port, pool in targets]
    renewals = Renewals(url, pools, args.gateways, args.sessions, args.renew_s, args.ttl_s)
    renewals.start()
    try:
        idle = _renewal_phase(ports, renewals, args.idle_s)
        background = idle.pop("cpu_rate_per_primary")
        steps: list[dict[str, Any]] = []
        # A probe (not reported) at the first client count sizes the first step; each
        # step after is sized from the one before, for a rate up to 1.5x higher.
        probe = run_step(recorded, args.clients[0], 200, args.step_s * 8 + 30, background)
        rate = probe["starts_per_s"] / len(targets)  # starts/s per pool of the last step
        growth = 1.0
        best = 0.0
        flat = 0  # steps in a row that gained under 5 % over the best before them
        stopped_by = "the client counts ran out"
        for clients in args.clients:
            per_pool = max(200, clients * 20, int(rate * growth * args.step_s))
            growth = 1.5
            calls0 = renewals.calls
            step = run_step(recorded, clients, per_pool, args.step_s * 8 + 30, background)
            step["renewal_errors"] = len(renewals.errors)
            step["renew_calls_per_s"] = round((renewals.calls - calls0) / step["wall_s"], 1)
            steps.append(step)
            rate = step["starts_per_s"] / len(targets)
            gain = step["starts_per_s"] / best if best else float("inf")
            best = max(best, step["starts_per_s"])
            flat = flat + 1 if gain < 1.05 else 0
            if step["busiest_main_pct"] >= args.saturated_pct and flat:
                stopped_by = (f"a primary's main thread at {step['busiest_main_pct']:g} % of a "
                              "core and starts/s no longer rising")  # fmt: skip
                break
            if flat >= 2:
                stopped_by = "starts/s not rising for two steps (the cores are shared)"
                break
    finally:
        renewals.stop()
    peak = max(steps, key=lambda s: s["starts_per_s"])
    return {
        "backend": backend,
        "primaries": len(targets),
        "pools": pools,
        "renewals": {
            **idle,
            "gateways": args.gateways,
            "sessions_per_pool": args.sessions,
            "renew_s": args.renew_s,
            "late": renewals.late,
            "lost": renewals.lost,
            "errors": renewals.errors[:5],
        },
        "scripts": {name: calls[0] for name, calls in recorded[0][1].items()},
        "steps": steps,
        "stopped_by": stopped_by,
        "peak": {
            k: peak[k]
            for k in (
                "clients_per_benchmark",
                "starts_per_s",
                "acquire_ms",
                "release_ms",
                "redis_cpu_pct",
                "busiest_main_pct",
                "redis_cpu_us_per_start_net",
            )
        },
        "starts_per_s_per_core": round(100 * peak["starts_per_s"] / peak["redis_cpu_pct"], 1)
        if peak["redis_cpu_pct"]
        else None,
    }


def run_backend(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    if kind == "single":
        from bench.fleet import SingleRedis

        node = SingleRedis()
        try:
            return drive(args, "1 primary", node.url, [(node.port, "pool-0")], cluster=False)
        finally:
            node.stop()
    from tests.redis_cluster_support import LocalCluster, pools_on_primaries

    made = LocalCluster(primaries=3, replicas=0, node_timeout_ms=5000)
    try:
        pools = pools_on_primaries(made, 3)
        from tests.redis_cluster_support import pool_slot

        targets = [(made.slot_owner(pool_slot(pool)), pool) for pool in pools]
        return drive(args, "3 primaries", made.url, targets, cluster=True)
    finally:
        made.stop()


# -- report ---------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| backend | clients per redis-benchmark (connections) | starts/s | acquire p50 / "
            "p99 ms | release p50 / p99 ms | Redis CPU % of a core (per primary) | busiest "
            "main thread % | Redis CPU us / start (net of renewals) | redis-benchmark CPU % "
            "| leases held at the end | renewal calls/s |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        rn = r["renewals"]
        lines.append(
            f"| {r['backend']} | renewals only: {rn['gateways']} gateways x "
            f"{len(r['pools'])} pool(s) every {rn['renew_s']:g} s, {rn['sessions_per_pool']} "
            f"leases per pool ({rn['renew_calls_per_s']:g} calls/s, "
            f"{rn['lease_touches_per_s']:g} leases/s) | - | - | - | {rn['redis_cpu_pct']} | - | "
            f"{rn['redis_cpu_us_per_renew_call']} per renewal call | - | - | "
            f"{rn['renew_calls_per_s']:g} |"
        )
        for s in r["steps"]:
            per = " + ".join(f"{n['cpu_pct']:g}" for n in s["per_primary"].values())
            lines.append(
                f"| {r['backend']} | {s['clients_per_benchmark']} ({s['connections']}) | "
                f"{s['starts_per_s']:g} | {_ms(s['acquire_ms'])} | {_ms(s['release_ms'])} | "
                f"{s['redis_cpu_pct']:g}"
                + (f" ({per})" if len(s["per_primary"]) > 1 else "")
                + f" | {s['busiest_main_pct']:g} | {s['redis_cpu_us_per_start']:g} "
                f"({s['redis_cpu_us_per_start_net']:g}) | {s['benchmark_cpu_pct']:g} | "
                f"{sum(n['leases_at_end'] for n in s['per_primary'].values())} | "
                f"{s['renew_calls_per_s']:g} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute in all")
    parser.add_argument("--backends", nargs="+", default=["single", "cluster"],
                        choices=["single", "cluster"])  # fmt: skip
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="connections per redis-benchmark, one step each")  # fmt: skip
    parser.add_argument("--step-s", type=float, default=10.0,
                        help="about how long a step runs")  # fmt: skip
    parser.add_argument("--idle-s", type=float, default=8.0, help="the renewals-only phase")
    parser.add_argument("--hold-s", type=float, default=4.0,
                        help="how long a replayed start's lease lives (its session)")  # fmt: skip
    parser.add_argument("--gateways", type=int, default=120)
    parser.add_argument("--sessions", type=int, default=20000,
                        help="leases per pool the renewals keep alive")  # fmt: skip
    parser.add_argument("--renew-s", type=float, default=1.0)
    parser.add_argument("--ttl-s", type=float, default=10.0, help="the renewed leases' TTL")
    parser.add_argument("--saturated-pct", type=float, default=90.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.step_s, args.idle_s, args.hold_s = [1, 4, 16, 64], 3.0, 3.0, 1.0
    for tool in ("redis-server", "redis-benchmark", "redis-cli"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (Debian: apt-get install redis)")
    if not 0 < args.renew_s < args.ttl_s or args.gateways < 1 or args.sessions < 0:
        raise SystemExit("need 0 < --renew-s < --ttl-s, --gateways >= 1, --sessions >= 0")
    started = time.time()
    load_before = os.getloadavg()
    results = [run_backend(args, kind) for kind in args.backends]
    load_after = os.getloadavg()
    print(table(results))
    print()
    for r in results:
        p = r["peak"]
        print(f"{r['backend']}: stopped by {r['stopped_by']}; peak "
              f"{p['starts_per_s']:g} starts/s at {p['clients_per_benchmark']} clients per "
              f"redis-benchmark, Redis {p['redis_cpu_pct']:g} % of a core (busiest main "
              f"thread {p['busiest_main_pct']:g} %), {r['starts_per_s_per_core']} starts/s "
              "per core of Redis CPU")  # fmt: skip
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"{os.cpu_count()} cores shared by Redis and redis-benchmark; "
          f"{time.time() - started:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results,
            "load_average": {"before": load_before, "after": load_after},
            "cores": os.cpu_count(),
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
