"""Two engines on one simulated GPU: each engine's ceiling alone and beside the other.

The load is :func:`proxy.sim.virtual_load.run_colocated`'s: each engine keeps its own
batch, KV cache and step formula, but the GPU runs one step at a time, so while both
engines have work their steps alternate and each engine's token rate is set by the sum
of the two step times. Each slows the other, and both cross their knee at a lower
concurrency than alone: the shared knee. Each engine's KV cache comes from its
``gpu_memory_utilization`` share (:meth:`Preset.with_utilization`).

:func:`colocated_ceiling` ramps one engine while the other holds a fixed load, with the
probe's search (:func:`proxy.probe.ceiling.largest_passing`); :func:`describe_colocated`
puts each engine's ceiling alone next to its ceiling beside the other (``headroom sim
--colocate A,B``). Whether a configuration's shares fit the GPU's memory at all is
:mod:`proxy.sim.gpu_memory_check` (``headroom check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.probe.ceiling import doubling, largest_passing
from proxy.sim.presets import Preset, get_preset
from proxy.sim.virtual_load import Rules, run_colocated

__all__ = ["colocated_ceiling", "colocated_presets", "describe_colocated"]


def colocated_presets(names: Sequence[str], utilization: Sequence[float]) -> list[Preset]:
    """The named presets, each resized to its ``gpu_memory_utilization`` share of one
    GPU; ``ValueError`` unless they run on the same GPU and the shares sum to <= 1."""
    if len(names) != 2 or len(utilization) != 2:
        raise ValueError("co-location takes two presets and two gpu_memory_utilization shares")
    presets = [get_preset(name) for name in names]
    if presets[0].gpu != presets[1].gpu:
        raise ValueError(
            f"{names[0]} runs on {presets[0].gpu.name} and {names[1]} on "
            f"{presets[1].gpu.name}: co-located presets must share one GPU model"
        )
    if not all(0 < u <= 1 for u in utilization):
        raise ValueError("each gpu_memory_utilization must be in (0, 1]")
    if sum(utilization) > 1 + 1e-9:
        raise ValueError(
            f"gpu_memory_utilization {' + '.join(f'{u:g}' for u in utilization)} sums "
            "above 1: the engines would over-commit the GPU's memory"
        )
    return [p.with_utilization(u) for p, u in zip(presets, utilization, strict=True)]


def colocated_ceiling(
    target: Preset,
    other: Preset,
    other_load: int,
    *,
    seed: int = 0,
    rules: Rules | None = None,
) -> int:
    """The ceiling of ``target`` (describe's rules) while ``other`` holds ``other_load``
    streams on the same GPU. ``other_load`` 0: the ceiling alone (at ``target``'s own KV
    cache)."""
    rules = rules or Rules()

    def passes(n: int) -> bool:
        result = run_colocated([(target, n), (other, other_load)], seed=seed)[0]
        assert result is not None
        return not rules.failed(result)

    return largest_passing(passes, doubling(1024))


def describe_colocated(
    names: Sequence[str], utilization: Sequence[float] = (0.45, 0.45), *, seed: int = 0
) -> dict[str, Any]:
    """Each engine's ceiling alone on the whole GPU (its preset), alone at its memory
    share, and beside the other engine holding half of *its* ceiling at its share; then
    ``shared_percent``: the largest p such that both engines together, each at p % of
    its ceiling at its share, pass (100 would mean they do not slow each other)."""
    shared = colocated_presets(names, utilization)
    rules = Rules()
    alone = [colocated_ceiling(get_preset(n), shared[0], 0, seed=seed) for n in names]
    at_share = [colocated_ceiling(p, p, 0, seed=seed) for p in shared]
    engines: list[dict[str, Any]] = []
    for i, preset in enumerate(shared):
        other = shared[1 - i]
        background = max(1, at_share[1 - i] // 2)
        beside = colocated_ceiling(preset, other, background, seed=seed)
        engines.append({
            "preset": preset.name,
            "kind": preset.kind,
            "gpu_memory_utilization": utilization[i],
            "kv_cache_gib": round(preset.engine.kv_budget_bytes / 2**30, 2),
            "ceiling_alone": alone[i],
            "ceiling_alone_at_share": at_share[i],
            "other_streams": background,
            "ceiling_beside_other": beside,
        })  # fmt: skip

    def both_pass(percent: int) -> bool:
        loads = [
            (p, max(1, round(c * percent / 100))) for p, c in zip(shared, at_share, strict=True)
        ]
        results = run_colocated(loads, seed=seed)
        return all(r is not None and not rules.failed(r) for r in results)

    return {
        "gpu": shared[0].gpu.name,
        "model": "time-sliced: one step at a time on the GPU",
        "engines": engines,
        "shared_percent": largest_passing(both_pass, (100,)) if all(at_share) else 0,
        "ceiling_rules": {
            "threshold": rules.threshold,
            "max_stall_share": rules.max_stall_share,
            "ttfa_p99_s": rules.ttfa_p99_s,
        },
        "seed": seed,
    }
