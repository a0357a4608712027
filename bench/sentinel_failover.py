"""Redis Sentinel failover under load: two gateways share caps through a Redis primary
watched by three sentinels; the primary is killed (SIGKILL) while sessions run, a
sentinel promotes the replica, and the gateways follow it (docs/reliability.md,
"Redis Sentinel failover").

    python bench/sentinel_failover.py                       # one failover, about 40 s
    python bench/sentinel_failover.py --json sentinel.json --markdown sentinel.md

Everything listens on 127.0.0.1 ports chosen by the OS, every process is started by the
run and stopped at its end, and the run stops by itself. Measured: the failover time
(the kill to the sentinels naming the replica), the time until the first session was
admitted again, what became of the sessions running at the kill, and the engine's
sessions over the cap. The exit status is 0 only if the engine never ran over its cap,
admission resumed, no slot leaked, and -- when the failover took less than
``lease_ttl_s - fence_margin_s`` -- every session running at the kill ended normally.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import chaos_shared as cs  # noqa: E402

MASTER = "headroom"


@dataclass(slots=True)
class FailoverConfig:
    gpus: int = 2
    cap: int = 3
    clients: int = 0  # 0: 2 x gpus x cap
    preset: str = "l4-cosyvoice2-0.5b"
    lease_ttl_s: float = 10.0
    renew_interval_s: float = 2.0
    fence_margin_s: float = 1.0
    redis_timeout_s: float = 0.5
    down_after_ms: int = 1000
    long_share: float = 0.5
    long_repeat: int = 6
    warmup_s: float = 8.0
    after_s: float = 20.0
    seed: int = 0
    workdir: str | None = None

    @property
    def offered(self) -> int:
        return self.clients or 2 * self.gpus * self.cap

    def chaos(self) -> cs.SharedChaosConfig:
        return cs.SharedChaosConfig(
            gateways=2, gpus=self.gpus, cap=self.cap, preset=self.preset,
            lease_ttl_s=self.lease_ttl_s, renew_interval_s=self.renew_interval_s,
            fence_margin_s=self.fence_margin_s, redis_timeout_s=self.redis_timeout_s,
            seed=self.seed, queue_wait_s=6.0,
        )  # fmt: skip


class Node:
    """One redis-server (a data node, or a sentinel with ``sentinel=True``)."""

    def __init__(self, workdir: Path, name: str, args: list[str], sentinel: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.port = cs._free_port()
        self.name = name
        self.log = workdir / f"{name}.log"
        conf = workdir / f"{name}.conf"
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode no", "save ''",
                 "appendonly no", f"dir {workdir}", *args]  # fmt: skip
        conf.write_text("\n".join(lines) + "\n")
        self.argv = [binary, str(conf), *(["--sentinel"] if sentinel else [])]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


async def _wait(what: str, check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await check():
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {timeout:g} s")


async def _master_port(sentinels: list[Node]) -> int | None:
    import redis.asyncio as aioredis

    for s in sentinels:
        client = aioredis.Redis(port=s.port, socket_timeout=0.5)
        try:
            addr = await client.execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
            if addr:
                return int(addr[1])
        except Exception:
            continue
        finally:
            await client.aclose()
    return None


def gateway_config(cfg: FailoverConfig, port: int, primary: Node, sentinels: list[Node],
                   gpu_urls: list[str]) -> dict[str, Any]:  # fmt: skip
    data = cs.gateway_settings(cfg.chaos(), port, f"redis://127.0.0.1:{primary.port}/0",
                               gpu_urls)  # fmt: skip
    data["admission"]["redis"]["sentinel"] = {
        "master": MASTER,
        "nodes": [f"127.0.0.1:{s.port}" for s in sentinels],
    }
    data["limits"]["idle_timeout_s"] = 20
    data["limits"]["max_session_s"] = 60
    return data


async def _client(cfg: FailoverConfig, ports: list[int], rng: random.Random, client: int,
                  sessions: list[cs.Session], stop: asyncio.Event) -> None:  # fmt: skip
    import websockets
    from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

    n = 0
    await asyncio.sleep(rng.uniform(0, 1.0))
    while not stop.is_set():
        gw = (client + n) % len(ports)
        s = cs.Session(f"{client}-{n}", gw, time.monotonic(), long=rng.random() < cfg.long_share)
        n += 1
        url = f"ws://127.0.0.1:{ports[gw]}{cs.SPEECH_WS}?cid={s.cid}"
        try:
            async with asyncio.timeout(90):
                ws = await websockets.connect(url, open_timeout=30, close_timeout=2)
                s.opened = time.monotonic()
                text = " ".join([cs.TEXT] * cfg.long_repeat) if s.long else cs.TEXT
                await ws.send(json.dumps({"type": "session.config", "response_format": "pcm",
                                          "stream_audio": True}))  # fmt: skip
                await ws.send(json.dumps({"type": "input.text", "text": text}))
                await ws.send(json.dumps({"type": "input.done"}))
                while True:
                    msg = await ws.recv()
                    if isinstance(msg, str) and json.loads(msg).get("type") in (
                            "session.done", "error"):  # fmt: skip
                        s.outcome = "ok" if json.loads(msg)["type"] == "session.done" else "error"
                        break
                await ws.close()
        except InvalidStatus as exc:
            s.outcome = f"refused:{exc.response.headers.get('x-headroom-reason', '')}"
        except ConnectionClosed as exc:
            s.outcome = f"closed:{exc.rcvd.code if exc.rcvd is not None else 1006}"
        except (InvalidMessage, OSError):
            s.outcome = "connect_failed"
        except TimeoutError:
            s.outcome = "hung"
        s.ended = time.monotonic()
        sessions.append(s)
        if s.outcome != "ok":
            await asyncio.sleep(rng.uniform(0.2, 0.5))


async def run(cfg: FailoverConfig) -> dict[str, Any]:
    workdir = Path(cfg.workdir or tempfile.mkdtemp(prefix="headroom-sentinel-"))
    workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 -- once, at start-up
    load_before = os.getloadavg()
    primary = Node(workdir, "primary", [])
    replica = Node(workdir, "replica", [f"replicaof 127.0.0.1 {primary.port}"])
    sentinels = [
        Node(workdir, f"sentinel{i}", [
            f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 2",
            f"sentinel down-after-milliseconds {MASTER} {cfg.down_after_ms}",
            f"sentinel failover-timeout {MASTER} 10000",
            f"sentinel parallel-syncs {MASTER} 1",
        ], sentinel=True)
        for i in range(3)
    ]  # fmt: skip
    nodes = [primary, replica, *sentinels]
    sim = cs.SimProcess(cfg.chaos(), workdir / "sim.log")
    gateways: list[cs.GatewayProcess] = []
    try:
        import redis.asyncio as aioredis

        for node in nodes:
            node.start()

        async def replicated() -> bool:
            info = await aioredis.Redis(port=replica.port, socket_timeout=0.5).info("replication")
            return bool(info.get("master_link_status") == "up")

        async def sentinels_agree() -> bool:
            client = aioredis.Redis(port=sentinels[0].port, socket_timeout=0.5)
            try:
                peers = await client.execute_command("SENTINEL", "sentinels", MASTER)
                replicas = await client.execute_command("SENTINEL", "replicas", MASTER)
                return len(peers) == 2 and len(replicas) == 1
            finally:
                await client.aclose()

        await _wait("replication", replicated)
        await _wait("sentinel discovery", sentinels_agree)
        await sim.start()
        for i in range(2):
            port = cs._free_port()
            path = workdir / f"gateway{i}.yaml"
            data = gateway_config(cfg, port, primary, sentinels, sim.urls)
            path.write_text(json.dumps(data) + "\n")
            gateways.append(cs.GatewayProcess(i, path, workdir / f"gateway{i}.log", port))
        await asyncio.gather(*(g.start() for g in gateways))
        await asyncio.sleep(cfg.lease_ttl_s + 0.2)  # a new Redis blocks grants for one TTL
        rng = random.Random(cfg.seed)
        sessions: list[cs.Session] = []
        stop = asyncio.Event()
        ports = [g.port for g in gateways]
        clients = [asyncio.ensure_future(_client(cfg, ports, rng, i, sessions, stop))
                   for i in range(cfg.offered)]  # fmt: skip
        await asyncio.sleep(cfg.warmup_s)
        killed = time.monotonic()
        primary.kill()

        async def promoted() -> bool:
            return await _master_port(sentinels) == replica.port

        await _wait("promotion", promoted, timeout=60)
        failover_s = time.monotonic() - killed
        await asyncio.sleep(cfg.after_s)
        stop.set()
        _, pending = await asyncio.wait(clients, timeout=60)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(cfg.renew_interval_s * 2)
        client = aioredis.Redis(port=replica.port, socket_timeout=2)
        leaks = {
            "leases": await client.zcard(cs._keys("leases")),
            "owner": await client.hlen(cs._keys("owner")),
            "queue": await client.zcard(cs._keys("queue")),
        }
        await client.aclose()
        sim_report = await sim.report()
        exit_codes = [await g.stop() for g in gateways]
        return report(cfg, sessions, killed, failover_s, sim_report, leaks, exit_codes,
                      load_before, workdir)  # fmt: skip
    finally:
        for g in gateways:
            with contextlib.suppress(Exception):
                await g.stop()
        with contextlib.suppress(Exception):
            await sim.stop()
        for node in nodes:
            node.kill()


def report(cfg: FailoverConfig, sessions: list[cs.Session], killed: float, failover_s: float,
           sim: dict[str, Any], leaks: dict[str, int], exit_codes: list[int | None],
           load_before: tuple[float, float, float], workdir: Path) -> dict[str, Any]:  # fmt: skip
    live = [s for s in sessions if s.opened is not None and s.opened < killed < s.ended]
    live_outcomes = Counter(s.outcome for s in live)
    after = sorted(s.opened - killed for s in sessions if s.opened is not None
                   and s.opened > killed)  # fmt: skip
    leaked = sum(leaks.values()) + sum(sim["active_sessions"]) + sum(sim["open_streams"])
    short = failover_s < cfg.lease_ttl_s - cfg.fence_margin_s
    invariants = {
        "never_over_cap": sim["over_cap_streams"] == 0
        and sim["audit"]["over_cap"] == 0
        and sim["over_cap_sessions"] == 0,
        "admission_resumed": bool(after),
        "no_leaked_slot": leaked == 0,
        "live_sessions_survived": (not short) or set(live_outcomes) <= {"ok"},
    }
    return {
        "config": {**asdict(cfg), "offered": cfg.offered},
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "workdir": str(workdir),
        "failover_s": round(failover_s, 3),
        "first_admission_after_kill_s": round(after[0], 3) if after else None,
        "sessions_live_at_kill": len(live),
        "live_outcomes": dict(live_outcomes),
        "sessions": dict(Counter(s.outcome for s in sessions).most_common()),
        "engine": {
            "streams_opened": sim["audit"]["opened"],
            "samples": sim["samples"],
            "over_cap_samples": sim["over_cap_streams"],
            "max_streams": sim["max_streams"],
        },
        "leaks": {**leaks, "total": leaked},
        "gateway_exit_codes": exit_codes,
        "logs": cs.read_logs(workdir),
        "invariants": invariants,
        "passed": all(invariants.values()),
    }


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    return "\n".join([
        f"# Sentinel failover: 2 gateways, {c['gpus']} GPUs x cap {c['cap']}, "
        f"{c['offered']} clients, lease_ttl_s {c['lease_ttl_s']:g}, "
        f"fence_margin_s {c['fence_margin_s']:g}, down-after {c['down_after_ms']} ms",
        "",
        f"load average before/after: {r['machine']['loadavg_before'][0]:.2f} / "
        f"{r['machine']['loadavg_after'][0]:.2f}",
        f"failover (kill to promotion): {r['failover_s']} s; first admission after the kill: "
        f"{r['first_admission_after_kill_s']} s",
        f"sessions running at the kill: {r['sessions_live_at_kill']} {r['live_outcomes']}",
        f"engine: {r['engine']['streams_opened']} streams, {r['engine']['over_cap_samples']} "
        f"samples over cap; leaked slots: {r['leaks']['total']}",
        f"all sessions: {r['sessions']}",
        "",
        "| invariant | held |",
        "|---|---|",
        *[f"| {k} | {'yes' if v else '**NO**'} |" for k, v in r["invariants"].items()],
    ]) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    d = FailoverConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s)
    p.add_argument("--fence-margin", type=float, default=d.fence_margin_s)
    p.add_argument(
        "--down-after-ms",
        type=int,
        default=d.down_after_ms,
        help="the sentinels' down-after-milliseconds",
    )
    p.add_argument("--warmup", type=float, default=d.warmup_s)
    p.add_argument("--after", type=float, default=d.after_s, help="load after the promotion")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workdir")
    p.add_argument("--json")
    p.add_argument("--markdown")
    a = p.parse_args(argv)
    cfg = FailoverConfig(lease_ttl_s=a.lease_ttl, fence_margin_s=a.fence_margin,
                         down_after_ms=a.down_after_ms, warmup_s=a.warmup, after_s=a.after,
                         seed=a.seed, workdir=a.workdir)  # fmt: skip
    result = asyncio.run(run(cfg))
    return cs.emit(result, format_report(result), a.json, a.markdown)


if __name__ == "__main__":
    sys.exit(main())
