"""Presets: representative (GPU, speech model) deployments for the simulator.

Every number is a public figure or derived from one (docs/sim.md §2 lists them: GPU
specs, model facts, published serving curves, chunk sizes); ``sources`` on each preset
names them. Where a figure is an assumption it says so. docs/sim.md explains the fits,
and ``python -m proxy.sim.validate`` compares every preset with every published point.

Two fitted terms carry the work a roofline does not see (docs/sim.md §1):
``flops_per_token`` is an *effective* per-stream cost (F_eff: vocoder on the same GPU,
per-request Python work, multi-pass code predictors) and ``step_overhead_s`` (c0) the
fixed per-step cost. ``vocoder_share`` moves that part of F_eff from every step to the
step that emits a chunk, which is where a codec/vocoder really runs. Where a published
single-stream RTF exists, c0 is fitted to it (one step per token); the slope past the
knee is F_eff (+ c_seq). The presets with published curves instead fit c0, F_eff, the
bend (``batch_exponent``) and the codec stage to every published point at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from proxy.sim.chunks import ChunkSchedule
from proxy.sim.codec import SharedCodecSpec
from proxy.sim.spec import CodecSpec, EngineSpec

__all__ = [
    "DEFAULT_PRESET",
    "GPUS",
    "PRESETS",
    "Gpu",
    "Preset",
    "get_preset",
    "preset_names",
]

GB = 1e9
KIB = 1024
#: Text tokens per second of speech a TTS prompt carries (docs/sim.md); the capacity
#: model's load (proxy.sim.virtual_load), co-location and bypass streams use it too.
TEXT_TOKENS_PER_AUDIO_S = 3.5
#: The longest utterance of the capacity model's load: the default session length of
#: the co-location check's per-session KV figure.
SESSION_S = 20.0

#: vLLM-Omni Qwen3-TTS: load-dependent first chunk, then 25 frames (2 s), decoded with
#: 72 frames of left context (``deploy/qwen3_tts.yaml``).
QWEN3_TTS_CHUNKS = ChunkSchedule(steady=25, load_first=(2, 4, 8, 16), left_context=72)
#: vLLM-Omni's async-chunk hand-off on every talker step for Qwen3-TTS: fixed and per
#: sequence advanced (fitted on the H200 to its RTF with and without async chunk).
QWEN3_TTS_HANDOFF = (0.0024743, 0.00065746)
#: The talker step's extra cost without CUDA graphs (the same H200 fit).
QWEN3_TTS_EAGER_STEP_S = 0.0082723
#: vLLM-Omni's current Qwen3-TTS deploy file: ``initial_codec_chunk_frames: 1`` (only the
#: first chunk early), then 25 frames with 72 frames of left context.
QWEN3_TTS_DEPLOY_CHUNKS = ChunkSchedule(steady=25, initial=(1,), left_context=72)
#: vLLM-Omni's Voxtral TTS deploy file: 5-frame chunks at the start, then 25, with 25
#: frames of left context.
VOXTRAL_TTS_DEPLOY_CHUNKS = ChunkSchedule(steady=25, initial=(5, 5, 5, 5, 5), left_context=25)
#: The vLLM-Omni CI performance baselines both H100 presets are fitted to.
VLLM_OMNI_CI = (
    "vLLM-Omni main as its CI performance baselines measured it (tests/dfx/perf/tests/"
    "test_tts.json at commit 1f76b511), deploy files vllm_omni/deploy/{}"
)
#: Voxtral TTS: five 5-frame chunks, then 25-frame ones (left context not published).
VOXTRAL_TTS_CHUNKS = ChunkSchedule(steady=25, initial=(5, 5, 5, 5, 5))
#: CosyVoice 2: token_hop_len 25 doubling (stream_scale_factor 2) up to 4 x 25.
COSYVOICE2_CHUNKS = ChunkSchedule(steady=100, initial=(25, 50))


#: The H100 Qwen3-TTS fit (docs/sim.md §2): per-stream seconds, c0, bend, codec call
#: latency and per-frame cost, per-sequence seconds.
H100_QWEN_FIT = (0.00029162046, 0.0071499409, 0.87375157, 0.038190197, 1.0957284e-06,
                 0.00088809164)  # fmt: skip
#: The H100 Voxtral TTS fit: per-stream seconds, c0, codec call latency, per-frame
#: cost, the codec's share of the card, bend.
H100_VOXTRAL_FIT = (0.0026047014, 0.0053390049, 0.016177807, 0.00032549100, 0.24706368,
                    0.39286149)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU's public figures (docs/sim.md §2; dense BF16, no sparsity)."""

    name: str
    memory_bytes: float
    bandwidth: float  #: bytes/s
    peak_flops: float  #: FLOP/s


