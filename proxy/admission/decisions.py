"""Frozen decision records returned by the admission core.

The core never performs I/O; it returns these and the asyncio layer acts on them.
Every refusal carries a reason code of docs/contracts.md.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Admit",
    "Decision",
    "Enqueue",
    "PoolStatistics",
    "Reject",
    "ReplicaSpec",
    "ReplicaStatistics",
    "QueuePolicy",
]


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One upstream endpoint (one GPU) and its hard session cap."""

    name: str
    max_sessions: int

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"replica {self.name!r}: max_sessions must be >= 1")


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """The pool's FIFO: at most ``max_depth`` waiters, each for at most ``max_wait_s``.

    ``max_depth == 0`` or ``max_wait_s == 0`` means no queue: refuse at once when full.
    """

    max_depth: int = 0
    max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_depth < 0 or self.max_wait_s < 0:
            raise ValueError("queue limits must be >= 0")

    @property
    def enabled(self) -> bool:
        """Whether the pool queues at all: both ``max_depth`` and ``max_wait_s`` above 0."""
        return self.max_depth > 0 and self.max_wait_s > 0


@dataclass(frozen=True, slots=True)
class Admit:
    """``ticket`` holds a slot on ``replica`` from now until it is released."""

    ticket: int
    replica: str
    waited_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Enqueue:
    """``ticket`` waits at ``position`` (1 = next) until ``deadline``. ``displaced``:
    sheddable waiters refused (``preempted_in_queue``) to make room for it."""

    ticket: int
    position: int
    deadline: float
    eta_s: float
    displaced: tuple[Reject, ...] = ()


@dataclass(frozen=True, slots=True)
class Reject:
    """``ticket`` is refused with a reason code (docs/contracts.md)."""

    ticket: int
    reason: str
    retry_after_s: float
    queue_position: int | None = None
    waited_s: float = 0.0


Decision = Admit | Enqueue | Reject


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    name: str
    active: int
    cap: int
    healthy: bool
    guarded: bool
    retired: bool

    @property
    def free(self) -> int:
        """Slots left under the cap (0 when a lowered cap is already exceeded)."""
        return max(0, self.cap - self.active)


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of one pool, for metrics, ``/readyz`` and tests."""

    name: str
    replicas: tuple[ReplicaStatistics, ...]
    queue_depth: int
    max_depth: int
    max_wait_s: float
    draining: bool
    session_estimate_s: float

    @property
    def active(self) -> int:
        """Sessions holding a slot, retired replicas included."""
        return sum(r.active for r in self.replicas)

    @property
    def slots(self) -> int:
        """The pool's capacity: the caps of its replicas not retired (healthy or not)."""
        return sum(r.cap for r in self.replicas if not r.retired)

    @property
    def healthy_replicas(self) -> int:
        """Replicas not retired and passing health checks (guarded ones included)."""
        return sum(1 for r in self.replicas if r.healthy and not r.retired)
