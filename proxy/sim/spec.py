"""The figures of one simulated GPU: hardware, model, fitted overheads, jitter.

:class:`EngineSpec` is plain data plus the step-time formula's terms, so presets,
the engine and the capacity model share one definition (docs/sim.md §1)::

    step = max(memory, compute) + c0 + c_seq x batch (+ hand-off, eager,
           prefill, vocoder) x jitter
    compute = batch ** batch_exponent x (1 - vocoder_share) x F_eff / peak FLOPs
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CodecSpec", "EngineSpec", "jitter_sigma"]


def jitter_sigma(p95: float) -> float:
    """The log-normal sigma whose mean-1 distribution has this 95th percentile."""
    if p95 <= 1.0:
        return 0.0
    # p95 = exp(1.645 s - s^2 / 2): take the smaller root.
    z, target = 1.6448536269514722, math.log(p95)
    return z - math.sqrt(z * z - 2.0 * target)


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """The codec (Code2Wav, flow matching + vocoder) as its own stage: a FIFO queue of
    chunks, decoded ``batch`` at a time on its own stream of the GPU while the LM keeps
    stepping. One call costs ``call_s`` plus ``frame_s`` per frame decoded, a chunk's
    frames plus the left context the schedule re-decodes."""

    batch: int = 1
    call_s: float = 0.0
    frame_s: float = 0.0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.call_s < 0 or self.frame_s < 0:
            raise ValueError("codec batch must be >= 1, call_s and frame_s >= 0")

    def call_time(self, frames: int) -> float:
        return self.call_s + self.frame_s * frames


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Hardware and model figures of one simulated GPU (all SI units)."""

    mem_bandwidth: float  #: bytes/s
    peak_flops: float  #: dense BF16 FLOP/s
    weight_bytes_per_step: float  #: weights read by one decode step (W)
    kv_bytes_per_token: int
    kv_budget_bytes: float  #: KV cache memory
    flops_per_token: float  #: effective FLOPs per sequence per step (F_eff), vocoder included
    step_overhead_s: float  #: c0
    per_seq_overhead_s: float = 0.0  #: c_seq
    vocoder_share: float = 0.0  #: part of F_eff paid per emitted chunk, not per step
    prefill_flops_per_token: float = 0.0
    prefill_overhead_s: float = 0.0  #: per admitted request (tokenising, scheduling)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  #: prefill tokens admitted per step
    #: Prompts taken in pieces (llama.cpp's server, vLLM's chunked prefill): a step
    #: carries every decoding sequence's token first, then prompt tokens up to
    #: ``max_num_batched_tokens`` in all, and a prompt token costs what a decoding
    #: sequence's token costs in the compute term. Off, an admitted prompt is taken
    #: whole by the step that admits it, at ``prefill_flops_per_token``.
    chunked_prefill: bool = False
    jitter_p95: float = 1.3
    jitter_tau_s: float = 0.5
    #: compute = per-stream cost x batch ** batch_exponent: below 1 the curve bends
    #: (each added stream costs less as the batch grows), as the published curves do.
    batch_exponent: float = 1.0
    #: The codec as its own stage (None: folded into the step through vocoder_share).
    codec: CodecSpec | None = None
    #: Mean extra delay of each chunk after it is made (per-request work: detokenise,
    #: encode, send), drawn per chunk and stream: the per-stream part of the tail.
    emit_jitter_s: float = 0.0
    #: vLLM-Omni's async chunk: the talker hands each sequence's codes to the codec stage
    #: as it makes them and chunks stream out. Off, a sequence's whole output is decoded
    #: and sent in one piece when it finishes (time to first audio = end-to-end latency).
    async_chunk: bool = True
    #: Async chunk's hand-off work on every step: a fixed part and a part per sequence
    #: advanced (each sequence's codes are handed on every step, in one-token chunks).
    handoff_s: float = 0.0
    handoff_per_seq_s: float = 0.0
    #: CUDA graphs on the decode step; without them (eager) every step pays
    #: ``eager_step_s`` more of kernel launches.
    cuda_graph: bool = True
    eager_step_s: float = 0.0

    def __post_init__(self) -> None:
        positive = ("mem_bandwidth", "peak_flops", "kv_budget_bytes", "flops_per_token")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineSpec.{name} must be > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0.0 <= self.vocoder_share < 1.0:
            raise ValueError("vocoder_share must be in [0, 1)")
        if self.jitter_p95 < 1.0 or self.jitter_tau_s <= 0:
            raise ValueError("jitter_p95 must be >= 1 and jitter_tau_s > 0")
        if not 0.0 < self.batch_exponent <= 1.0 or self.emit_jitter_s < 0:
            raise ValueError("batch_exponent must be in (0, 1] and emit_jitter_s >= 0")
        if min(self.handoff_s, self.handoff_per_seq_s, self.eager_step_s) < 0:
            raise ValueError("handoff_s, handoff_per_seq_s and eager_step_s must be >= 0")

    def memory_term(self, kv_tokens: int) -> float:
        return (self.weight_bytes_per_step + kv_tokens * self.kv_bytes_per_token) / (
            self.mem_bandwidth
        )

    def compute_term(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        scale: float = math.pow(batch, self.batch_exponent)
        return scale * (1.0 - self.vocoder_share) * self.flops_per_token / self.peak_flops

    def mode_term(self, batch: int) -> float:
        """What the step pays for async chunk's hand-off and for running eager."""
        handoff = self.handoff_s + self.handoff_per_seq_s * batch if self.async_chunk else 0.0
        return handoff + (0.0 if self.cuda_graph else self.eager_step_s)

    def step_s(
        self,
        decoding: int,
        tokens: int,
        kv_tokens: int = 0,
        vocoder_tokens: int = 0,
        prefill_s: float = 0.0,
    ) -> float:
        """One step's time before jitter: ``decoding`` streams advanced by a token each,
        ``tokens`` tokens carried in all (theirs and any prompt pieces), the weights and
        ``kv_tokens`` of context read, ``vocoder_tokens`` turned into audio by a vocoder
        folded into the step, and ``prefill_s`` of prompts prefilled whole. A step that
        carries no token reads nothing; the per-stream and hand-off costs follow the
        decoding streams, not the prompt tokens."""
        duration = max(self.memory_term(kv_tokens), self.compute_term(tokens)) if tokens else 0.0
        duration += self.step_overhead_s + self.per_seq_overhead_s * decoding + prefill_s
        duration += self.mode_term(decoding)
        duration += vocoder_tokens * self.vocoder_share * self.flops_per_token / self.peak_flops
        return duration

    def mean_step_s(self, batch: int, kv_tokens: int = 0) -> float:
        """Expected decode step of ``batch`` streams (no prompt, vocoder amortised,
        jitter mean 1)."""
        return self.step_s(batch, batch, kv_tokens, vocoder_tokens=batch)

    def knee_batch(self, kv_tokens_per_seq: int = 0) -> int:
        """Largest batch still memory-bound (compute term <= memory term), at least 1."""
        batch = 1
        while self.compute_term(batch + 1) <= self.memory_term((batch + 1) * kv_tokens_per_seq):
            batch += 1
            if batch >= self.max_num_seqs:
                break
        return batch
