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
(``keep.lua``'s lapse op): their slots are free again at the next script on the pool, not a TTL
later. The child ignores SIGINT and SIGTERM and runs in a session of its own, so it
outlives its parent's signals; it exits when told to (``stop``) or after handing
back a dead parent's leases.

Every message carries a sequence number. A proof names the last message the child had
applied before it read the leases it renewed: a renewal that did not carry a grant
proves nothing about that lease, however late the grant's message reached the child (a
slow pipe, a starved or stopped child, a renewal of another pool in between). So
:meth:`ProcessKeeper.kept_age` dates a proof no later than the earliest grant it did
not carry (when the gateway made the grant, as the gate's own renewals date a grant
made while one is in flight): at worst an early fence, never a fence deadline past a
lease's expiry.

While the child is stopped its pipe fills; what the gateway has not written yet is
bounded: past ``max_pending_bytes`` it is replaced by one snapshot of the leases held
now (the child needs the current set, not the history of grants and releases that led
to it). A child that cannot start, or exits before it runs, is started again after a
back-off that doubles up to :data:`MAX_BACKOFF_S`; the failure and the recovery are
logged once each. Meanwhile the gate's own ticks renew and its fence stays the last
resort.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from proxy.admission.lease_keeper import LeaseKeeper
from proxy.admission.redis_backend import BackendUnavailable, RedisAdmission
from proxy.admission.redis_clients import SentinelNodes

__all__ = [
    "MAX_BACKOFF_S",
    "MAX_PENDING_BYTES",
    "KeeperConfig",
    "ProcessKeeper",
    "process_keeper_supported",
]

log = logging.getLogger("headroom.lease_keeper")

