"""Headroom left per pool, and the limiting stage of each configured pipeline.

A voice agent uses several pools at once (ASR, then TTS); the call is only as good as the
stage nearest its knee. This module measures, per pool, how much is left:

* **slots**: ``slots_usable`` is the cap summed over the replicas that take sessions now
  (healthy, not retired, not held by the guard in ``enforce`` mode); ``slots_free`` the
  free slots on those, ``max(0, cap - active)`` each. On the ``redis`` admission backend
  ``active`` is the pool-wide count the shared gate read at its last renewal (every
  gateway's sessions; never less than this gateway's own), so every gateway reports the
  same figure.
* **delivery**: the lowest rolling worst-1% delivery ratio among those replicas (the
  guard's signal, :class:`proxy.metering.rolling.ReplicaSignals`; None without recent audio, e.g.
  an ASR pool) against ``guard.threshold``: ``delivery_margin = ratio / threshold - 1``
  (0 at the threshold, negative below it). On the ``redis`` backend it is this gateway's
  sessions' view.
* **left**: one figure in 0..1 to compare stages, ``min(slots_free / slots_usable,
  clamp(delivery_margin, 0, 1))`` (the delivery term only when there is a ratio); 0 when
  no replica is usable. A pool with half its slots free whose listeners are already near
  the threshold is nearer its knee than its slots say.

A pipeline's **limiting stage** is the stage with the least ``left``; ties go to the one
with fewer free slots, then to the earlier stage. Pure: the caller passes ``now`` (through
``ratio``) and the gate's snapshots; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.admission import PoolStatistics

if TYPE_CHECKING:
    from proxy.runtime import Runtime

__all__ = [
    "HeadroomReport",
    "PipelineHeadroom",
    "PoolHeadroom",
    "headroom_of",
    "limiting_stage",
    "pipeline_headroom",
    "pool_headroom",
]


@dataclass(frozen=True, slots=True)
class PoolHeadroom:
    """How far one pool is from its knee; see the module docstring."""

    pool: str
    slots_usable: int
    slots_free: int
    delivery_ratio_worst_1pct: float | None
    threshold: float

    @property
    def slots_free_ratio(self) -> float:
        """Free slots as a share of the usable cap (0 when nothing is usable)."""
        return self.slots_free / self.slots_usable if self.slots_usable > 0 else 0.0

    @property
    def delivery_margin(self) -> float | None:
        """``ratio / threshold - 1``: 0 at the guard threshold, negative below it."""
        ratio = self.delivery_ratio_worst_1pct
        return None if ratio is None else ratio / self.threshold - 1.0

    @property
    def left(self) -> float:
        """Headroom left, 0..1: the lesser of the free-slot share and the delivery margin
        (capped to 0..1)."""
        left = self.slots_free_ratio
        margin = self.delivery_margin
        if margin is not None:
            left = min(left, max(0.0, min(1.0, margin)))
        return left

    def as_json(self) -> dict[str, float | int | None]:
        """The pool's figures as ``/admin/status`` shows them: ratios rounded to four places, the
        delivery ratio and margin None without recent audio."""
        margin = self.delivery_margin
        ratio = self.delivery_ratio_worst_1pct
        return {
            "slots_usable": self.slots_usable,
            "slots_free": self.slots_free,
            "slots_free_ratio": round(self.slots_free_ratio, 4),
            "delivery_ratio_worst_1pct": None if ratio is None else round(ratio, 4),
            "delivery_threshold": self.threshold,
            "delivery_margin": None if margin is None else round(margin, 4),
            "left": round(self.left, 4),
        }


@dataclass(frozen=True, slots=True)
class PipelineHeadroom:
    """One pipeline's stages (in configured order) and the one limiting it."""

    name: str
    stages: tuple[PoolHeadroom, ...]
    limiting: str

    @property
    def left(self) -> float:
        """The limiting stage's headroom left."""
        return next(s.left for s in self.stages if s.pool == self.limiting)

    def as_json(self) -> dict[str, object]:
        """The limiting stage, its headroom left and every stage's figures
        (:meth:`PoolHeadroom.as_json` with its pool)."""
        return {
            "limiting_stage": self.limiting,
            "left": round(self.left, 4),
            "stages": [{"pool": s.pool, **s.as_json()} for s in self.stages],
        }


@dataclass(frozen=True, slots=True)
class HeadroomReport:
    """Every pool's headroom and every pipeline's limiting stage, at one instant."""

    pools: tuple[PoolHeadroom, ...]
    pipelines: tuple[PipelineHeadroom, ...]


def pool_headroom(
    stats: PoolStatistics,
    *,
    ratio: Callable[[str], float | None],
    threshold: float,
    held: Mapping[str, int] | None = None,
) -> PoolHeadroom:
    """The headroom of the pool ``stats`` describes. ``ratio(replica)`` is the replica's
    rolling worst-1% delivery ratio; ``held`` the sessions per replica over every
    gateway sharing the pool (the gate's ``held_per_replica``), which replace this
    gateway's own count when higher."""
    usable = free = 0
    worst: float | None = None
    for r in stats.replicas:
        if not r.healthy or r.retired or r.guarded:
            continue
        active = max(r.active, held.get(r.name, 0)) if held is not None else r.active
        usable += r.cap
        free += max(0, r.cap - active)
        value = ratio(r.name)
        if value is not None and (worst is None or value < worst):
            worst = value
    return PoolHeadroom(stats.name, usable, free, worst, threshold)


def limiting_stage(stages: Sequence[PoolHeadroom]) -> str:
    """The stage with the least headroom left (ties: fewer free slots, then the earlier)."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    order = range(len(stages))
    best = min(order, key=lambda i: (stages[i].left, stages[i].slots_free, i))
    return stages[best].pool


def pipeline_headroom(
    name: str, stages: Sequence[str], pools: Mapping[str, PoolHeadroom]
) -> PipelineHeadroom | None:
    """The pipeline over ``stages``; None when a stage is no running pool (a reload that
    removed it is refused by the settings, so only a pool being retired can be missing)."""
    found = [pools[s] for s in stages if s in pools]
    if len(found) != len(stages):
        return None
    return PipelineHeadroom(name, tuple(found), limiting_stage(found))


def headroom_of(runtime: Runtime) -> HeadroomReport:
    """Every pool's headroom and every configured pipeline's limiting stage, now."""
    gate = runtime.gate
    settings = runtime.settings
    threshold = settings.guard.threshold
    configured = {p.name for p in settings.pools}
    pools: dict[str, PoolHeadroom] = {}
    for name, stats in gate.statistics().items():
        if name not in configured:
            continue  # retired by a reload; its last sessions are finishing
        held = gate.held_per_replica(name)

        def ratio(replica: str, pool: str = name) -> float | None:
            return runtime.delivery_ratio_worst_1pct(pool, replica)

        pools[name] = pool_headroom(stats, ratio=ratio, threshold=threshold, held=held)
    pipelines = [pipeline_headroom(p.name, p.stages, pools) for p in settings.pipelines]
    return HeadroomReport(tuple(pools.values()), tuple(p for p in pipelines if p is not None))
