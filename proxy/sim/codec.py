"""The codec stage on the talker's GPU: what a batched call costs and what it takes
from the talker.

:class:`~proxy.sim.spec.CodecSpec` is a codec with a card of its own: a call costs
``call_s`` plus ``frame_s`` per frame of every chunk in it, and the talker never
notices. :class:`SharedCodecSpec` is Code2Wav as vLLM-Omni deploys it beside the
talker on one card:

- a batched call decodes its chunks as one padded tensor, so with ``pad`` every chunk
  in the call costs the frames of the longest one (a two-frame first chunk batched with
  full chunks costs a full chunk);
- the call's kernels take GPU time from the talker: the talker step that runs beside a
  call is ``gpu_share`` of the call's frame work longer (0: separate cards, 1: the
  talker waits for all of it). ``call_s`` is the call's fixed latency (host work,
  launches, synchronisation), which takes nothing from the talker.

So batching the codec amortises ``call_s`` over the chunks of a call and lets a first
chunk ride with the next call instead of waiting behind every queued chunk, but the
padded frames slow the talker: the trade-off vLLM-Omni's cross-request Code2Wav
batching shows (docs/sim.md §1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.sim.spec import CodecSpec

__all__ = ["SharedCodecSpec", "call_time", "talker_delay"]


@dataclass(frozen=True, slots=True)
class SharedCodecSpec(CodecSpec):
    """A codec stage sharing the talker's GPU (see the module docstring)."""

    pad: bool = True  #: a batched call pays every chunk at its longest chunk's frames
    gpu_share: float = 0.0  #: part of each call's frame work the talker step beside it loses

    def __post_init__(self) -> None:
        CodecSpec.__post_init__(self)
        if not 0.0 <= self.gpu_share <= 1.0:
            raise ValueError("codec gpu_share must be in [0, 1]")


def call_time(codec: CodecSpec, frames: Sequence[int]) -> float:
    """Seconds one codec call takes for chunks of ``frames`` frames each (left context
    included)."""
    if isinstance(codec, SharedCodecSpec) and codec.pad and frames:
        return codec.call_time(max(frames) * len(frames))
    return codec.call_time(sum(frames))


def talker_delay(codec: CodecSpec, seconds: float) -> float:
    """How much a codec call of ``seconds`` lengthens the talker step beside it: its
    share of the call's frame work."""
    if not isinstance(codec, SharedCodecSpec):
        return 0.0
    return codec.gpu_share * max(0.0, seconds - codec.call_s)
