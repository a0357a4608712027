"""A real Redis Cluster for tests and benches: primaries and replicas from Debian's
``redis-server`` on free 127.0.0.1 ports, joined by ``redis-cli --cluster create``,
stopped at teardown. Skips (with the reason) only when the binaries are missing; in CI
(``CI`` set) that is a failure.

Also here: :class:`Partition`, a TCP relay in front of one node that can cut every
connection through it and answer nothing (a shard partitioned from one gateway), and
:func:`pools_on_primaries`, pool names whose slots land on different primaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ClusterNode", "LocalCluster", "Partition", "pool_slot", "pools_on_primaries"]

_MAX_PORT = 65535 - 10000  # the cluster bus listens on port + 10000


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_pair(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port <= _MAX_PORT and port not in taken and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def pool_slot(pool: str, key_prefix: str = "headroom:") -> int:
    """The hash slot of a pool's keys (its ``{pool}`` hash tag)."""
    from redis.crc import key_slot

    return int(key_slot(f"{key_prefix}{{{pool}}}:".encode()))


class _PortTaken(RuntimeError):
    """A node's redis-server exited at start-up (its port or bus port was taken)."""


@dataclass
class ClusterNode:
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class LocalCluster:
    """``primaries`` primaries with ``replicas`` replicas each. ``node_timeout_ms`` is
    ``cluster-node-timeout``: how long a primary may be unreachable before its replica
    is promoted. Every node runs with ``cluster-require-full-coverage no``, so the
    other shards keep serving while one has no primary."""

    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    nodes: list[ClusterNode] = field(default_factory=list)
    workdir: str = ""

    def __post_init__(self) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            message = "redis-server/redis-cli not installed (Debian: apt-get install redis)"
            import pytest

            if os.environ.get("CI"):
                pytest.fail(f"{message}; CI must provide it")
            pytest.skip(message)
        self._server, self._cli = server, cli
        self.workdir = tempfile.mkdtemp(prefix="headroom-cluster-")
        taken: set[int] = set()
        for _ in range(self.primaries * (1 + self.replicas)):
            port = _free_pair(taken)
            taken.add(port)
            self.nodes.append(ClusterNode(port))
        try:
            for node in self.nodes:
                self._spawn_on_free_port(node, taken)
            create = [self._cli, "--cluster", "create", *(n.address for n in self.nodes),
                      "--cluster-replicas", str(self.replicas), "--cluster-yes"]  # fmt: skip
            subprocess.run(create, check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    # -- processes --------------------------------------------------------------------

    def _spawn_on_free_port(self, node: ClusterNode, taken: set[int]) -> None:
        """Start ``node``; when its port or bus port was taken between the choice and
        the start (another test worker's server), on a new pair (five tries)."""
        for attempt in range(5):
            try:
                self._spawn(node)
                return
            except _PortTaken:
                if attempt == 4:
                    raise RuntimeError(f"no cluster node started in 5 tries (last port "
                                       f"{node.port})") from None  # fmt: skip
                node.port = _free_pair(taken)
                taken.add(node.port)

    def _spawn(self, node: ClusterNode) -> None:
        node.process = subprocess.Popen(
            [self._server, "--port", str(node.port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file",
             os.path.join(self.workdir, f"nodes-{node.port}.conf"),
             "--cluster-node-timeout", str(self.node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--dir", self.workdir,
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.call(node.port, "PING") in (True, b"PONG", "PONG"):
                    return
            if node.process.poll() is not None:
                raise _PortTaken(f"redis-server exited with {node.process.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"cluster node {node.port} did not answer PING within 10 s")

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.kill()
                node.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crashed primary or replica)."""
        node = self.node(port)
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)

    def node(self, port: int) -> ClusterNode:
        return next(n for n in self.nodes if n.port == port)

    # -- queries ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def call(self, port: int, *args: Any, timeout_s: float = 2.0) -> Any:
        """One command on one node, bounded by ``timeout_s`` (connect and reply)."""
        import redis

        client = redis.Redis(port=port, socket_timeout=timeout_s, socket_connect_timeout=2.0)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def _live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.alive]

    def slot_owner(self, slot: int, *, via: int | None = None) -> int:
        """The port of the primary serving ``slot``, as node ``via`` (any live one)
        sees the slot map."""
        port = via if via is not None else self._live()[0].port
        for start, end, primary, *_ in self.call(port, "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(primary[1])
        raise LookupError(f"slot {slot} is not served")

    def replicas_of(self, primary: int) -> list[int]:
        me = self._node_id(primary)
        out = []
        for line in self._nodes_lines(self._live()[0].port):
            parts = line.split()
            if len(parts) > 3 and parts[3] == me and "slave" in parts[2]:
                out.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return out

    def _nodes_lines(self, port: int) -> list[str]:
        raw = self.call(port, "CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return [line for line in text.splitlines() if line.strip()]

    def _node_id(self, port: int) -> str:
        raw = self.call(port, "CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def state_ok(self, port: int) -> bool:
        raw = self.call(port, "CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return "cluster_state:ok" in text

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and all see one slot map."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                live = self._live()
                if all(self.state_ok(n.port) for n in live):
                    maps = {repr(sorted((s[0], s[1], s[2][1]) for s in
                                        self.call(n.port, "CLUSTER", "SLOTS")))
                            for n in live}  # fmt: skip
                    if len(maps) == 1 and self._replicas_in_sync():
                        return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok within {timeout_s:g} s")

    def _replicas_in_sync(self) -> bool:
        """Every shard has its live replicas attached and in sync (until then a
        killed primary has nobody to promote)."""
        slots = self.call(self._live()[0].port, "CLUSTER", "SLOTS")
        for port in {int(s[2][1]) for s in slots}:
            live_replicas = [p for p in self.replicas_of(port) if self.node(p).alive]
            if self.node(port).alive and len(live_replicas) < self.replicas:
                return False
            for replica in live_replicas:
                info = self.call(replica, "INFO", "replication")  # parsed by redis-py
                if info.get("master_link_status") != "up":
                    return False
        return True

    def wait_owner_change(self, slot: int, old: int, timeout_s: float = 30.0) -> int:
        """Until the live nodes agree that a primary other than ``old`` serves
        ``slot``; returns its port (a replica promoted after ``old`` died)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                owners = {self.slot_owner(slot, via=n.port) for n in self._live()}
                if len(owners) == 1 and old not in owners:
                    return owners.pop()
            time.sleep(0.05)
        raise RuntimeError(f"slot {slot} still on {old} after {timeout_s:g} s")

    # -- slot migration (the steps redis-cli --cluster reshard takes, one at a time) ----

    def begin_migration(self, slot: int, target: int) -> int:
        """Mark ``slot`` importing on ``target`` and migrating on its owner, moving no
        key yet; returns the source's port. Until :meth:`finish_migration`, calls on
        the slot are redirected (ASK) or answered TRYAGAIN."""
        source = self.slot_owner(slot)
        self.call(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", self._node_id(source))
        self.call(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", self._node_id(target))
        return source

    def move_keys(self, slot: int, source: int, target: int, batch: int = 5) -> int:
        """MIGRATE the slot's keys from ``source`` to ``target``, ``batch`` at a time;
        returns how many moved."""
        moved = 0
        while True:
            keys = self.call(source, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                return moved
            self.call(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)

    def finish_migration(self, slot: int, target: int) -> None:
        """Give ``slot`` to ``target`` on every live primary (then the cluster spreads
        it), and wait until every node agrees."""
        target_id = self._node_id(target)
        self.call(target, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for n in self._live():
            if n.port != target:
                with contextlib.suppress(Exception):
                    self.call(n.port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if all(self.slot_owner(slot, via=n.port) == target for n in self._live()):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"slot {slot} not on {target} everywhere within 30 s")

    def primary_ports(self) -> list[int]:
        ports = []
        for start, _end, primary, *_ in sorted(self.call(self._live()[0].port, "CLUSTER",
                                                         "SLOTS")):  # fmt: skip
            if int(primary[1]) not in ports:
                ports.append(int(primary[1]))
            del start
        return ports


def pools_on_primaries(cluster: LocalCluster, count: int, stem: str = "pool") -> list[str]:
    """``count`` pool names (``<stem>-<n>``) whose slots are served by different
    primaries (round robin over them when ``count`` exceeds their number)."""
    primaries = cluster.primary_ports()
    want = [primaries[i % len(primaries)] for i in range(count)]
    names: list[str] = []
    n = 0
    while len(names) < count:
        name = f"{stem}-{n}"
        n += 1
        if cluster.slot_owner(pool_slot(name)) == want[len(names)]:
            names.append(name)
    return names


class Partition:
    """A TCP relay on a free 127.0.0.1 port in front of ``target`` (host, port), run on
    the caller's event loop. :meth:`cut` resets every connection through it and from
    then on accepts connections and never answers them (a network partition: the
    client sees timeouts, not refusals); :meth:`heal` forwards again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_off = False
        self._server: asyncio.AbstractServer | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self.cut_off = True
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    def heal(self) -> None:
        self.cut_off = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._links.add(writer)
        try:
            if self.cut_off:
                while await reader.read(65536):  # read and drop until the client leaves
                    pass
                return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            self._links.add(up_writer)

            async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                while data := await src.read(65536):
                    if self.cut_off:
                        return
                    dst.write(data)
                    await dst.drain()

            try:
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            finally:
                up_writer.transport.abort()
                self._links.discard(up_writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()
            self._links.discard(writer)


def remap_through(proxies: dict[int, Partition]) -> Callable[[tuple[str, int]], tuple[str, int]]:
    """An ``address_remap`` sending the nodes with a proxy through it."""

    def remap(address: tuple[str, int]) -> tuple[str, int]:
        host, port = address
        proxy = proxies.get(int(port))
        return ("127.0.0.1", proxy.port) if proxy is not None else (host, int(port))

    return remap
