"""The models of co-location: physical GPUs and the engines (replicas) sharing each.

Optional. Read only by ``headroom check`` (proxy.sim.gpu_memory_check): the gateway
routes the same with or without it. Cross-references (replicas exist, each on one GPU)
are checked in proxy.settings.references (_gpu_problems), with the other
cross-references.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from proxy.settings.environment import Problems, did_you_mean
from proxy.settings.fields import Frozen, Name, PositiveSeconds

__all__ = ["GpuEngineSettings", "GpuSettings"]


def _check_replica_ref(value: str) -> str:
    pool, sep, replica = value.partition("/")
    if (
        not sep
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", pool)
        or not re.fullmatch(r"[A-Za-z0-9_.-]+", replica)
    ):
        raise ValueError(f"must be 'pool/replica', e.g. 'tts-main/gpu0' (got {value!r})")
    return value


def _check_preset(value: str) -> str:
    from proxy.sim.presets import PRESETS  # the simulator's figures; imported only when named

    if value not in PRESETS:
        raise ValueError(
            f"unknown preset {value!r}{did_you_mean(value, list(PRESETS))}; presets: "
            + ", ".join(PRESETS)
        )
    return value


class GpuEngineSettings(Frozen):
    """One engine (a replica) on a shared GPU: its ``gpu_memory_utilization`` (vLLM's
    ``--gpu-memory-utilization``, a share of the whole GPU's memory) and where the KV
    cache figures come from: a simulator ``preset`` and/or measured ``weights_gb``,
    ``activations_gb`` and ``kv_bytes_per_session`` (measured figures win). GB = 1e9
    bytes. ``session_s`` (default 20) is the audio a session holds in KV when the
    per-session figure comes from the preset."""

    replica: Annotated[str, AfterValidator(_check_replica_ref)]
    gpu_memory_utilization: float = Field(gt=0, le=1)
    preset: Annotated[str, AfterValidator(_check_preset)] | None = None
    weights_gb: float | None = Field(None, gt=0)
    activations_gb: float | None = Field(None, ge=0)
    kv_bytes_per_session: float | None = Field(None, gt=0)
    session_s: PositiveSeconds | None = None

    @model_validator(mode="after")
    def _session_source(self) -> GpuEngineSettings:
        if self.session_s is not None and self.kv_bytes_per_session is not None:
            why = "has no effect with kv_bytes_per_session (a measured figure); drop one"
            raise Problems([(("session_s",), why)])
        if self.session_s is not None and self.preset is None:
            why = "needs a preset (it sizes the preset's per-session KV figure)"
            raise Problems([(("session_s",), why)])
        return self

    @property
    def pool(self) -> str:
        return self.replica.partition("/")[0]

    @property
    def replica_name(self) -> str:
        return self.replica.partition("/")[2]


class GpuSettings(Frozen):
    """A physical GPU shared by the engines listed (co-location). ``memory_gb`` defaults
    to the memory of the presets' GPU when the engines name presets."""

    name: Name
    memory_gb: float | None = Field(None, gt=0)
    engines: tuple[GpuEngineSettings, ...] = Field(min_length=1)