GPUS: dict[str, Gpu] = {
    "L4": Gpu("L4", 24 * GB, 300 * GB, 121e12),
    "L40S": Gpu("L40S", 48 * GB, 864 * GB, 362e12),
    "H100": Gpu("H100 SXM", 80 * GB, 3350 * GB, 989e12),
    "H200": Gpu("H200 SXM", 141 * GB, 4800 * GB, 989e12),
}


@dataclass(frozen=True, slots=True)
class Preset:
    """One deployment: the engine figures plus what the protocols need.

    ``kind`` is ``"tts"`` (text in, audio out at ``token_rate_hz`` codec tokens per
    second of audio, PCM16 at ``sample_rate``) or ``"asr"`` (PCM16 audio in at
    ``sample_rate``, one transcript token per ``1/token_rate_hz`` s of audio).
    """

    name: str
    kind: Literal["tts", "asr"]
    model: str  #: the id served by /v1/models
    gpu: Gpu
    description: str
    engine: EngineSpec
    token_rate_hz: float
    sample_rate: int
    first_chunk_tokens: int
    chunk_tokens: int
    prompt_overhead_tokens: int  #: system/voice prompt added to every request
    resident_bytes: float  #: weights + codec held in GPU memory
    gpu_memory_utilization: float
    sources: tuple[str, ...]
    published_rtf: float | None = None  #: the single-stream RTF the fit reproduces
    #: The engine software the fitted figures come from: its release, commit or
    #: publication (a release moves these curves, so a fit holds for the one it names).
    release: str = ""
    expected_ceiling: str = ""  #: the published estimate, for the docs
    #: The engine's own chunking (None: ``first_chunk_tokens`` then ``chunk_tokens``).
    chunk_schedule: ChunkSchedule | None = None
    #: vLLM's activation peak, kept out of the KV cache (an assumption, [U]).
    activation_bytes: float = 3 * GB

    def kv_tokens_per_session(self, session_s: float = SESSION_S) -> int:
        """KV tokens one session holds at its end: the prompt overhead, the text of a
        TTS request, and ``session_s`` of output tokens (co-location check)."""
        text = 0.0 if self.kind == "asr" else session_s * TEXT_TOKENS_PER_AUDIO_S
        return self.prompt_overhead_tokens + round(text + session_s * self.token_rate_hz)

    def kv_bytes_per_session(self, session_s: float = SESSION_S) -> float:
        """KV cache bytes one session of ``session_s`` seconds of audio holds."""
        return float(self.kv_tokens_per_session(session_s) * self.engine.kv_bytes_per_token)

    def kv_budget_at(self, utilization: float, memory_bytes: float | None = None) -> float:
        """The KV cache vLLM leaves at ``--gpu-memory-utilization`` ``utilization`` of a
        GPU with ``memory_bytes`` (default: the preset's GPU): the share less the
        resident weights and the activation peak. May be <= 0 (the engine cannot start)."""
        memory = self.gpu.memory_bytes if memory_bytes is None else memory_bytes
        return _kv_budget_bytes(memory, utilization, self.resident_bytes, self.activation_bytes)

    def with_utilization(self, utilization: float) -> Preset:
        """A copy told ``--gpu-memory-utilization utilization`` (its KV cache resized);
        ``ValueError`` when that share leaves no KV cache at all."""
        budget = self.kv_budget_at(utilization)
        if budget <= 0:
            raise ValueError(
                f"{self.name}: gpu_memory_utilization {utilization:g} of {self.gpu.name} "
                f"({self.gpu.memory_bytes / GB:g} GB) leaves no KV cache (weights "
                f"{self.resident_bytes / GB:g} GB + activations {self.activation_bytes / GB:g} GB)"
            )
        return replace(
            self.with_overrides(kv_cache_bytes=budget), gpu_memory_utilization=utilization
        )

    @property
    def schedule(self) -> ChunkSchedule:
        """The chunk schedule; ``chunk_tokens`` is always its steady size."""
        if self.chunk_schedule is None:
            return ChunkSchedule.simple(self.first_chunk_tokens, self.chunk_tokens)
        return replace(self.chunk_schedule, steady=self.chunk_tokens)

    def with_schedule(
        self, *, initial_frames: int | None = None, ramp: tuple[int, ...] | None = None
    ) -> Preset:
        """vLLM-Omni's ``initial_codec_chunk_frames`` (a fixed first chunk) or
        ``codec_chunk_ramp`` (initial chunks) applied to this preset."""
        schedule = self.schedule
        if ramp is not None:
            schedule = schedule.with_ramp(ramp)
        if initial_frames is not None:
            schedule = schedule.with_first(initial_frames)
        return replace(self, chunk_schedule=schedule, first_chunk_tokens=schedule.initial[0])

    def with_overrides(
        self,
        *,
        max_num_seqs: int | None = None,
        kv_cache_bytes: float | None = None,
        async_chunk: bool | None = None,
        cuda_graph: bool | None = None,
        codec_batch: int | None = None,
    ) -> Preset:
        """A copy with vLLM's ``--max-num-seqs``, the KV cache size, vLLM-Omni's async
        chunk, CUDA graphs (``enforce_eager`` off) or the codec stage's batch changed."""
        engine = self.engine
        if max_num_seqs is not None:
            engine = replace(engine, max_num_seqs=max_num_seqs)
        if kv_cache_bytes is not None:
            engine = replace(engine, kv_budget_bytes=kv_cache_bytes)
        if async_chunk is not None:
            engine = replace(engine, async_chunk=async_chunk)
        if cuda_graph is not None:
            engine = replace(engine, cuda_graph=cuda_graph)
        if codec_batch is not None:
            if engine.codec is None:
                raise ValueError(f"{self.name} has no codec stage to batch")
            engine = replace(engine, codec=replace(engine.codec, batch=codec_batch))
        return replace(self, engine=engine)


