"""The codec stage: its queue of chunks, what a batched call costs, and what a codec on
the talker's GPU takes from the talker.

:class:`~proxy.sim.spec.CodecSpec` is a codec with a card of its own: a FIFO queue of
chunks, up to ``batch`` of them decoded per call at ``call_s`` plus ``frame_s`` per
frame of every chunk in it, and the talker never notices. :class:`SharedCodecSpec` is
Code2Wav as vLLM-Omni deploys it beside the talker on one card:

- a batched call decodes its chunks as one padded tensor, so with ``pad`` every chunk
  in the call costs the frames of the longest one (a two-frame first chunk batched with
  full chunks costs a full chunk);
- a single-chunk call replays a captured CUDA graph; a call of more than one chunk
  is taken to run its decoder eagerly and pays ``eager_s`` more GPU work (kernel
  launches and unfused kernels), whatever its batch size;
- the call's GPU work takes time from the talker: the talker step that runs beside a
  call is ``gpu_share`` of the call's frame and eager work longer (0: separate cards,
  1: the talker waits for all of it). ``call_s`` is the call's fixed latency (host
  work, synchronisation), which takes nothing from the talker;
- with ``request_slots`` the stage schedules requests, not chunks, as vLLM-Omni's
  Code2Wav stage does (an engine whose ``max_num_seqs`` is the codec batch): a request
  takes one of ``batch`` slots with its first chunk, first come first served, and
  holds it until its last chunk is decoded; a call decodes the oldest ready chunk of
  each request holding a slot, so at batch 1 a new request's first chunk waits for
  every older request to finish.

So batching the codec lets more requests into the stage and amortises ``call_s`` over
the chunks of a call, which cuts time to first audio, but its padded, eager calls slow
the talker: the trade-off vLLM-Omni's cross-request Code2Wav batching shows
(docs/sim.md §1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from proxy.sim.spec import CodecSpec

__all__ = ["CodecJob", "CodecQueue", "SharedCodecSpec", "call_time", "talker_delay"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SharedCodecSpec(CodecSpec):
    """A codec stage sharing the talker's GPU (see the module docstring)."""

    pad: bool = True  #: a batched call pays every chunk at its longest chunk's frames
    gpu_share: float = 0.0  #: part of each call's GPU work the talker step beside it loses
    eager_s: float = 0.0  #: GPU work a call of more than one chunk adds (no captured graph)
    request_slots: bool = False  #: ``batch`` requests hold the stage, one chunk each a call

    def __post_init__(self) -> None:
        CodecSpec.__post_init__(self)
        if not 0.0 <= self.gpu_share <= 1.0:
            raise ValueError("codec gpu_share must be in [0, 1]")
        if self.eager_s < 0.0:
            raise ValueError("codec eager_s must be >= 0")


def call_time(codec: CodecSpec, frames: Sequence[int]) -> float:
    """Seconds one codec call takes for chunks of ``frames`` frames each (left context
    included)."""
    if not isinstance(codec, SharedCodecSpec) or not frames:
        return codec.call_time(sum(frames))
    work = max(frames) * len(frames) if codec.pad else sum(frames)
    return codec.call_time(work) + (codec.eager_s if len(frames) > 1 else 0.0)


def talker_delay(codec: CodecSpec, seconds: float) -> float:
    """How much a codec call of ``seconds`` lengthens the talker step beside it: its
    share of the call's GPU work (everything but the fixed latency)."""
    if not isinstance(codec, SharedCodecSpec):
        return 0.0
    return codec.gpu_share * max(0.0, seconds - codec.call_s)


@dataclass(frozen=True, slots=True)
class CodecJob(Generic[T]):
    """One chunk waiting for the codec: ready at ``ready_at`` (the end of the step that
    made it), ``frames`` long with its left context; ``item`` is the caller's."""

    ready_at: float
    seq_id: int
    final: bool  #: the sequence's last chunk (it frees the request's slot)
    frames: int
    item: T


class CodecQueue(Generic[T]):
    """The codec stage's queue and timeline: which chunks each call decodes, when the
    call ends, and the talker time the calls took since the talker last paid it."""

    def __init__(self, codec: CodecSpec) -> None:
        self.codec = codec
        self._jobs: deque[CodecJob[T]] = deque()
        self._slots: list[int] = []  #: seq_ids holding a slot (request_slots only)
        self._free_at = 0.0
        self.talker_owed = 0.0  #: talker time the calls since the last step took

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: CodecJob[T]) -> None:
        """Queue a chunk; chunks must be added in ``ready_at`` order."""
        self._jobs.append(job)

    def cancel(self, seq_id: int) -> None:
        """Drop a sequence's queued chunks and free its slot."""
        if any(job.seq_id == seq_id for job in self._jobs):
            self._jobs = deque(j for j in self._jobs if j.seq_id != seq_id)
        if seq_id in self._slots:
            self._slots.remove(seq_id)

    def calls(self, until: float) -> Iterator[tuple[list[CodecJob[T]], float]]:
        """Run the calls that start by ``until``: each call's chunks and its end."""
        while self._jobs:
            start = self._next_start()
            if start is None or start > until:
                return
            take = self._take(start)
            seconds = call_time(self.codec, [job.frames for job in take])
            end = start + seconds
            self._free_at = end
            self.talker_owed += talker_delay(self.codec, seconds)
            for job in take:
                if job.final and job.seq_id in self._slots:
                    self._slots.remove(job.seq_id)
            yield take, end

    def _slotted(self) -> bool:
        return isinstance(self.codec, SharedCodecSpec) and self.codec.request_slots

    def _next_start(self) -> float | None:
        """When the next call can start: the codec is free and a chunk it may take is
        ready (``None``: every queued chunk waits for a slot)."""
        if not self._slotted():
            return max(self._free_at, self._jobs[0].ready_at)
        holders, free = set(self._slots), self.codec.batch - len(self._slots)
        for job in self._jobs:  # ready_at order: the first eligible is the earliest
            if job.seq_id in holders:
                return max(self._free_at, job.ready_at)
            if free > 0:
                return max(self._free_at, job.ready_at)
        return None

    def _take(self, start: float) -> list[CodecJob[T]]:
        """The chunks the call starting at ``start`` decodes, removed from the queue."""
        take: list[CodecJob[T]] = []
        if not self._slotted():  # FIFO: the ready head of the queue
            while self._jobs and len(take) < self.codec.batch and self._jobs[0].ready_at <= start:
                take.append(self._jobs.popleft())
            return take
        keep: deque[CodecJob[T]] = deque()
        taken: set[int] = set()
        while self._jobs:
            job = self._jobs.popleft()
            if job.ready_at > start or len(take) >= self.codec.batch:
                keep.append(job)
                continue
            if job.seq_id in taken:
                keep.append(job)
                continue
            if job.seq_id not in self._slots:
                if len(self._slots) >= self.codec.batch:
                    keep.append(job)
                    continue
                self._slots.append(job.seq_id)
            taken.add(job.seq_id)
            take.append(job)
        self._jobs = keep
        return take
