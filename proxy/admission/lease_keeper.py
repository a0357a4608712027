"""The lease keeper: this process's leases renewed from a thread of its own.

A gateway's leases must outlive any stall of its event loop -- a large input parsed on
the loop, a long garbage-collector pass, a starved CPU. While the process is alive and
reaches Redis, its leases stay held, so no other gateway can reuse a slot whose stream
is still running here; and the gateway does not end its own sessions (the fence of
:class:`proxy.admission.shared_gate.SharedGate`) only because its loop ran late. A process that
is gone or cut off from Redis stops renewing, and its leases lapse within one TTL.

:class:`LeaseKeeper` runs ``keep.lua`` (:class:`~proxy.admission.redis_backend.LeaseRenewer`)
for each pool in which this process holds leases and whose last renewal -- the gate's
tick or the keeper's own -- is late, over a blocking connection of its own. It looks
:data:`CHECKS_PER_INTERVAL` times per ``interval_s``, so a pool whose tick stopped is
renewed within one interval of that tick, well inside the lease's TTL, and then about
once per interval while the tick stays late. The gate tells it of every grant and
release (:meth:`hold`, :meth:`drop`, under a lock), so it renews only what this process
still holds; it never grants, re-asserts or revives a lease. A renewal that found every
lease it sent still held proves them until the time it was sent plus one TTL; the gate's
fence deadline takes the later of its own tick and that proof (:meth:`kept_age`). Anything else -- a
lease found gone, a new data generation, Redis unreachable -- proves nothing and is
left to the gate's tick, which decides between re-asserting and fencing.

What the keeper cannot do is close connections: if the loop is stalled *and* Redis is
out of reach for longer than ``lease_ttl_s``, the leases lapse while this process's
upstream streams still run (docs/shared-admission.md). A thread stops with the
interpreter (a stall that holds the GIL, SIGSTOP): on Linux the gateway runs this keeper
in a process of its own instead (:mod:`proxy.admission.keeper_process`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from proxy.admission.redis_backend import BackendUnavailable

__all__ = ["CHECKS_PER_INTERVAL", "KeepFunction", "Keeper", "LeaseKeeper"]

log = logging.getLogger("headroom.lease_keeper")

#: ``(pool, generation, lease ids) -> ids not found`` (None: another data generation).
#: Raises :class:`BackendUnavailable` when Redis cannot be reached.
KeepFunction = Callable[[str, str, Sequence[str]], "tuple[str, ...] | None"]

#: How many times per ``interval_s`` the keeper looks for a late pool.
CHECKS_PER_INTERVAL = 4
#: A pool is late once its last renewal is this share of ``interval_s`` old.
LATE_SHARE = 0.75


class Keeper(Protocol):
    """What the shared gate needs of a lease keeper: this thread keeper, or
    :class:`~proxy.admission.keeper_process.ProcessKeeper`, which renews from a process
    of its own. :meth:`start` and :meth:`stop` may block: the gate calls :meth:`stop`
    off the event loop."""

    def hold(self, pool: str, lease_id: str) -> None: ...
    def drop(self, pool: str, lease_id: str) -> None: ...
    def set_generation(self, pool: str, generation: str) -> None: ...
    def ticked(self, pool: str) -> None: ...
    def kept_age(self, pool: str) -> float | None: ...
    def holding(self, pool: str) -> int: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


class LeaseKeeper:
    """Renews the leases the gate holds, on a daemon thread started by :meth:`start`.

    ``monotonic`` is the thread's clock (tests pass a fake one and call
    :meth:`keep_once` instead of starting the thread). Thread-safe: :meth:`hold`,
    :meth:`drop`, :meth:`set_generation` and :meth:`kept_age` are called from the event
    loop while the thread renews."""

    def __init__(
        self,
        keep: KeepFunction,
        *,
        interval_s: float,
        close: Callable[[], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._keep = keep
        self._close = close
        self.interval_s = interval_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        #: pool -> the lease ids this process holds there (a dict keeps grant order).
        self._held: dict[str, dict[str, None]] = {}
        self._generation: dict[str, str] = {}
        #: pool -> when (``monotonic``) the last renewal that proved every lease was sent.
        self._kept: dict[str, float] = {}
        #: pool -> when the gate's own tick last renewed it: while the loop keeps up,
        #: the keeper leaves the pool to it.
        self._ticked: dict[str, float] = {}
        #: pool -> when the keeper last sent a renewal (whatever came of it).
        self._attempted: dict[str, float] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0
        self.failures = 0

    # -- the gate's side (event loop) -------------------------------------------------

    def hold(self, pool: str, lease_id: str) -> None:
        with self._lock:
            self._held.setdefault(pool, {})[lease_id] = None

    def drop(self, pool: str, lease_id: str) -> None:
        with self._lock:
            held = self._held.get(pool)
            if held is not None:
                held.pop(lease_id, None)

    def set_generation(self, pool: str, generation: str) -> None:
        """The data generation the gate's last tick saw for ``pool``: the keeper extends
        leases only within it."""
        with self._lock:
            self._generation[pool] = generation

    def ticked(self, pool: str) -> None:
        """The gate's tick renewed ``pool`` just now: the keeper skips it until the
        tick is late."""
        now = self._monotonic()
        with self._lock:
            self._ticked[pool] = now

    def kept_age(self, pool: str) -> float | None:
        """Seconds since the last renewal of ``pool`` that proved every lease held then
        was sent, or None if there has been none. The caller maps it onto its own
        clock (``now - age``): the two clocks need not share an origin."""
        with self._lock:
            kept = self._kept.get(pool)
        return None if kept is None else max(0.0, self._monotonic() - kept)

    def holding(self, pool: str) -> int:
        with self._lock:
            return len(self._held.get(pool, ()))

    def held(self) -> dict[str, tuple[str, ...]]:
        """pool -> the lease ids this process holds there now."""
        with self._lock:
            return {pool: tuple(ids) for pool, ids in self._held.items() if ids}

    def proofs(self) -> dict[str, float]:
        """pool -> when (``monotonic``) the last renewal that proved every lease was
        sent: what :meth:`kept_age` measures from."""
        with self._lock:
            return dict(self._kept)

    @property
    def check_period_s(self) -> float:
        """How often the keeper looks for late pools (:meth:`keep_once`)."""
        return self.interval_s / CHECKS_PER_INTERVAL

    # -- the thread's side --------------------------------------------------------------

    def keep_once(self) -> None:
        """Renew every pool this process holds leases in whose last renewal, by the
        gate's tick or by the keeper, is late."""
        now = self._monotonic()
        late = now - self.interval_s * LATE_SHARE
        with self._lock:
            work = [
                (pool, self._generation.get(pool, ""), tuple(ids))
                for pool, ids in self._held.items()
                if ids
                and max(self._ticked.get(pool, late), self._attempted.get(pool, late)) <= late
            ]
        for pool, generation, ids in work:
            if not generation:
                continue  # the gate's first tick has not run: nothing to prove against
            sent = self._monotonic()
            with self._lock:
                self._attempted[pool] = sent
            try:
                missing = self._keep(pool, generation, ids)
            except BackendUnavailable as exc:
                self.failures += 1
                log.debug("lease keeper: renewal of pool %s failed: %s", pool, exc)
                continue
            if missing is None:
                continue  # a new data generation: the gate's tick re-asserts
            self.renewals += 1
            with self._lock:
                held = self._held.get(pool, {})
                # A lease released while the call was in flight is not a lost one.
                if not any(lease_id in held for lease_id in missing):
                    self._kept[pool] = max(self._kept.get(pool, sent), sent)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="headroom-lease-keeper",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.check_period_s):
            try:
                self.keep_once()
            except Exception:  # the thread must outlive any one failure
                log.exception("lease keeper: renewal failed")

    def stop(self) -> None:
        """Stop the thread (waits for a renewal in flight, bounded by the client's
        timeout) and close the connection. Blocking: call it off the event loop."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._close is not None:
            self._close()
            self._close = None

    def __repr__(self) -> str:
        with self._lock:
            held = {pool: len(ids) for pool, ids in self._held.items() if ids}
        running = self._thread is not None
        return f"<LeaseKeeper running={running} held={held} renewals={self.renewals}>"