#: The proofs' file in the keeper's directory.
_STATE = "kept.json"
#: The longest wait before starting a child again after failed starts.
MAX_BACKOFF_S = 30.0
#: What the gateway keeps of its messages to a child that does not read them, by
#: default, before it replaces them with a snapshot.
MAX_PENDING_BYTES = 256 * 1024
#: Grants a pool remembers as not yet carried by a proof; past it, the two oldest are
#: merged (the earlier time, the later number: a proof must carry both to pass it).
_UNCOVERED = 64


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
    waits for it. ``monotonic`` is ``CLOCK_MONOTONIC``, the child's clock, on which the
    proofs, the grants and the back-off between failed starts are timed (tests pass a
    fake clock)."""

    def __init__(
        self,
        config: KeeperConfig,
        *,
        python: str = sys.executable,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_pending_bytes <= 0:
            raise ValueError("max_pending_bytes must be > 0")
        self.config = config
        self.interval_s = config.interval_s
        self._python = python
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, None]] = {}
        self._generation: dict[str, str] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._pending = bytearray()
        #: Whether the pipe holds the start of a line whose end is still pending.
        self._partial = False
        self._max_pending = max_pending_bytes
        self._coalesce_at = max_pending_bytes
        #: The number of the last message; pool -> (number, when on CLOCK_MONOTONIC)
        #: of the grants no proof has carried yet, oldest first.
        self._seq = 0
        self._uncovered: dict[str, list[tuple[int, float]]] = {}
        self._dir: str | None = None
        self._stopped = False
        #: Whether the current child has been seen running (its proofs' file exists).
        self._up = False
        #: When (``monotonic``) a start may be tried again after failures.
        self._retry_at = 0.0
        #: Children started (a child that died is started again at the next tick).
        self.starts = 0
        #: Starts that failed in a row (the child could not start, or exited before it
        #: ran); 0 once a child runs.
        self.failures = 0
        #: Times the unwritten messages were replaced by a snapshot.
        self.coalesced = 0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def pending_bytes(self) -> int:
        """Bytes of messages the child has not been able to take yet."""
        with self._lock:
            return len(self._pending)

    # -- the gate's side (event loop) -------------------------------------------------

    def hold(self, pool: str, lease_id: str) -> None:
        with self._lock:
            self._held.setdefault(pool, {})[lease_id] = None
            seq = self._send("hold", pool, lease_id)
            uncovered = self._uncovered.setdefault(pool, [])
            uncovered.append((seq, self._monotonic()))
            if len(uncovered) > _UNCOVERED:
                uncovered[:2] = [(uncovered[1][0], uncovered[0][1])]

    def drop(self, pool: str, lease_id: str) -> None:
        with self._lock:
            held = self._held.get(pool)
            if held is not None:
                held.pop(lease_id, None)
            self._send("drop", pool, lease_id)

    def set_generation(self, pool: str, generation: str) -> None:
        with self._lock:
            if self._generation.get(pool) == generation:
                return
            self._generation[pool] = generation
            self._send("generation", pool, generation)

    def ticked(self, pool: str) -> None:
        """The gate's tick renewed ``pool``: the child leaves it alone until the tick
        is late. A child that exited is started again here, with what it must keep: at
        once if it had run, else after the back-off."""
        with self._lock:
            if self._stopped:
                return
            process = self._process
            if process is not None and process.poll() is not None:
                self._exited(process)
            elif process is not None and not self._up and self._state_exists():
                self._up = True
                if self.failures:
                    log.warning("lease keeper process %d runs (after %d failed start(s))",
                                process.pid, self.failures)  # fmt: skip
                self.failures = 0
            if self._process is None and self._monotonic() >= self._retry_at:
                self._spawn()
            self._send("ticked", pool)

    def kept_age(self, pool: str) -> float | None:
        """Seconds since the child's last renewal of ``pool`` that proved every lease it
        carried, or since the earliest grant it did not carry if that is later; None
        without a proof."""
        if self._dir is None:
            return None
        try:
            with open(os.path.join(self._dir, _STATE), "rb") as f:
                proofs = json.loads(f.read())
            kept, seq = float(proofs[pool][0]), int(proofs[pool][1])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None
        with self._lock:
            uncovered = self._uncovered.get(pool, [])
            while uncovered and uncovered[0][0] <= seq:
                del uncovered[0]
            if uncovered:
                kept = min(kept, uncovered[0][1])
        return max(0.0, self._monotonic() - kept)

    def holding(self, pool: str) -> int:
        with self._lock:
            return len(self._held.get(pool, ()))

    def running(self) -> bool:
        """Whether the child has read its configuration and runs its renewal loop."""
        return self._state_exists()

    def _state_exists(self) -> bool:
        return self._dir is not None and os.path.exists(os.path.join(self._dir, _STATE))

    # -- the child's life -------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._process is None and not self._stopped:
                self._spawn()

    def _exited(self, process: subprocess.Popen[bytes]) -> None:
        """The child has exited: start another at once if it had run, else back off."""
        self._close_pipe()
        self._process = None
        if self._up or self._state_exists():
            log.error("lease keeper process %d exited with %s; starting another",
                      process.pid, process.returncode)  # fmt: skip
            self._up = False
            return
        self._failed(f"it exited with {process.returncode} before it ran")

    def _failed(self, why: str) -> None:
        self.failures += 1
        backoff = min(MAX_BACKOFF_S, self.interval_s * 2 ** (self.failures - 1))
        self._retry_at = self._monotonic() + backoff
        if self.failures == 1:
            log.error("lease keeper process could not start (%s): until one runs, only "
                      "the event loop renews the leases and the fence is the last resort; "
                      "retrying with a back-off up to %g s", why, MAX_BACKOFF_S)  # fmt: skip
        else:
            log.debug("lease keeper process: start %d failed (%s); next in %.1f s",
                      self.failures, why, backoff)  # fmt: skip

    def _spawn(self) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="headroom-keeper-")
        # A proof of an earlier child would let running() see this one up too soon.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._dir, _STATE))
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
            self._failed(str(exc))
            return
        assert process.stdin is not None
        os.set_blocking(process.stdin.fileno(), False)
        self._process, self._stdin = process, process.stdin
        self._up = False
        self.starts += 1
        self._pending = bytearray(self.config.to_json(self._dir).encode() + b"\n")
        self._partial = False
        self._pending += self._snapshot()
        self._flush()

    def _snapshot(self) -> bytes:
        """Messages that bring a child to what it must keep now: each pool's generation,
        then one ``sync`` of every lease held."""
        out = bytearray()
        for pool, generation in self._generation.items():
            out += self._numbered("generation", pool, generation)
        held = {pool: list(ids) for pool, ids in self._held.items() if ids}
        out += self._numbered("sync", held)
        return bytes(out)

    def _numbered(self, *message: Any) -> bytes:
        self._seq += 1
        return _line([self._seq, *message])

    def _send(self, *message: Any) -> int:
        """Queue one message (numbered) and write what the pipe takes; returns its
        number."""
        line = self._numbered(*message)
        if self._stdin is None:
            return self._seq
        self._pending += line
        if len(self._pending) > self._coalesce_at:
            self._coalesce()
        self._flush()
        return self._seq

    def _coalesce(self) -> None:
        """The child is not reading: keep the end of a line it has the start of, and
        replace the rest by a snapshot of what it must keep now."""
        head = b""
        if self._partial:
            head = bytes(self._pending[: self._pending.index(b"\n") + 1])
        snapshot = self._snapshot()
        self._pending = bytearray(head + snapshot)
        # A snapshot larger than the bound must not be rebuilt at every message.
        self._coalesce_at = max(self._max_pending, 2 * len(snapshot))
        self.coalesced += 1
        if self.coalesced == 1 or self.coalesced % 1000 == 0:
            log.warning("lease keeper process %s is not reading its messages: %d times "
                        "replaced by a snapshot of %d lease(s)", self.pid, self.coalesced,
                        sum(len(ids) for ids in self._held.values()))  # fmt: skip

    def _flush(self) -> None:
        """Write what the pipe takes now; the rest waits for the next message (the
        child reads its pipe from a thread of its own, so it rarely waits at all)."""
        if self._stdin is None:
            return
        try:
            while self._pending:
                written = os.write(self._stdin.fileno(), self._pending)
                if written:
                    self._partial = self._pending[written - 1] != ord("\n")
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
        self._partial = False
        self._coalesce_at = self._max_pending

    def stop(self) -> None:
        """Tell the child to exit without handing anything back (the gate releases its
        own leases), wait for it, and remove its state. Blocking."""
        with self._lock:
            self._stopped = True
            process = self._process
            if self._stdin is not None:
                self._pending += self._numbered("stop")
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


def _line(message: list[Any]) -> bytes:
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
        #: The number of the last message applied.
        self.applied = 0
        #: pool -> the number of the last message applied before the renewal that gave
        #: the pool's current proof read the leases it renewed.
        self._proof_seq: dict[str, int] = {}
        self._published: dict[str, list[float]] | None = None

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
        seq, kind, args = int(message[0]), message[1], message[2:]
        if kind == "hold":
            self.keeper.hold(str(args[0]), str(args[1]))
        elif kind == "drop":
            self._drop(str(args[0]), str(args[1]))
        elif kind == "sync":
            self._sync(args[0])
        elif kind == "generation":
            self.keeper.set_generation(str(args[0]), str(args[1]))
        elif kind == "ticked":
            self.keeper.ticked(str(args[0]))
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"unknown message kind {kind!r}")
        with self._lock:
            self.applied = seq

    def _drop(self, pool: str, lease_id: str) -> None:
        self.keeper.drop(pool, lease_id)
        with self._lock:
            self._dropped.setdefault(pool, {})[lease_id] = time.monotonic()

    def _sync(self, held: dict[str, list[str]]) -> None:
        """Keep exactly ``held`` (pool -> lease ids): the gateway's snapshot, which
        replaces the messages it could not write."""
        if not isinstance(held, dict):
            raise TypeError("sync: a JSON object of pool -> lease ids")
        want = {str(pool): [str(i) for i in ids] for pool, ids in held.items()}
        for pool, kept in self.keeper.held().items():
            keep = set(want.get(pool, ()))
            for lease_id in kept:
                if lease_id not in keep:
                    self._drop(pool, lease_id)
        for pool, ids in want.items():
            for lease_id in ids:
                self.keeper.hold(pool, lease_id)

    def run(self) -> None:
        reader = threading.Thread(target=self.read, name="keeper-reader", daemon=True)
        reader.start()
        self._publish()  # an empty file first: the gateway sees the child running
        while True:
            self._wake.wait(self.keeper.check_period_s)
            if self.stopping:
                return
            if self.orphaned or os.getppid() != self._parent:
                self.hand_back()
                return
            self.renew_once()
            self._publish()
            self._forget_old_drops()

    def renew_once(self) -> None:
        """One renewal; each proof it gives is numbered with the last message applied
        before it read the leases."""
        with self._lock:
            seq = self.applied
        before = self.keeper.proofs()
        try:
            self.keeper.keep_once()
        except Exception:  # the process must outlive any one failure
            log.exception("lease keeper process: renewal failed")
        for pool, kept in self.keeper.proofs().items():
            if before.get(pool) != kept:
                self._proof_seq[pool] = seq

    def proofs(self) -> dict[str, list[float]]:
        """What the state file says: pool -> [when the proving renewal was sent, the
        number of the last message it carried]."""
        return {
            pool: [kept, self._proof_seq[pool]]
            for pool, kept in self.keeper.proofs().items()
            if pool in self._proof_seq
        }

    def _publish(self) -> None:
        proofs = self.proofs()
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