def _kv_budget_bytes(
    memory: float, utilization: float, resident: float, activations: float
) -> float:
    # vLLM: --gpu-memory-utilization x total, less weights and the activation peak.
    return memory * utilization - resident - activations


def _kv_budget(gpu: Gpu, utilization: float, resident: float, activations: float) -> float:
    return _kv_budget_bytes(gpu.memory_bytes, utilization, resident, activations)


def _preset(
    *,
    name: str,
    kind: Literal["tts", "asr"],
    model: str,
    gpu: Gpu,
    description: str,
    weight_bytes: float,
    resident_bytes: float,
    kv_per_token: int,
    f_eff: float,
    c0: float,
    c_seq: float = 0.0,
    vocoder_share: float,
    prefill_params: float,
    token_rate_hz: float,
    sample_rate: int,
    first_chunk: int,
    chunk: int,
    prompt_overhead: int,
    sources: tuple[str, ...],
    release: str,
    published_rtf: float | None,
    expected_ceiling: str,
    activations: float = 3 * GB,
    utilization: float = 0.9,
    max_num_seqs: int = 256,
    batch_exponent: float = 1.0,
    codec: CodecSpec | None = None,
    schedule: ChunkSchedule | None = None,
    emit_jitter_s: float = 0.0,
    jitter_p95: float = 1.3,
    fit_c0: bool = True,
    prefill_overhead_s: float = 0.004,
    handoff: tuple[float, float] = (0.0, 0.0),
    eager_step_s: float = 0.0,
) -> Preset:
    # c0 is fitted so the single-stream step reproduces the published RTF (one step
    # per token); with no published RTF (or ``fit_c0=False``) c0 is used as is.
    per_stream = f_eff / gpu.peak_flops
    memory = weight_bytes / gpu.bandwidth
    at_one = max(memory, (1 - vocoder_share) * per_stream) + vocoder_share * per_stream + c_seq
    at_one += handoff[0] + handoff[1]
    fitted_c0 = (
        c0 if published_rtf is None or not fit_c0 else published_rtf / token_rate_hz - at_one
    )
    if fitted_c0 <= 0:
        raise ValueError(f"preset {name}: published RTF is below the roofline")
    engine = EngineSpec(
        mem_bandwidth=gpu.bandwidth,
        peak_flops=gpu.peak_flops,
        weight_bytes_per_step=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        kv_budget_bytes=_kv_budget(gpu, utilization, resident_bytes, activations),
        flops_per_token=f_eff,
        step_overhead_s=fitted_c0,
        per_seq_overhead_s=c_seq,
        vocoder_share=vocoder_share,
        prefill_flops_per_token=2 * prefill_params,
        prefill_overhead_s=prefill_overhead_s,
        max_num_seqs=max_num_seqs,
        batch_exponent=batch_exponent,
        codec=codec,
        emit_jitter_s=emit_jitter_s,
        jitter_p95=jitter_p95,
        handoff_s=handoff[0],
        handoff_per_seq_s=handoff[1],
        eager_step_s=eager_step_s,
    )
    return Preset(
        name=name,
        kind=kind,
        model=model,
        gpu=gpu,
        description=description,
        engine=engine,
        token_rate_hz=token_rate_hz,
        sample_rate=sample_rate,
        first_chunk_tokens=first_chunk,
        chunk_tokens=chunk,
        prompt_overhead_tokens=prompt_overhead,
        resident_bytes=resident_bytes,
        gpu_memory_utilization=utilization,
        sources=sources,
        release=release,
        published_rtf=published_rtf,
        expected_ceiling=expected_ceiling,
        chunk_schedule=schedule,
        activation_bytes=activations,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _preset(
            name="l4-cosyvoice2-0.5b",
            kind="tts",
            model="FunAudioLLM/CosyVoice2-0.5B",
            gpu=GPUS["L4"],
            description="CosyVoice 2 (Qwen2.5-0.5B LM, 25 Hz speech tokens, flow-matching "
            "token2wav) on one L4",
            weight_bytes=0.99 * GB,  # Qwen2.5-0.5B, 0.49B params in bf16
            resident_bytes=1.6 * GB,  # LM + flow-matching + HiFT [D, U]
            kv_per_token=12 * KIB,  # 24 layers x 2 KV heads x 64 x 2 x 2 B
            f_eff=4.84e11,  # 4.0 ms per stream on L4 [fitted, U]
            c0=0.0057,
            vocoder_share=0.5,  # token2wav dominates the per-stream cost [U]
            prefill_params=0.49e9,
            token_rate_hz=25.0,
            sample_rate=24000,
            first_chunk=25,  # token_hop_len (1 s), doubling: 1 s, 2 s, then 4 s
            chunk=100,
            schedule=COSYVOICE2_CHUNKS,
            prompt_overhead=40,
            activations=2 * GB,
            sources=(
                "GPU: L4 300 GB/s, 121 TF",
                "model: CosyVoice 2, Qwen2.5-0.5B, 25 Hz, 12 KiB/token",
                "published: CosyVoice 2 on L20 TRT-LLM RTF 0.089 at c=1 "
                "(x 864/300 bandwidth -> ~0.26 on L4); DiT first chunk 197/511/1215 ms "
                "at c=1/4/10",
                "published: RTX 5090 vLLM RTF 0.43 at c=1, 1.21 at c=8 [U]",
                "chunking: token_hop_len 25 growing x2 up to 4 x 25 (1 s, 2 s, 4 s)",
                "published: CosyVoice 3 ~30% of time in token2wav",
            ),
            release=(
                "CosyVoice 2 on TRT-LLM (FunAudioLLM/CosyVoice runtime/triton_trtllm) as its "
                "README published it for an L20, scaled to an L4; not a vLLM release"
            ),
            published_rtf=0.25,
            expected_ceiling="~5 (derived; no published L4 curve)",
        ),
        _preset(
            name="l40s-qwen3tts-1.7b",
            kind="tts",
            model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
            gpu=GPUS["L40S"],
            description="Qwen3-TTS 12Hz 1.7B (talker + 15-pass code predictor) on one "
            "L40S, vllm-omni async-chunk streaming",
            weight_bytes=4.9 * GB,  # talker 2.8 GB + 15 x 0.136 GB predictor [D]
            resident_bytes=4.5 * GB,
            kv_per_token=112 * KIB,  # 28 layers x 8 x 128 x 2 x 2 B
            # Fitted to all four published points at each run's own request length
            # (docs/sim.md §2): per-stream cost 14.95 ms x batch^0.462 above c0 1.37 ms,
            # plus the H200 fit's async-chunk hand-off and eager launches [U].
            f_eff=0.014955 * GPUS["L40S"].peak_flops,
            c0=0.0013684,
            batch_exponent=0.46207,
            fit_c0=False,
            handoff=QWEN3_TTS_HANDOFF,
            eager_step_s=QWEN3_TTS_EAGER_STEP_S,
            vocoder_share=0.0,
            # Code2Wav as its own stage at batch 1; no L40S TTFA is published, so its
            # cost is the H200 fit's [U].
            codec=CodecSpec(batch=1, call_s=0.03146, frame_s=0.000043),
            max_num_seqs=16,  # the DLC run's config is not published: its largest c [U]
            prefill_params=1.7e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=2,  # load-dependent 2/4/8/16, then codec_chunk_frames 25 (2 s)
            chunk=25,
            schedule=QWEN3_TTS_CHUNKS,
            prompt_overhead=32,
            sources=(
                "GPU: L40S 864 GB/s, 362 TF",
                "model: Qwen3-TTS 12.5 Hz, 112 KiB/token",
                "published: L40S aggregate 4.08x at c=1, 8.17x c=4, 13.0x c=8, "
                "18.0x c=16; 1.14 / 2.10 / 3.47 / 4.63 req/s; p95 E2EL 1123 / 2387 / "
                "3637 / 4237 ms (aws/deep-learning-containers PR #6022)",
                "chunking: codec_chunk_frames 25, left context 72, load-dependent "
                "first chunk 2/4/8/16, optional ramp [4,4,8,16,25]",
                "derived: W 4.9 GB",
            ),
            release=(
                "vLLM-Omni as AWS's deep-learning-containers PR #6022 ran it on g6e (its version "
                "and deploy file not published)"
            ),
            published_rtf=0.245,
            expected_ceiling="~11 (mean model 15)",
        ),
        _preset(
            name="h200-qwen3tts-1.7b",
            kind="tts",
            model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
            gpu=GPUS["H200"],
            description="Qwen3-TTS 12Hz 1.7B on one H200, vllm-omni async-chunk streaming",
            weight_bytes=4.9 * GB,
            resident_bytes=4.5 * GB,
            kv_per_token=112 * KIB,
            # Fitted to both RTF and all three TTFP points with async chunk, both RTF
            # points without it and both without CUDA graphs (docs/sim.md §2).
            f_eff=0.0006883 * GPUS["H200"].peak_flops,
            c0=0.0085777,
            batch_exponent=1.0,
            fit_c0=False,
            handoff=QWEN3_TTS_HANDOFF,
            eager_step_s=QWEN3_TTS_EAGER_STEP_S,
            vocoder_share=0.0,
            codec=CodecSpec(batch=1, call_s=0.03146, frame_s=0.000043),  # codec batch 1
            max_num_seqs=10,  # the published run's talker batch
            prefill_params=1.7e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=2,
            chunk=25,
            schedule=QWEN3_TTS_CHUNKS,
            prompt_overhead=32,
            sources=(
                "GPU: H200 4.8 TB/s, 989 TF",
                "published: H200 RTF 0.160 at c=1 (TTFP 64 ms), TTFP 119 ms at c=4, "
                "RTF 0.314 at c=10 (TTFP 425 ms); talker batch 10, codec batch 1 "
                "(vllm-omni qwen3_omni_tts_performance_optimization.md)",
                "published: same doc, E2EL 941 / 1767 ms at c=1 / 10; without async "
                "chunk RTF 0.124 / 0.203, E2EL 733 / 987 / 1197 ms; without CUDA graphs "
                "RTF 0.234 / 0.255 / 0.292; talker batch 1 RTF 0.230 / 0.908 / 2.186",
                "chunking: codec_chunk_frames 25, left context 72, load-dependent "
                "first chunk 2/4/8/16",
                "derived: W 4.9 GB",
            ),
            release=(
                "vLLM-Omni of its Qwen3-TTS design doc "
                "(qwen3_omni_tts_performance_optimization.md): talker batch 10, Code2Wav batch 1,"
                " load-dependent first chunk; an older stack than the CI baselines"
            ),
            published_rtf=0.160,
            expected_ceiling="~30 (mean model 40)",
        ),
        _preset(
            name="h100-qwen3tts-1.7b",
            kind="tts",
            model="Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
            gpu=GPUS["H100"],
            description="Qwen3-TTS 12Hz 1.7B CustomVoice on two H100s (talker on one, "
            "Code2Wav on the other), vLLM-Omni async chunk, first chunk 1 frame",
            weight_bytes=4.9 * GB,
            resident_bytes=4.5 * GB,
            kv_per_token=112 * KIB,
            # Fitted to the CI baselines' TTFP, RTF and throughput at c=1/8/16/64
            # (docs/sim.md §2): per-stream cost and bend, c0, a per-sequence cost, and the
            # codec's call latency and frame cost. No hand-off term: this release's step
            # already holds it.
            f_eff=H100_QWEN_FIT[0] * GPUS["H100"].peak_flops,
            c0=H100_QWEN_FIT[1],
            c_seq=H100_QWEN_FIT[5],
            batch_exponent=H100_QWEN_FIT[2],
            fit_c0=False,
            eager_step_s=QWEN3_TTS_EAGER_STEP_S,
            vocoder_share=0.0,
            # Code2Wav on its own card, an engine of max_num_seqs requests: a request
            # holds a slot from its first chunk to its last [U: 10, see docs/sim.md].
            codec=SharedCodecSpec(
                batch=10,
                call_s=H100_QWEN_FIT[3],
                frame_s=H100_QWEN_FIT[4],
                gpu_share=0.0,
                request_slots=True,
            ),
            max_num_seqs=64,  # the deploy file's talker
            prefill_params=1.7e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=1,  # initial_codec_chunk_frames 1, then codec_chunk_frames 25
            chunk=25,
            schedule=QWEN3_TTS_DEPLOY_CHUNKS,
            prompt_overhead=32,
            sources=(
                "GPU: H100 SXM 3.35 TB/s, 989 TF",
                "published: vLLM-Omni CI baselines, Qwen3-TTS-12Hz-1.7B-CustomVoice on 2 x "
                "H100, medians at c=1/8/16/64: TTFP 46.8/75.3/713.8/5,941.7 ms, RTF "
                "0.137/0.186/0.315/1.166, audio throughput 38.4/55.4/68.7x (c=8/16/64)",
                "deploy: qwen3_tts.yaml, stage 1 on device 1 (stage_overrides); talker "
                "max_num_seqs 64; initial_codec_chunk_frames 1, codec_chunk_frames 25, "
                "left context 72",
                "derived: W 4.9 GB; requests 5.66 s (the CI stress run: 11.12x for 100 "
                "requests sent at 2 a second)",
            ),
            release=VLLM_OMNI_CI.format("qwen3_tts.yaml"),
            published_rtf=None,
            expected_ceiling="not published",
        ),
        _preset(
            name="h100-voxtral-tts-4b",
            kind="tts",
            model="mistralai/Voxtral-4B-TTS-2603",
            gpu=GPUS["H100"],
            description="Voxtral TTS 4B on one H100 (generator and codec stage on the same "
            "card), vLLM-Omni async chunk",
            weight_bytes=13 * GB,  # as the H200 preset [D, U]
            resident_bytes=8.5 * GB,
            kv_per_token=104 * KIB,
            # Fitted to the CI baselines' TTFP, RTF and throughput at c=1/8 (docs/sim.md
            # §2): c0, the per-stream cost and the codec's call and frame cost; the bend
            # and the codec's share of the card from an earlier fit, the H200 fit's
            # admission cost.
            f_eff=H100_VOXTRAL_FIT[0] * GPUS["H100"].peak_flops,
            c0=H100_VOXTRAL_FIT[1],
            batch_exponent=H100_VOXTRAL_FIT[5],
            fit_c0=False,
            prefill_overhead_s=0.017421,
            vocoder_share=0.0,
            # The codec stage beside the generator, an engine of 32 requests (eager).
            codec=SharedCodecSpec(
                batch=32,
                call_s=H100_VOXTRAL_FIT[2],
                frame_s=H100_VOXTRAL_FIT[3],
                gpu_share=H100_VOXTRAL_FIT[4],
                request_slots=True,
            ),
            max_num_seqs=32,  # the deploy file's
            prefill_params=3.4e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=5,
            chunk=25,
            schedule=VOXTRAL_TTS_DEPLOY_CHUNKS,
            prompt_overhead=32,
            sources=(
                "GPU: H100 SXM 3.35 TB/s, 989 TF",
                "published: vLLM-Omni CI baselines, Voxtral-4B-TTS-2603 on 1 x H100, medians "
                "at c=1/8: TTFP 82.6/170.4 ms, RTF 0.128/0.208, audio throughput 37.1x (c=8)",
                "deploy: voxtral_tts.yaml, both stages on device 0, max_num_seqs 32 each; "
                "codec_chunk_frames 25, 5 at the start, left context 25",
                "derived: W ~13 GB; requests 5.14 s (the CI stress run: 10.12x for 100 "
                "requests sent at 2 a second)",
            ),
            release=VLLM_OMNI_CI.format("voxtral_tts.yaml"),
            published_rtf=None,
            expected_ceiling="not published",
        ),
        _preset(
            name="h200-voxtral-tts-4b",
            kind="tts",
            model="mistralai/Voxtral-4B-TTS",
            gpu=GPUS["H200"],
            description="Voxtral TTS 4B (3.4B AR + flow-matching acoustic model + codec) "
            "on one H200, vLLM-Omni",
            weight_bytes=13 * GB,  # 6.8 GB backbone + 0.78 GB x 8 NFE [D, U]
            resident_bytes=8.5 * GB,
            kv_per_token=104 * KIB,  # 26 layers x 8 x 128 x 2 x 2 B
            # Fitted to all three RTF and all three latency points (docs/sim.md §2):
            # 5.10 ms x batch^0.409 above c0 2.85 ms; 17.4 ms per admitted request.
            f_eff=0.0050966 * GPUS["H200"].peak_flops,
            c0=0.0028453,
            batch_exponent=0.40895,
            fit_c0=False,
            prefill_overhead_s=0.017421,
            vocoder_share=0.0,
            codec=CodecSpec(batch=4, call_s=0.009651, frame_s=0.000227),  # [U, fitted]
            max_num_seqs=32,  # the deploy config's
            prefill_params=3.4e9,
            token_rate_hz=12.5,
            sample_rate=24000,
            first_chunk=5,  # five 5-frame chunks, then 25
            chunk=25,
            schedule=VOXTRAL_TTS_CHUNKS,
            prompt_overhead=32,
            sources=(
                "GPU: H200 4.8 TB/s, 989 TF",
                "model: Voxtral TTS 12.5 Hz, 104 KiB/token",
                "published: H200 RTF 0.103 / 0.237 / 0.302 and latency 70 / 331 / "
                "552 ms at c=1 / 16 / 32, 500-character input (HF model card via "
                "secondary sources) [U]",
                "derived: W ~13 GB",
            ),
            release=(
                "vLLM-Omni at the Voxtral-4B-TTS-2603 model card's launch (figures via secondary "
                "sources) [U]"
            ),
            published_rtf=0.103,
            expected_ceiling="~65 (mean model 87; extrapolated past c=32)",
        ),
        _preset(
            name="h100-orpheus-3b",
            kind="tts",
            model="canopylabs/orpheus-3b-0.1-ft",
            gpu=GPUS["H100"],
            description="Orpheus 3B (Llama-3.2-3B, SNAC codec, 7 tokens per frame) on one "
            "H100 SXM, stock vLLM",
            weight_bytes=6.4 * GB,
            resident_bytes=6.6 * GB,
            kv_per_token=112 * KIB,  # 28 layers x 8 x 128 x 2 x 2 B
            # Stock engine. The public estimate adds the memory term to 1.8e11's compute
            # term to reach Baseten's ~24 streams; under max() F_eff 2.4e11 puts
            # describe()'s ceiling at 21-24 over seeds 0-4 (mean 23 over 0-2) [fitted].
            f_eff=2.4e11,
            c0=0.0015,
            vocoder_share=0.1,  # SNAC (~20M params) decodes the last 28 tokens per emit
            prefill_params=3.2e9,
            token_rate_hz=82.0,  # SNAC 12+23+47 Hz: 7 tokens per ~85 ms frame
            sample_rate=24000,
            first_chunk=28,  # emits once more than 27 tokens exist
            chunk=7,  # then every frame (~85 ms)
            prompt_overhead=24,
            sources=(
                "GPU: H100 SXM 3.35 TB/s, 989 TF",
                "model: Orpheus 3B, ~82 tok/s, 112 KiB/token",
                "published: ~24 realtime streams per H100 at Baseten's baseline "
                "(silares.com); 16-24 on an H100 MIG (Baseten talk)",
                "chunking: first emit after 28 tokens, then every 7",
                "derived: c0 1.5 ms [U], F_eff 1.8e11 (stock) with the memory "
                "term added, RTF ~0.28; budget 10.2 ms, tail 7.8 ms",
            ),
            release="stock vLLM as Baseten deployed Orpheus before tuning (version not published)",
            published_rtf=0.28,
            expected_ceiling="~24 stock (200-280 tuned)",
        ),
        _preset(
            name="h100-voxtral-realtime-4b",
            kind="asr",
            model="mistralai/Voxtral-Mini-4B-Realtime-2602",
            gpu=GPUS["H100"],
            description="Voxtral Mini 4B Realtime (streaming ASR, one text token per 80 ms "
            "of audio) on one H100 SXM, vLLM /v1/realtime",
            weight_bytes=8.4 * GB,  # 3.4B LM + ~0.8B causal encoder in bf16 [D, U]
            resident_bytes=8.8 * GB,
            kv_per_token=104 * KIB,  # [U]
            # Roofline 1.3e10 FLOP per step (decoder 6.8e9 + encoder on 80 ms of audio
            # 6.4e9) x the ~30x stock-engine factor measured for Orpheus [D, U].
            f_eff=3.9e11,
            c0=0.0055,  # same backbone and engine as the Voxtral TTS fit [U]
            vocoder_share=0.0,
            prefill_params=3.4e9,
            token_rate_hz=12.5,
            sample_rate=16000,
            first_chunk=6,  # default transcription delay 480 ms
            chunk=6,  # transcript segments of 480 ms
            prompt_overhead=16,
            sources=(
                "GPU: H100 SXM 3.35 TB/s, 989 TF",
                "model: Voxtral Mini 4B Realtime, 1 text token per 80 ms, "
                "~104 KiB/token [U]; delay 80 ms-2.4 s, default 480 ms",
                "derived: Voxtral TTS c0 5.5 ms; Orpheus stock/roofline ~28x",
            ),
            release="vLLM /v1/realtime; no published curve, so no release was fitted (derived)",
            published_rtf=None,
            expected_ceiling="no published curve; derived",
        ),
    )
}

DEFAULT_PRESET = "l40s-qwen3tts-1.7b"


def preset_names() -> list[str]:
    """The preset names, in a stable order."""
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    """The named preset; ``ValueError`` listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown simulator preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
