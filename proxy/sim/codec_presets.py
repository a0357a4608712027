"""Presets fitted to a codec-batch comparison, for the validate table only.

``h20-qwen3tts-1.7b-base`` is Qwen3-TTS 1.7B Base (voice clone) on one H20-3e with
Code2Wav sharing the talker's GPU (:class:`~proxy.sim.codec.SharedCodecSpec`): the
regime in which vLLM-Omni's cross-request Code2Wav batching was measured, where the
codec at batch 1 is the bottleneck and, the stage holding one request at a time, a
first chunk waits for every older request to finish; batched, its calls run eagerly
and slow the talker. Its talker and codec costs are fitted to that comparison alone
(docs/sim.md §2), so it is not one of :data:`proxy.sim.presets.PRESETS`: ``headroom
sim`` does not serve it and ``describe()`` does not rate it.
``h100-qwen3tts-1.7b-base`` is the same model and topology on one H100, fitted the same
way to the later H100 comparison of Code2Wav ``max_num_seqs`` 1 against 10.
"""

from __future__ import annotations

from dataclasses import replace

from proxy.sim.codec import SharedCodecSpec
from proxy.sim.presets import (
    GB,
    GPUS,
    KIB,
    QWEN3_TTS_CHUNKS,
    QWEN3_TTS_EAGER_STEP_S,
    QWEN3_TTS_HANDOFF,
    Gpu,
    Preset,
    _preset,
    get_preset,
)

__all__ = ["CODEC_PRESETS", "H20_3E", "H100_BASE_FIT", "get_validation_preset"]

#: The H20-3e: memory as its spec sheet gives it; bandwidth and dense BF16 compute [U].
H20_3E = Gpu("H20-3e", 141 * GB, 4800 * GB, 148e12)
#: The one-card H100 Base fit (docs/sim.md §2): the talker's per-stream seconds and c0,
#: the codec's call latency, frame cost, eager work of a batched call, share of the
#: GPU, and re-decoded context frames.
H100_BASE_FIT = (0.003696, 0.003844, 0.05946, 0.001249, 0.2483, 0.4432, 69)

CODEC_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _preset(
            name="h20-qwen3tts-1.7b-base",
            kind="tts",
            model="Qwen/Qwen3-TTS-12Hz-1.7B-Base",
            gpu=H20_3E,
            description="Qwen3-TTS 12Hz 1.7B Base (voice clone) on one H20-3e, vllm-omni "
            "async-chunk streaming, Code2Wav sharing the talker's GPU",
            weight_bytes=4.9 * GB,
            resident_bytes=4.5 * GB,
            kv_per_token=112 * KIB,
            # Fitted to the codec-batch comparison's effects [U]: the talker's
            # per-stream cost and c0, and the codec's call latency, frame cost, eager
            # work, share of the GPU and re-decoded context; the bend kept from the
            # earlier fit, the hand-off and eager step cost from the H200.
            f_eff=0.024453 * H20_3E.peak_flops,
            c0=0.00035882,
            batch_exponent=0.91889,
            fit_c0=False,
            handoff=QWEN3_TTS_HANDOFF,
            eager_step_s=QWEN3_TTS_EAGER_STEP_S,
            vocoder_share=0.0,
            codec=SharedCodecSpec(
                batch=1,
                call_s=0.1524,
                frame_s=0.00036807,
                pad=True,
                gpu_share=0.35934,
                eager_s=0.49777,
                request_slots=True,
            ),
            max_num_seqs=16,  # [U]
            prefill_params=1.7e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=2,
            chunk=25,
            schedule=replace(QWEN3_TTS_CHUNKS, left_context=58),  # [U, fitted]
            prompt_overhead=32,
            sources=(
                "GPU: H20-3e 141 GB; ~4.8 TB/s, ~148 TF [U]",
                "published: Code2Wav at batch 1 against cross-request batching, Base, "
                "c=4/8/16: TTFA p95 3293/8313/12638 -> 1063/1927/6719 ms, audio "
                "throughput 2.39/2.55/3.49x -> 2.34/2.74/3.36x (vllm-omni PR #3322)",
                "chunking: codec_chunk_frames 25, load-dependent first chunk 2/4/8/16; "
                "left context fitted [U]",
            ),
            release="vLLM-Omni main of 2026-05 with and without PR #3322 (H20-3e bench)",
            published_rtf=None,
            expected_ceiling="not rated",
        ),
        _preset(
            name="h100-qwen3tts-1.7b-base",
            kind="tts",
            model="Qwen/Qwen3-TTS-12Hz-1.7B-Base",
            gpu=GPUS["H100"],
            description="Qwen3-TTS 12Hz 1.7B Base (voice clone) on one H100, vllm-omni "
            "async-chunk streaming, Code2Wav sharing the talker's GPU",
            weight_bytes=4.9 * GB,
            resident_bytes=4.5 * GB,
            kv_per_token=112 * KIB,
            # Fitted to the H100 comparison's effects [U], as the H20-3e preset is: the
            # talker's per-stream cost and c0, the codec's call latency, frame cost,
            # eager work, share of the GPU and re-decoded context; the bend kept from
            # the H20-3e fit, the hand-off and eager step cost from the H200.
            f_eff=H100_BASE_FIT[0] * GPUS["H100"].peak_flops,
            c0=H100_BASE_FIT[1],
            batch_exponent=0.91889,
            fit_c0=False,
            handoff=QWEN3_TTS_HANDOFF,
            eager_step_s=QWEN3_TTS_EAGER_STEP_S,
            vocoder_share=0.0,
            codec=SharedCodecSpec(
                batch=1,
                call_s=H100_BASE_FIT[2],
                frame_s=H100_BASE_FIT[3],
                pad=True,
                gpu_share=H100_BASE_FIT[5],
                eager_s=H100_BASE_FIT[4],
                request_slots=True,
            ),
            max_num_seqs=64,  # the deploy file's talker [U: that run's file not stored]
            prefill_params=1.7e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=2,
            chunk=25,
            schedule=replace(QWEN3_TTS_CHUNKS, left_context=H100_BASE_FIT[6]),  # [U, fitted]
            prompt_overhead=32,
            sources=(
                "GPU: H100 SXM 3.35 TB/s, 989 TF",
                "published: Code2Wav max_num_seqs 1 against 10, Base, one H100 with both "
                "stages, seed-tts EN, c=1/4/8/16/32: TTFA p95 312/1707/3080/5033/8841 -> "
                "317/764/1503/4201/8401 ms, audio throughput 3.64/7.68/11.53/13.60/13.14 -> "
                "3.66/7.05/10.08/12.94/13.34x (vllm-omni PR #3322, comment of 2026-05-05 "
                "on main e49fbd8a)",
                "chunking: codec_chunk_frames 25, load-dependent first chunk 2/4/8/16; "
                "left context fitted [U]",
            ),
            release="vLLM-Omni main at e49fbd8a (2026-05-05), Code2Wav max_num_seqs 1 and 10",
            published_rtf=None,
            expected_ceiling="not rated",
        ),
    )
}


def get_validation_preset(name: str) -> Preset:
    """A served preset (:func:`proxy.sim.presets.get_preset`) or one of
    :data:`CODEC_PRESETS`."""
    return CODEC_PRESETS.get(name) or get_preset(name)
