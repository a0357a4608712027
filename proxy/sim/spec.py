"""The figures of one simulated GPU: hardware, model, fitted overheads, jitter.

:class:`EngineSpec` is plain data plus the step-time formula's terms, so presets,
the engine and the capacity model share one definition (ENGINE_FIGURES section 5)::

    step = max(memory, compute) + c0 + c_seq x batch (+ prefill, vocoder) x jitter
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["EngineSpec", "jitter_sigma"]


def jitter_sigma(p95: float) -> float:
    """The log-normal sigma whose mean-1 distribution has this 95th percentile."""
    if p95 <= 1.0:
        return 0.0
    # p95 = exp(1.645 s - s^2 / 2): take the smaller root.
    z, target = 1.6448536269514722, math.log(p95)
    return z - math.sqrt(z * z - 2.0 * target)


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
    jitter_p95: float = 1.3
    jitter_tau_s: float = 0.5

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

    def memory_term(self, kv_tokens: int) -> float:
        return (self.weight_bytes_per_step + kv_tokens * self.kv_bytes_per_token) / (
            self.mem_bandwidth
        )

    def compute_term(self, batch: int) -> float:
        return batch * (1.0 - self.vocoder_share) * self.flops_per_token / self.peak_flops

    def mean_step_s(self, batch: int, kv_tokens: int = 0) -> float:
        """Expected decode step time (no prefill, vocoder amortised, jitter mean 1)."""
        vocoder = batch * self.vocoder_share * self.flops_per_token / self.peak_flops
        return (
            max(self.memory_term(kv_tokens), self.compute_term(batch))
            + self.step_overhead_s
            + self.per_seq_overhead_s * batch
            + vocoder
        )

    def knee_batch(self, kv_tokens_per_seq: int = 0) -> int:
        """Largest batch still memory-bound (compute term <= memory term), at least 1."""
        batch = 1
        while self.compute_term(batch + 1) <= self.memory_term((batch + 1) * kv_tokens_per_seq):
            batch += 1
            if batch >= self.max_num_seqs:
                break
        return batch
