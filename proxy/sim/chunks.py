"""Chunk schedules: how many codec frames each audio chunk of a stream carries.

Engines do not cut a stream into equal chunks. What they ship (docs/sim.md §1):

- **vLLM-Omni Qwen3-TTS** picks the *first* chunk from the load when the request
  starts: 2, 4, 8 or 16 frames as the running requests fill a quarter, a half,
  three quarters or more of ``max_num_seqs`` (small first chunks when the card is
  idle, bigger ones when each step is slow, so the next chunk arrives before the first
  has played). ``initial_codec_chunk_frames`` fixes the first chunk instead, and
  ``codec_chunk_ramp`` (e.g. ``[4, 4, 8, 16, 25]``) replaces it with a ramp. Then
  ``codec_chunk_frames`` (25) per chunk.
- **Voxtral TTS** sends five 5-frame chunks, then 25-frame ones.
- **CosyVoice 2** doubles its hop: 25, 50, then 100 tokens (1 s, 2 s, 4 s).
- **Orpheus** emits once 28 tokens exist, then every 7.

A :class:`ChunkSchedule` is pure data; :meth:`ChunkSchedule.plan` turns it into the
initial chunk sizes of one stream given the load at its start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["LOAD_FIRST_CHUNKS", "ChunkSchedule", "parse_ramp"]

#: vLLM-Omni Qwen3-TTS's load-dependent first chunk (frames), by load quartile.
LOAD_FIRST_CHUNKS = (2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class ChunkSchedule:
    """``initial`` chunks (frames), then ``steady`` ones; with ``load_first`` the first
    chunk is chosen by load instead (one entry per load band, equal-width bands of
    ``running / max_num_seqs``). ``left_context`` is how many earlier frames the codec
    decodes again with each chunk (a sliding-window decoder's history)."""

    steady: int
    initial: tuple[int, ...] = ()
    load_first: tuple[int, ...] = ()
    left_context: int = 0

    def __post_init__(self) -> None:
        sizes = (self.steady, *self.initial, *self.load_first)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError("chunk sizes must be integers >= 1")
        if self.left_context < 0:
            raise ValueError("left_context must be >= 0")

    @classmethod
    def simple(cls, first: int, steady: int) -> ChunkSchedule:
        """One first chunk of ``first`` frames, then ``steady`` (the old two-size form)."""
        return cls(steady=steady, initial=(first,))

    def plan(self, running: int, max_num_seqs: int) -> tuple[int, ...]:
        """The initial chunk sizes of a stream admitted while ``running`` sequences
        (itself included) are in a batch of at most ``max_num_seqs``."""
        if not self.load_first:
            return self.initial
        load = min(max(running, 1) / max(max_num_seqs, 1), 1.0)
        bands = len(self.load_first)
        band = min(bands - 1, max(0, math.ceil(load * bands - 1e-9) - 1))
        return (self.load_first[band], *self.initial)

    def with_first(self, frames: int) -> ChunkSchedule:
        """``initial_codec_chunk_frames``: a fixed first chunk, then steady chunks."""
        return replace(self, initial=(frames,), load_first=())

    def with_ramp(self, ramp: tuple[int, ...]) -> ChunkSchedule:
        """``codec_chunk_ramp``: these initial chunks instead of the default start."""
        return replace(self, initial=tuple(ramp), load_first=())

    def describe(self) -> str:
        """A short human form, e.g. ``load 2/4/8/16, then 25`` or ``5x5, then 25``."""
        parts = []
        if self.load_first:
            parts.append("load " + "/".join(map(str, self.load_first)))
        if self.initial:
            if len(set(self.initial)) == 1 and len(self.initial) > 1:
                parts.append(f"{len(self.initial)}x{self.initial[0]}")
            else:
                parts.append(", ".join(map(str, self.initial)))
        parts.append(f"then {self.steady}")
        return ", ".join(parts)


def parse_ramp(text: str) -> tuple[int, ...]:
    """``"4,4,8,16,25"`` -> ``(4, 4, 8, 16, 25)``; ``ValueError`` says what is wrong."""
    try:
        ramp = tuple(int(p) for p in text.replace(" ", "").strip("[]").split(",") if p)
    except ValueError:
        raise ValueError(f"a chunk ramp is integers separated by commas, got {text!r}") from None
    if not ramp or min(ramp) < 1:
        raise ValueError(f"a chunk ramp needs frames >= 1, got {text!r}")
    return ramp
