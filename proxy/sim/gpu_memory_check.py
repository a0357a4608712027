"""The co-location memory check of ``headroom check``: do the engines sharing one GPU fit?

A static check of the configuration against the GPU's memory (no load is run); how
co-located engines slow each other under load is :mod:`proxy.sim.colocated_ceilings`.

Each engine on a GPU is told a share of the GPU's memory (vLLM's
``--gpu-memory-utilization``). From that share it takes its weights and activation peak;
the rest is its KV cache. Two mistakes are common when ASR and TTS share a card:

* the shares sum above 1: the engines over-commit the memory; the one started last
  cannot allocate its KV cache (or pins another's), so the check **refuses** it;
* one engine's share leaves less KV cache than its cap (the replica's
  ``max_sessions``) needs: sessions admitted under the cap then wait inside the engine
  or are preempted, which moves its knee; the check **warns**, naming the share or the
  cap that would fit.

Figures per engine come from a simulator preset (``proxy.sim.presets``: resident
weights, activation peak, KV bytes per token, session length) or from measured values
in the configuration (``weights_gb``, ``activations_gb``, ``kv_bytes_per_session``),
which win. GB = 1e9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from proxy.settings import GpuEngineSettings, GpuSettings, Settings

__all__ = ["EngineFigures", "Finding", "check_gpus", "engine_figures", "gpu_memory"]

GB = 1e9
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of the check: ``error`` refuses the configuration, ``warning`` and
    ``note`` are printed."""

    level: Literal["error", "warning", "note"]
    gpu: str
    message: str

    def __str__(self) -> str:
        return f"gpu {self.gpu}: {self.message}"


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """What the KV check needs of one engine; None where neither source gives it."""

    replica: str
    utilization: float
    max_sessions: int
    weights_bytes: float | None
    activations_bytes: float | None
    kv_bytes_per_session: float | None
    source: str  #: where the figures came from, for the messages

    def kv_cache_bytes(self, memory_bytes: float) -> float | None:
        """The KV cache the share leaves: share - weights - activations."""
        if self.weights_bytes is None:
            return None
        activations = self.activations_bytes or 0.0
        return memory_bytes * self.utilization - self.weights_bytes - activations

    def sessions_held(self, memory_bytes: float) -> int | None:
        """Full-length sessions the KV cache holds at once."""
        kv = self.kv_cache_bytes(memory_bytes)
        if kv is None or self.kv_bytes_per_session is None:
            return None
        return max(0, int(kv // self.kv_bytes_per_session))

    def utilization_needed(self, memory_bytes: float) -> float | None:
        """The smallest share whose KV cache holds ``max_sessions`` sessions."""
        if self.weights_bytes is None or self.kv_bytes_per_session is None:
            return None
        need = self.max_sessions * self.kv_bytes_per_session
        return (self.weights_bytes + (self.activations_bytes or 0.0) + need) / memory_bytes


def engine_figures(engine: GpuEngineSettings, max_sessions: int) -> EngineFigures:
    """The engine's figures: measured ones from the configuration, the rest from its
    preset (if it names one)."""
    weights = None if engine.weights_gb is None else engine.weights_gb * GB
    activations = None if engine.activations_gb is None else engine.activations_gb * GB
    per_session = engine.kv_bytes_per_session
    sources = []
    if engine.preset is not None:
        from proxy.sim.presets import SESSION_S, get_preset

        preset = get_preset(engine.preset)
        if weights is None:
            weights = preset.resident_bytes
        if activations is None:
            activations = preset.activation_bytes
        if per_session is None:
            session_s = engine.session_s or SESSION_S
            per_session = preset.kv_bytes_per_session(session_s)
            sources.append(f"preset {preset.name}, {session_s:g} s sessions")
        else:
            sources.append(f"preset {preset.name}")
    measured = [
        name
        for name, value in (
            ("weights_gb", engine.weights_gb),
            ("activations_gb", engine.activations_gb),
            ("kv_bytes_per_session", engine.kv_bytes_per_session),
        )
        if value is not None
    ]
    if measured:
        sources.insert(0, "measured " + ", ".join(measured))
    return EngineFigures(
        replica=engine.replica,
        utilization=engine.gpu_memory_utilization,
        max_sessions=max_sessions,
        weights_bytes=weights,
        activations_bytes=activations,
        kv_bytes_per_session=per_session,
        source="; ".join(sources) or "no figures",
    )


def gpu_memory(gpu: GpuSettings) -> tuple[float | None, str]:
    """``(bytes, where from)``: ``memory_gb``, else the presets' GPU when they agree."""
    if gpu.memory_gb is not None:
        return gpu.memory_gb * GB, "memory_gb"
    from proxy.sim.presets import get_preset

    cards = {get_preset(e.preset).gpu for e in gpu.engines if e.preset is not None}
    if len(cards) == 1:
        card = next(iter(cards))
        return card.memory_bytes, f"preset GPU {card.name}"
    return None, "presets on different GPUs" if cards else "no memory_gb and no preset"


def _gb(value: float) -> str:
    return f"{value / GB:.1f} GB"


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


def check_gpu(gpu: GpuSettings, engines: list[EngineFigures]) -> list[Finding]:
    """The findings for one GPU (see the module docstring)."""
    out: list[Finding] = []
    total = sum(e.utilization for e in engines)
    shares = " + ".join(f"{e.replica} {e.utilization:g}" for e in engines)
    if total > 1 + _EPS:
        out.append(
            Finding(
                "error",
                gpu.name,
                f"gpu_memory_utilization sums to {total:.2f} ({shares}), above 1: the "
                "engines over-commit the GPU's memory, so the one started last cannot "
                "allocate its KV cache or squeezes another's; lower the shares to sum to "
                "at most 1",
            )
        )
    memory, memory_source = gpu_memory(gpu)
    if memory is None:
        out.append(
            Finding(
                "note",
                gpu.name,
                f"KV cache not checked: the GPU's memory is unknown ({memory_source}); "
                "set memory_gb",
            )
        )
        return out
    for e in engines:
        kv = e.kv_cache_bytes(memory)
        held = e.sessions_held(memory)
        if kv is None or held is None or e.kv_bytes_per_session is None:
            missing = "weights_gb" if e.weights_bytes is None else "kv_bytes_per_session"
            out.append(
                Finding(
                    "note",
                    gpu.name,
                    f"{e.replica}: KV cache not checked (no {missing}; name a preset or "
                    "give measured figures)",
                )
            )
            continue
        share = memory * e.utilization
        needed = e.utilization_needed(memory)
        assert needed is not None
        if kv <= 0:
            out.append(
                Finding(
                    "error",
                    gpu.name,
                    f"{e.replica}: gpu_memory_utilization {e.utilization:g} is "
                    f"{_gb(share)} of {_gb(memory)}, no more than its weights "
                    f"{_gb(e.weights_bytes or 0)} + activations "
                    f"{_gb(e.activations_bytes or 0)}: the engine has no room for a KV "
                    f"cache and cannot start; it needs at least {needed:.2f} for "
                    f"max_sessions {e.max_sessions} ({e.source})",
                )
            )
        elif held < e.max_sessions:
            out.append(
                Finding(
                    "warning",
                    gpu.name,
                    f"{e.replica}: gpu_memory_utilization {e.utilization:g} leaves a "
                    f"{_gb(kv)} KV cache, {held} sessions of "
                    f"{_mb(e.kv_bytes_per_session)}, fewer than max_sessions "
                    f"{e.max_sessions} (needs {_gb(e.max_sessions * e.kv_bytes_per_session)}): "
                    "sessions past it wait inside the engine or are preempted; raise "
                    f"gpu_memory_utilization to {needed:.2f} or lower max_sessions to "
                    f"{held} ({e.source})",
                )
            )
    return out


def summary_lines(gpu: GpuSettings, engines: list[EngineFigures]) -> list[str]:
    """The GPU's lines for ``headroom check``'s summary."""
    memory, source = gpu_memory(gpu)
    total = sum(e.utilization for e in engines)
    size = f"{_gb(memory)} ({source})" if memory is not None else "memory unknown"
    lines = [f"  {gpu.name}: {size}, gpu_memory_utilization {total:.2f} in all"]
    for e in engines:
        held = None if memory is None else e.sessions_held(memory)
        kv = None if memory is None else e.kv_cache_bytes(memory)
        if held is None or kv is None or e.kv_bytes_per_session is None:
            fit = "KV not checked"
        else:
            fit = (
                f"KV cache {_gb(max(kv, 0.0))} = {held} sessions of "
                f"{_mb(e.kv_bytes_per_session)} (max_sessions {e.max_sessions})"
            )
        lines.append(f"    {e.replica}  {e.utilization:g}  {fit}  [{e.source}]")
    return lines


def _figures(settings: Settings, gpu: GpuSettings) -> list[EngineFigures]:
    out = []
    for engine in gpu.engines:
        pool = settings.pool(engine.pool)
        replica = next(r for r in pool.replicas if r.name == engine.replica_name)
        out.append(engine_figures(engine, replica.max_sessions))
    return out


def check_gpus(settings: Settings) -> tuple[list[str], list[Finding]]:
    """``(summary lines, findings)`` for every GPU in ``settings.gpus``; both empty when
    the configuration declares no shared GPUs."""
    lines: list[str] = []
    findings: list[Finding] = []
    if settings.gpus:
        lines.append(f"gpus    {len(settings.gpus)} (co-location)")
    for gpu in settings.gpus:
        engines = _figures(settings, gpu)
        lines += summary_lines(gpu, engines)
        findings += check_gpu(gpu, engines)
    return lines, findings
