"""``headroom sim``: a continuous-batching speech-engine simulator.

It reproduces the flat-then-knee step-time curve of a GPU serving a streaming speech
model and speaks the upstream protocols (vLLM-Omni speech, vLLM realtime and
transcriptions, SageMaker bidirectional streaming, vLLM metrics), with audible PCM
and injectable faults. See ``docs/sim.md``.

Public API::

    from proxy.sim import running_cluster, describe, preset_names, Faults
"""

from __future__ import annotations

from proxy.sim.capacity import describe
from proxy.sim.cluster import Cluster, running_cluster
from proxy.sim.engine import Engine, EngineSpec
from proxy.sim.faults import Faults
from proxy.sim.gpu import SimGpu, Timeouts
from proxy.sim.presets import DEFAULT_PRESET, PRESETS, Preset, get_preset, preset_names

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "Cluster",
    "Engine",
    "EngineSpec",
    "Faults",
    "Preset",
    "SimGpu",
    "Timeouts",
    "describe",
    "get_preset",
    "preset_names",
    "running_cluster",
]
