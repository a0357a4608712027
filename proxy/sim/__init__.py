"""``headroom sim``: a continuous-batching speech-engine simulator.

It reproduces the flat-then-knee step-time curve of a GPU serving a streaming speech
model and speaks the upstream protocols (vLLM-Omni speech, vLLM realtime and
transcriptions, SageMaker bidirectional streaming, vLLM metrics), with audible PCM
and injectable faults. See ``docs/sim.md``.

The package, by concern:

* the model, pure: :mod:`~proxy.sim.engine` (continuous batching on one GPU),
  :mod:`~proxy.sim.spec` (one GPU's figures), :mod:`~proxy.sim.presets` (representative
  GPU and model deployments), :mod:`~proxy.sim.chunks` (chunk schedules),
  :mod:`~proxy.sim.codec` (the codec stage) and :mod:`~proxy.sim.audio` (deterministic
  speech-like PCM);
* one simulated GPU serving: :mod:`~proxy.sim.gpu` (engine, step loop, faults, port),
  :mod:`~proxy.sim.engine_runner` (the engine driven in real time),
  :mod:`~proxy.sim.gpu_app` (its ASGI app), :mod:`~proxy.sim.faults` (what it does wrong
  on purpose), :mod:`~proxy.sim.connections` (its connections, for faults to abort) and
  :mod:`~proxy.sim.cluster` (several GPUs in one process);
* the upstream protocols: :mod:`~proxy.sim.speech_http`, :mod:`~proxy.sim.speech_ws_api`
  and :mod:`~proxy.sim.tts` (speech out), :mod:`~proxy.sim.realtime_api` and
  :mod:`~proxy.sim.transcription` with :mod:`~proxy.sim.multipart` (speech in),
  :mod:`~proxy.sim.completions_api` (codec tokens as text),
  :mod:`~proxy.sim.engine_metrics` (vLLM's ``/metrics``) and :mod:`~proxy.sim.common`
  (what they share);
* capacity without real time: :mod:`~proxy.sim.virtual_load` (closed-loop load on a
  virtual clock and the ceiling it finds), :mod:`~proxy.sim.capacity` (a preset's
  capacity as ``--describe`` reports it), :mod:`~proxy.sim.colocated_ceilings` (two
  engines on one GPU), :mod:`~proxy.sim.bypass` (streams that reach a GPU without a
  gateway) and :mod:`~proxy.sim.gpu_memory_check` (whether engines sharing a GPU fit, for
  ``headroom check``);
* checks against the real thing: :mod:`~proxy.sim.validate` with
  :mod:`~proxy.sim.validate_data` and :mod:`~proxy.sim.codec_presets` (the published
  figures' table) and :mod:`~proxy.sim.calibrate` (a preset fitted to a live engine);
* :mod:`~proxy.sim.sim_command` (``headroom sim``) and ``__main__``
  (``python -m proxy.sim``).

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
