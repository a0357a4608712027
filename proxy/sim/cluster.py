"""Several simulated GPUs in one process: the programmatic API of ``headroom sim``.

::

    async with running_cluster(preset="l40s-qwen3tts-1.7b", gpus=2, port=0) as cluster:
        cluster.urls              # ["http://127.0.0.1:41234", "http://127.0.0.1:41235"]
        cluster.gpus[0].engine    # the engine model (stats(), ...)
        await cluster.set_faults(Faults(drop_after_chunks=3), gpu=1)

GPU ``i`` listens on ``port + i`` (every GPU on a free port when ``port`` is 0). Each
GPU runs one asyncio task for its step loop plus its own uvicorn server, all in the
running event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from proxy.sim.engine import Engine
from proxy.sim.faults import Faults
from proxy.sim.gpu import SimGpu, Timeouts
from proxy.sim.presets import DEFAULT_PRESET, Preset, get_preset

__all__ = ["Cluster", "running_cluster"]


@dataclass(slots=True)
class Cluster:
    """Running simulated GPUs (one per port)."""

    preset: Preset
    gpus: list[SimGpu]

    @property
    def urls(self) -> list[str]:
        """HTTP base URLs, one per GPU (WebSocket URLs: :attr:`ws_urls`)."""
        return [gpu.url for gpu in self.gpus]

    @property
    def ws_urls(self) -> list[str]:
        """Each GPU's WebSocket base URL, in GPU order."""
        return [gpu.ws_url for gpu in self.gpus]

    @property
    def engines(self) -> list[Engine]:
        """Each GPU's simulated engine, in GPU order."""
        return [gpu.engine for gpu in self.gpus]

    @property
    def faults(self) -> list[Faults]:
        """The faults each GPU injects now, in GPU order."""
        return [gpu.faults for gpu in self.gpus]

    async def set_faults(self, faults: Faults, gpu: int | None = None) -> None:
        """Replace the faults of one GPU, or of all when ``gpu`` is None."""
        targets = self.gpus if gpu is None else [self.gpus[gpu]]
        for target in targets:
            await target.set_faults(faults)

    async def clear_faults(self) -> None:
        """Stop injecting faults on every GPU."""
        await self.set_faults(Faults())

    def __repr__(self) -> str:
        return f"<Cluster {self.preset.name} x{len(self.gpus)} {self.urls}>"


@contextlib.asynccontextmanager
async def running_cluster(
    preset: str | Preset = DEFAULT_PRESET,
    gpus: int = 1,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    faults: Faults | Sequence[Faults] | Mapping[int, Faults] | None = None,
    timeouts: Timeouts | None = None,
) -> AsyncIterator[Cluster]:
    """Serve ``gpus`` simulated GPUs of ``preset`` for the ``async with`` block.

    ``faults``: one :class:`Faults` for every GPU, a sequence (one per GPU) or a
    mapping ``{gpu index: Faults}``. ``timeouts``: the speech WebSocket's config and
    idle limits (vLLM-Omni: 10 s and 30 s). Every stream is ended and every port
    released on exit.
    """
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    chosen = preset if isinstance(preset, Preset) else get_preset(preset)
    per_gpu: list[Faults] = []
    for i in range(gpus):
        if faults is None:
            per_gpu.append(Faults())
        elif isinstance(faults, Faults):
            per_gpu.append(faults)
        elif isinstance(faults, Mapping):
            per_gpu.append(faults.get(i, Faults()))
        else:
            per_gpu.append(faults[i] if i < len(faults) else Faults())
    members = [
        SimGpu(
            chosen,
            index=i,
            seed=seed,
            faults=per_gpu[i],
            timeouts=timeouts,
            host=host,
            port=port + i if port else 0,
        )
        for i in range(gpus)
    ]
    for member in members:
        member.cluster = members
    try:
        for member in members:
            await member.start()
        yield Cluster(chosen, members)
    finally:
        for member in reversed(members):
            await member.stop()  # safe on a GPU that never (fully) started
