"""The lease keeper in a process of its own: leases kept while the gateway's interpreter
cannot run.

A thread keeper (:class:`~proxy.admission.lease_keeper.LeaseKeeper` in the gateway's
process) stops whenever the interpreter stops: a call that never releases the GIL (a C
extension call, a long garbage-collector pass, a huge regex or JSON parse) or a SIGSTOP
freezes it with the event loop. Meanwhile the gateway's upstream streams still run on
the engines, so its leases must stay held. :class:`ProcessKeeper` starts one child,
``python -m proxy.admission.keeper_process``, which runs the same
:class:`~proxy.admission.lease_keeper.LeaseKeeper` over its own blocking Redis
connection. The gateway tells it of every grant, release and data generation over the
child's stdin (one JSON array a line; writes never block the event loop); the child
publishes its proofs (per pool, when the last renewal that found every lease held was
sent, on ``CLOCK_MONOTONIC``, which both processes share) in a small state file that
:meth:`ProcessKeeper.kept_age` reads, so the gate's fence deadline sees them the moment
its loop runs again.

The child keeps renewing while its parent is alive -- stopped, frozen or busy, a live
process still holds its upstream connections, so its slots stay taken. When the parent
is gone (its end of the pipe closes: the kernel closed every descriptor of the dead
process, its upstream connections among them; or the child was re-parented), the
child waits ``fence_margin_s`` (the engine's abort latency) and marks the leases it
held, and those released in the last TTL whose release may not have landed, expired
(``lapse.lua``): their slots are free again at the next script on the pool, not a TTL
later. The child ignores SIGINT and SIGTERM and runs in a session of its own, so it
outlives its parent's signals; it exits when told to (``stop``) or after handing
back a dead parent's leases.

This version tracks the parent process, not each lease's upstream connection: a
connection that ends while the process is frozen keeps its lease until the process
runs again and releases it.

What the keeper cannot do is reach a Redis it is cut off from: then its leases lapse
after one TTL and the gate's fence ends the sessions, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from proxy.admission.lease_keeper import LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission
from proxy.admission.redis_clients import SentinelNodes

__all__ = ["KeeperConfig", "ProcessKeeper", "process_keeper_supported"]

log = logging.getLogger("headroom.lease_keeper")

#: The proofs' file in the keeper's directory.
_STATE = "kept.json"


def process_keeper_supported() -> bool:
    """Whether this platform runs the keeper as a process: Linux, where the gateway and
    its child read one ``CLOCK_MONOTONIC`` and a dead process's descriptors close at
    once. Elsewhere the gate keeps the thread keeper."""
    return sys.platform.startswith("linux")


@dataclass(frozen=True, slots=True)
class KeeperConfig:
    """What the child needs to renew: the Redis it reaches and the lease timings."""

    url: str
    key_prefix: str
    lease_ttl_s: float
    timeout_s: float
    interval_s: float
    fence_margin_s: float
    sentinel: SentinelNodes | None = None

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.lease_ttl_s <= 0 or self.timeout_s <= 0:
            raise ValueError("interval_s, lease_ttl_s and timeout_s must be > 0")
        if self.fence_margin_s < 0:
            raise ValueError("fence_margin_s must be >= 0")

    def to_json(self, state_dir: str) -> str:
        sentinel = None
        if self.sentinel is not None:
            s = self.sentinel
            sentinel = {"master": s.master, "nodes": [list(n) for n in s.nodes],
                        "password": s.password}  # fmt: skip
        return json.dumps({
            "url": self.url, "key_prefix": self.key_prefix, "lease_ttl_s": self.lease_ttl_s,
            "timeout_s": self.timeout_s, "interval_s": self.interval_s,
            "fence_margin_s": self.fence_margin_s, "sentinel": sentinel, "state_dir": state_dir,
        })  # fmt: skip

    @classmethod
    def from_json(cls, line: str) -> tuple[KeeperConfig, str]:
        raw = json.loads(line)
        s = raw["sentinel"]
        sentinel = None
        if s is not None:
            nodes = tuple((str(h), int(p)) for h, p in s["nodes"])
            sentinel = SentinelNodes(str(s["master"]), nodes, s["password"])
        config = cls(
            str(raw["url"]), str(raw["key_prefix"]), float(raw["lease_ttl_s"]),
            float(raw["timeout_s"]), float(raw["interval_s"]), float(raw["fence_margin_s"]),
            sentinel,
        )  # fmt: skip
        return config, str(raw["state_dir"])


class ProcessKeeper:
    """The gateway's side of the keeper process (module docstring); implements
    :class:`~proxy.admission.lease_keeper.Keeper`. :meth:`hold`, :meth:`drop`,
    :meth:`set_generation`, :meth:`ticked`, :meth:`kept_age` and :meth:`holding` run
    on the event loop and never block; :meth:`start` spawns the child, :meth:`stop`
    waits for it."""

    def __init__(self, config: KeeperConfig, *, python: str = sys.executable) -> None:
        self.config = config
        self.interval_s = config.interval_s
        self._python = python
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, None]] = {}
        self._generation: dict[str, str] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._pending = bytearray()
        self._dir: str | None = None
        self._stopped = False
        #: Children started (a child that died is started again at the next tick).
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # -- the gate's side (event loop) -------------------------------------------------

    def hold(self, pool: str, lease_id: str) -> None:
        with self._lock:
            self._held.setdefault(pool, {})[lease_id] = None
            self._send(["hold", pool, lease_id])

    def drop(self, pool: str, lease_id: str) -> None:
        with self._lock:
            held = self._held.get(pool)
            if held is not None:
                held.pop(lease_id, None)
            self._send(["drop", pool, lease_id])

    def set_generation(self, pool: str, generation: str) -> None:
        with self._lock:
            if self._generation.get(pool) == generation:
                return
            self._generation[pool] = generation
            self._send(["generation", pool, generation])

    def ticked(self, pool: str) -> None:
        """The gate's tick renewed ``pool``: the child leaves it alone until the tick
        is late. A child that died is started again here, with what it must keep."""
        with self._lock:
            if self._stopped:
                return
            if self._process is not None and self._process.poll() is not None:
                log.error("lease keeper process %d exited with %s; starting another",
                          self._process.pid, self._process.returncode)  # fmt: skip
                self._close_pipe()
                self._process = None
            if self._process is None:
                self._spawn()
            self._send(["ticked", pool])

    def kept_age(self, pool: str) -> float | None:
        if self._dir is None:
            return None
        try:
            with open(os.path.join(self._dir, _STATE), "rb") as f:
                proofs = json.loads(f.read())
            kept = float(proofs[pool])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return max(0.0, time.monotonic() - kept)

    def holding(self, pool: str) -> int:
        with self._lock:
            return len(self._held.get(pool, ()))

    def running(self) -> bool:
        """Whether the child has read its configuration and runs its renewal loop."""
        return self._dir is not None and os.path.exists(os.path.join(self._dir, _STATE))

    # -- the child's life -------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._process is None and not self._stopped:
                self._spawn()

    def _spawn(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="headroom-keeper-")
        # The child imports this very package, wherever this process found it.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen(
                [self._python, "-m", "proxy.admission.keeper_process"],
                stdin=subprocess.PIPE, start_new_session=True, env=env,
            )  # fmt: skip
        except OSError as exc:
            log.error("lease keeper process could not start (%s): leases are renewed by "
                      "the event loop only until the next tick starts it", exc)  # fmt: skip
            return
        assert process.stdin is not None
        os.set_blocking(process.stdin.fileno(), False)
        self._process, self._stdin = process, process.stdin
        self.starts += 1
        self._pending = bytearray(self.config.to_json(self._dir).encode() + b"\n")
        for pool, generation in self._generation.items():
            self._pending += _line(["generation", pool, generation])
        for pool, ids in self._held.items():
            for lease_id in ids:
                self._pending += _line(["hold", pool, lease_id])
        self._flush()

    def _send(self, message: list[str]) -> None:
        if self._stdin is None:
            return
        self._pending += _line(message)
        self._flush()

    def _flush(self) -> None:
        """Write what the pipe takes now; the rest waits for the next message (the
        child reads its pipe from a thread of its own, so it rarely waits at all)."""
        if self._stdin is None:
            return
        try:
            while self._pending:
                written = os.write(self._stdin.fileno(), self._pending)
                del self._pending[:written]
        except BlockingIOError:
            pass
        except OSError as exc:  # the child is gone: the next tick starts another
            log.warning("lease keeper process unreachable: %s", exc)
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self._stdin is not None:
            with contextlib.suppress(OSError):
                self._stdin.close()
        self._stdin = None
        self._pending.clear()

    def stop(self) -> None:
        """Tell the child to exit without handing anything back (the gate releases its
        own leases), wait for it, and remove its state. Blocking."""
        with self._lock:
            self._stopped = True
            process = self._process
            if self._stdin is not None:
                self._pending += _line(["stop"])
                deadline = time.monotonic() + 2.0
                self._flush()
                while self._pending and self._stdin is not None and time.monotonic() < deadline:
                    select.select([], [self._stdin], [], 0.1)
                    self._flush()
                self._close_pipe()
        if process is not None:
            try:
                process.wait(timeout=self.config.timeout_s * 2 + self.interval_s + 5.0)
            except subprocess.TimeoutExpired:
                log.error("lease keeper process %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __repr__(self) -> str:
        with self._lock:
            held = {pool: len(ids) for pool, ids in self._held.items() if ids}
        return f"<ProcessKeeper pid={self.pid} held={held}>"


def _line(message: list[str]) -> bytes:
    return json.dumps(message).encode() + b"\n"


# -- the child --------------------------------------------------------------------------


class _Child:
    """The keeper process: reads the gateway's messages on a thread, renews on the main
    thread, hands back the leases of a dead gateway."""

    def __init__(self, config: KeeperConfig, state_dir: str, stdin: IO[bytes]) -> None:
        self.config = config
        self.state_dir = state_dir
        self._stdin = stdin
        self._parent = os.getppid()
        backend = RedisAdmission(config.url, key_prefix=config.key_prefix,
                                 lease_ttl_s=config.lease_ttl_s, timeout_s=config.timeout_s,
                                 sentinel=config.sentinel)  # fmt: skip
        self.renewer = backend.lease_renewer()
        self.keeper = LeaseKeeper(self.renewer.keep, interval_s=config.interval_s)
        self._lock = threading.Lock()
        #: pool -> lease id -> when (monotonic) the gateway released it: its release
        #: may not have landed when the gateway died.
        self._dropped: dict[str, dict[str, float]] = {}
        self._wake = threading.Event()
        self.orphaned = False
        self.stopping = False
        self._published: dict[str, float] | None = None

    def read(self) -> None:
        for raw in self._stdin:
            try:
                message = json.loads(raw)
                self._apply(message)
            except (ValueError, TypeError, IndexError) as exc:
                log.error("lease keeper process: bad message %r: %s", raw[:200], exc)
            if self.stopping:
                break
        else:
            self.orphaned = True
        self._wake.set()

    def _apply(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "hold":
            self.keeper.hold(str(message[1]), str(message[2]))
        elif kind == "drop":
            pool, lease_id = str(message[1]), str(message[2])
            self.keeper.drop(pool, lease_id)
            with self._lock:
                self._dropped.setdefault(pool, {})[lease_id] = time.monotonic()
        elif kind == "generation":
            self.keeper.set_generation(str(message[1]), str(message[2]))
        elif kind == "ticked":
            self.keeper.ticked(str(message[1]))
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def run(self) -> None:
        reader = threading.Thread(target=self.read, name="keeper-reader", daemon=True)
        reader.start()
        self._publish()  # an empty file first: the gateway sees the child running
        while True:
            self._wake.wait(self.config.interval_s)
            if self.stopping:
                return
            if self.orphaned or os.getppid() != self._parent:
                self.hand_back()
                return
            try:
                self.keeper.keep_once()
            except Exception:  # the process must outlive any one failure
                log.exception("lease keeper process: renewal failed")
            self._publish()
            self._forget_old_drops()

    def _publish(self) -> None:
        proofs = self.keeper.proofs()
        if proofs == self._published:
            return
        path = os.path.join(self.state_dir, _STATE)
        temporary = f"{path}.{os.getpid()}"
        try:
            with open(temporary, "w") as f:
                json.dump(proofs, f)
            os.replace(temporary, path)
        except OSError as exc:  # the gateway removed the directory: it is stopping
            log.debug("lease keeper process: proofs not written: %s", exc)
            return
        self._published = proofs

    def _forget_old_drops(self) -> None:
        horizon = time.monotonic() - self.config.lease_ttl_s
        with self._lock:
            for ids in self._dropped.values():
                for lease_id in [i for i, at in ids.items() if at < horizon]:
                    del ids[lease_id]

    def hand_back(self) -> None:
        """The gateway is gone: after the engine's abort latency, mark its leases
        expired, retrying while they could still be held (one TTL)."""
        died = time.monotonic()
        time.sleep(self.config.fence_margin_s)
        work: dict[str, dict[str, None]] = {}
        with self._lock:
            for pool, dropped in self._dropped.items():
                work[pool] = dict.fromkeys(dropped)
        for pool, held in self.keeper.held().items():
            work.setdefault(pool, {}).update(dict.fromkeys(held))
        for pool, ids in work.items():
            if not ids:
                continue
            while True:
                try:
                    marked = self.renewer.lapse(pool, tuple(ids))
                except BackendUnavailable as exc:
                    if time.monotonic() - died > self.config.lease_ttl_s:
                        log.warning("lease keeper process: leases of pool %s left to "
                                    "lapse: %s", pool, exc)  # fmt: skip
                        break
                    time.sleep(min(self.config.interval_s, 0.5))
                    continue
                log.warning("lease keeper process: gateway %d is gone; handed back %d "
                            "lease(s) of pool %s", self._parent, marked, pool)  # fmt: skip
                break

    def close(self) -> None:
        self.renewer.close()


def main() -> int:
    """``python -m proxy.admission.keeper_process``: the first line of stdin is the
    configuration (:meth:`KeeperConfig.to_json`), then the gateway's messages."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    stdin = sys.stdin.buffer
    first = stdin.readline()
    if not first:
        return 0
    config, state_dir = KeeperConfig.from_json(first.decode())
    child = _Child(config, state_dir, stdin)
    try:
        child.run()
    finally:
        child.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
