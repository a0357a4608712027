"""The published serving figures the simulator is checked against (docs/sim.md §2).

:data:`PUBLISHED` holds every figure a preset simulates, each with the configuration the
source ran (:class:`Setup`) and the request length its own numbers give;
:data:`NOT_SIMULATED` the figures no preset simulates, with why. :mod:`proxy.sim.validate`
re-runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.sim.presets import Preset

__all__ = [
    "EFFECT_TOLERANCE",
    "NOT_SIMULATED",
    "PUBLISHED",
    "TOLERANCE",
    "Metric",
    "Point",
    "Setup",
]

TOLERANCE = 0.15
EFFECT_TOLERANCE = 0.25

Metric = Literal[
    "rtf", "rtf_p50", "ttfa", "ttfa_p50", "ttfa_p95", "e2e_mean", "e2e_p95", "req_s",
    "aggregate", "ceiling",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Setup:
    """The engine options a published run used (``None``: the preset's own)."""

    label: str = ""
    async_chunk: bool = True
    cuda_graph: bool = True
    max_num_seqs: int | None = None
    codec_batch: int | None = None

    def apply(self, preset: Preset) -> Preset:
        return preset.with_overrides(
            async_chunk=self.async_chunk,
            cuda_graph=self.cuda_graph,
            max_num_seqs=self.max_num_seqs,
            codec_batch=self.codec_batch,
        )


@dataclass(frozen=True, slots=True)
class Point:
    """One published figure and how to reproduce it."""

    preset: str
    concurrency: int
    metric: Metric
    value: float
    sample: Literal["in-sample", "held-out"]
    audio_s: float  #: mean request length in the benchmark
    note: str  #: where it comes from; what of its configuration is unknown
    spread: float = 0.0  #: request lengths uniform within audio_s x (1 +- spread)
    #: set: request lengths log-normal, mean audio_s, this sigma (spread then 0)
    sigma: float = 0.0
    setup: Setup = field(default_factory=Setup)
    versus: Setup | None = None  #: set: the figure is value(setup) / value(versus)
    #: set: a serving benchmark's prompt count (``vllm bench serve --num-prompts``): the
    #: run sends this many requests and its throughput spans the whole run
    prompts: int | None = None
    #: set (with ``prompts``): the requests are sent open-loop at this many a second
    #: (``vllm bench serve --request-rate``), ``concurrency`` at a time at most
    rate: float | None = None

    @property
    def tolerance(self) -> float:
        return TOLERANCE if self.versus is None else EFFECT_TOLERANCE


#: The design doc's stacked configurations: async chunk on top of CUDA graphs on top
#: of batching (the preset's own), and each step without the one above it.
ASYNC = Setup("async chunk")
NO_ASYNC = Setup("no async chunk", async_chunk=False)
EAGER = Setup("eager, batch 10", async_chunk=False, cuda_graph=False)
EAGER_1 = Setup("eager, batch 1", async_chunk=False, cuda_graph=False, max_num_seqs=1)

_QWEN_H200 = "vllm-omni Qwen3-TTS design doc, H200; 5.9 s requests [D]"
_QWEN_L40S = "AWS DLC PR #6022, g6e L40S; config unknown [U]; length [D], spread [U]"
_QWEN_H20 = "vllm-omni PR #3322, H20-3e, Base, 20 sentences; codec batch 16 [U]; 3.1 s [D]"
_VOXTRAL = "Voxtral TTS model card via secondary sources [U]; 500 characters = 37 s [D]"
_H200_LEN = 5.9
_L40S_SPREAD = 0.35
_H20_LEN = 3.1
#: Code2Wav at batch 1 (the comparison's "main") and batched across requests.
CODEC_1 = Setup("codec batch 1", codec_batch=1)
CODEC_BATCHED = Setup("codec batched", codec_batch=16)
#: The H100 comparison's Code2Wav max_num_seqs, 10 against 1.
CODEC_10 = Setup("codec max_num_seqs 10", codec_batch=10)
_QWEN_H100_BASE = (
    "vllm-omni PR #3322, comment of 2026-05-05 (main e49fbd8a), 1 x H100, Base, seed-tts "
    "EN; 7.5 s [U], spread [U]"
)
#: The Base comparison's request length: not published (another prompt set than the CI
#: CustomVoice runs'); the preset was fitted with this one.
_H100_BASE_LEN = 7.5
#: Each L40S concurrency's audio seconds per request: its aggregate / its req/s.
_L40S_LEN = {1: 4.08 / 1.14, 4: 8.17 / 2.10, 8: 13.0 / 3.47, 16: 18.0 / 4.63}


Sample = Literal["in-sample", "held-out"]


def _h200(
    c: int,
    metric: Metric,
    value: float,
    sample: Sample = "in-sample",
    *,
    setup: Setup = ASYNC,
    versus: Setup | None = None,
) -> Point:
    return Point(
        "h200-qwen3tts-1.7b", c, metric, value, sample, _H200_LEN, _QWEN_H200,
        setup=setup, versus=versus,
    )  # fmt: skip


def _h20(c: int, metric: Metric, batched: float, unbatched: float) -> Point:
    return Point(
        "h20-qwen3tts-1.7b-base", c, metric, batched / unbatched, "in-sample", _H20_LEN,
        _QWEN_H20, spread=_L40S_SPREAD, setup=CODEC_BATCHED, versus=CODEC_1,
    )  # fmt: skip


#: vLLM-Omni's CI performance baselines (tests/dfx/perf/tests/test_tts.json, commit
#: 1f76b511): medians of ``vllm bench serve`` on seed-tts text, 20 prompts at c=1, 80 at
#: c=8, 128 at c=16 and 64, and a stress run of 100 prompts sent at 2 a second.
_CI = (
    "vLLM-Omni CI baselines (test_tts.json @1f76b511), H100, median; {}; {} s [D: the "
    "stress run], spread ±22 % [D: seed_tts_smoke's text]"
)
#: Request length [D], each model's own: its stress run sends its requests on vLLM's
#: schedule, the last at exactly prompts / rate, and lasts until that one ends, under a
#: second later, so the prompts' audio = its throughput x that span (docs/sim.md §2).
_QWEN_CI_LEN = 5.66
_VOX_CI_LEN = 5.14
#: Each CI-release preset's note and request length.
_CI_RUNS = {
    "h100-qwen3tts-1.7b": (
        _CI.format("talker card 0, Code2Wav card 1, codec max_num_seqs 10 [U]", _QWEN_CI_LEN),
        _QWEN_CI_LEN,
    ),
    "h100-voxtral-tts-4b": (
        _CI.format("one card, codec max_num_seqs 32", _VOX_CI_LEN),
        _VOX_CI_LEN,
    ),
}
_CI_PROMPTS = {1: 20, 8: 80, 16: 128, 64: 128}
#: The stress runs: 100 prompts at 2 requests a second, no concurrency limit.
_STRESS_PROMPTS, _STRESS_RATE = 100, 2.0
#: The spread of the CI runs' prompt set (vLLM-Omni's seed_tts_smoke sentences; their
#: lengths are in docs/sim.md §2): requests uniform within this share of the mean.
_CI_SPREAD = 0.22


def _ci(preset: str, c: int, metric: Metric, value: float) -> Point:
    note, length = _CI_RUNS[preset]
    return Point(
        preset, c, metric, value, "in-sample", length, note, spread=_CI_SPREAD,
        prompts=_CI_PROMPTS[c],
    )  # fmt: skip


def _stress(preset: str, metric: Metric, value: float) -> Point:
    """A stress run's figure. Its throughput gives the request length, so it is
    in-sample; its time to first audio and RTF are held out."""
    note, length = _CI_RUNS[preset]
    sample: Sample = "in-sample" if metric == "aggregate" else "held-out"
    return Point(
        preset, _STRESS_PROMPTS, metric, value, sample, length, note, spread=_CI_SPREAD,
        prompts=_STRESS_PROMPTS, rate=_STRESS_RATE,
    )  # fmt: skip


def _h100(c: int, metric: Metric, value: float) -> Point:
    return _ci("h100-qwen3tts-1.7b", c, metric, value)


def _h100_base(c: int, metric: Metric, batched: float, unbatched: float) -> Point:
    return Point(
        "h100-qwen3tts-1.7b-base", c, metric, batched / unbatched, "in-sample", _H100_BASE_LEN,
        _QWEN_H100_BASE, spread=_L40S_SPREAD, setup=CODEC_10, versus=CODEC_1,
    )  # fmt: skip


def _vox100(c: int, metric: Metric, value: float) -> Point:
    return _ci("h100-voxtral-tts-4b", c, metric, value)


def _l40s(c: int, metric: Metric, value: float, sample: Sample) -> Point:
    return Point(
        "l40s-qwen3tts-1.7b", c, metric, value, sample, _L40S_LEN[c], _QWEN_L40S,
        spread=_L40S_SPREAD,
    )  # fmt: skip


#: Every published point of docs/sim.md §2 that a preset simulates.
PUBLISHED: tuple[Point, ...] = (
    _h200(1, "rtf", 0.160),
    _h200(10, "rtf", 0.314),
    _h200(1, "ttfa", 0.064),
    _h200(4, "ttfa", 0.119),
    _h200(10, "ttfa", 0.425),
    _h200(1, "e2e_mean", 0.941, "held-out"),
    _h200(10, "e2e_mean", 1.767, "held-out"),
    _h200(1, "rtf", 0.124, setup=NO_ASYNC),
    _h200(10, "rtf", 0.203, setup=NO_ASYNC),
    _h200(1, "e2e_mean", 0.733, "held-out", setup=NO_ASYNC),
    _h200(4, "e2e_mean", 0.987, "held-out", setup=NO_ASYNC),
    _h200(10, "e2e_mean", 1.197, "held-out", setup=NO_ASYNC),
    _h200(10, "aggregate", 47.15, "held-out", setup=NO_ASYNC),
    _h200(1, "rtf", 0.160 / 0.124, setup=ASYNC, versus=NO_ASYNC),
    _h200(10, "rtf", 0.314 / 0.203, setup=ASYNC, versus=NO_ASYNC),
    _h200(1, "ttfa", 0.064 / 0.733, "held-out", setup=ASYNC, versus=NO_ASYNC),
    _h200(10, "ttfa", 0.425 / 1.197, "held-out", setup=ASYNC, versus=NO_ASYNC),
    _h200(1, "rtf", 0.234, setup=EAGER),
    _h200(4, "rtf", 0.255, "held-out", setup=EAGER),
    _h200(10, "rtf", 0.292, setup=EAGER),
    _h200(10, "e2e_mean", 1.705, "held-out", setup=EAGER),
    _h200(10, "aggregate", 33.53, "held-out", setup=EAGER),
    _h200(1, "rtf", 0.230, "held-out", setup=EAGER_1),
    _h200(10, "rtf", 2.186, "held-out", setup=EAGER_1),
    _h200(10, "e2e_mean", 12.141, "held-out", setup=EAGER_1),
    _h200(10, "rtf", 2.186 / 0.292, "held-out", setup=EAGER_1, versus=EAGER),
    _h200(10, "aggregate", 33.53 / 3.99, "held-out", setup=EAGER, versus=EAGER_1),
    _l40s(1, "aggregate", 4.08, "in-sample"),
    _l40s(4, "aggregate", 8.17, "in-sample"),
    _l40s(8, "aggregate", 13.0, "in-sample"),
    _l40s(16, "aggregate", 18.0, "in-sample"),
    _l40s(1, "req_s", 1.14, "held-out"),
    _l40s(4, "req_s", 2.10, "held-out"),
    _l40s(8, "req_s", 3.47, "held-out"),
    _l40s(16, "req_s", 4.63, "held-out"),
    _l40s(1, "e2e_p95", 1.123, "in-sample"),
    _l40s(4, "e2e_p95", 2.387, "in-sample"),
    _l40s(8, "e2e_p95", 3.637, "in-sample"),
    _l40s(16, "e2e_p95", 4.237, "in-sample"),
    _h20(4, "ttfa_p95", 1.063, 3.293),
    _h20(8, "ttfa_p95", 1.927, 8.313),
    _h20(16, "ttfa_p95", 6.719, 12.638),
    _h20(4, "aggregate", 2.34, 2.39),
    _h20(8, "aggregate", 2.74, 2.55),
    _h20(16, "aggregate", 3.36, 3.49),
    _h100_base(4, "ttfa_p95", 0.764, 1.707),
    _h100_base(8, "ttfa_p95", 1.503, 3.080),
    _h100_base(16, "ttfa_p95", 4.201, 5.033),
    _h100_base(4, "aggregate", 7.05, 7.68),
    _h100_base(8, "aggregate", 10.08, 11.53),
    _h100_base(16, "aggregate", 12.94, 13.60),
    Point("h200-voxtral-tts-4b", 1, "rtf", 0.103, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 16, "rtf", 0.237, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 32, "rtf", 0.302, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 1, "ttfa", 0.070, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 16, "ttfa", 0.331, "in-sample", 37.0, _VOXTRAL),
    Point("h200-voxtral-tts-4b", 32, "ttfa", 0.552, "in-sample", 37.0, _VOXTRAL),
    _h100(1, "ttfa_p50", 0.0468),
    _h100(8, "ttfa_p50", 0.0753),
    _h100(16, "ttfa_p50", 0.7138),
    _h100(64, "ttfa_p50", 5.9417),
    _h100(1, "rtf_p50", 0.1367),
    _h100(8, "rtf_p50", 0.1859),
    _h100(16, "rtf_p50", 0.3148),
    _h100(64, "rtf_p50", 1.166),
    _h100(8, "aggregate", 38.39),
    _h100(16, "aggregate", 55.35),
    _h100(64, "aggregate", 68.70),
    _stress("h100-qwen3tts-1.7b", "ttfa_p50", 0.05675),
    _stress("h100-qwen3tts-1.7b", "rtf_p50", 0.1571),
    _stress("h100-qwen3tts-1.7b", "aggregate", 11.12),
    _vox100(1, "ttfa_p50", 0.0826),
    _vox100(8, "ttfa_p50", 0.1704),
    _vox100(1, "rtf_p50", 0.1277),
    _vox100(8, "rtf_p50", 0.2076),
    _vox100(8, "aggregate", 37.08),
    _stress("h100-voxtral-tts-4b", "ttfa_p50", 0.1010),
    _stress("h100-voxtral-tts-4b", "rtf_p50", 0.1498),
    _stress("h100-voxtral-tts-4b", "aggregate", 10.12),
    Point(
        "h100-orpheus-3b",
        0,
        "ceiling",
        24,
        "in-sample",
        0.0,
        "SAIL: ~24 streams per H100, Baseten's stock deployment (16-24 in a Baseten "
        "talk); workload unknown",
    ),
)

#: Published figures no preset simulates, and why.
NOT_SIMULATED: tuple[tuple[str, str], ...] = (
    (
        "Qwen3-TTS Base (voice clone) on H20-3e: RTF/TTFP 0.15/165 ms, 0.28/412 ms, "
        "0.49/1,701 ms, 0.72/3,355 ms, 0.77/3,772 ms at c=1/4/8/16/32",
        "h20-qwen3tts-1.7b-base is fitted to PR #3322's Base run, about six times "
        "slower (2.39x realtime for the card at c=4, where RTF 0.28 implies ~14x): one "
        "preset cannot fit both runs, whose versions differ",
    ),
    ("Qwen3-TTS L40S Base voice clone, saturating near 7x", "no voice-clone preset"),
    (
        "vLLM-Omni CI baselines (test_tts.json @1f76b511), H100: Qwen3-TTS Base voice clone "
        "on two cards (TTFP median 141/227/647/4,777 ms, RTF 0.159/0.331/0.364/1.228, "
        "24.2/40.4/43.3x at c=1/8/16/64) and VoiceDesign (46/76/588/4,960 ms, "
        "0.135/0.187/0.314/1.170, 38.9/55.2/71.6x)",
        "no H100 Base preset; VoiceDesign is another task on the CustomVoice run's engine, "
        "not fitted and not a preset of its own",
    ),
    (
        "The same CI baselines' VoiceDesign stress run (100 prompts at 2 requests/s): "
        "TTFP 55.5 ms, RTF 0.151, 9.49x",
        "VoiceDesign is not a preset (above); the CustomVoice and Voxtral stress runs are rows",
    ),
    (
        "Code2Wav max_num_seqs 1 against 10 on one H100 (vllm-omni PR #3322, comment of "
        "2026-05-05 on main e49fbd8a), the absolute figures: TTFA p95 "
        "312/1,707/3,080/5,033/8,841 -> 317/764/1,503/4,201/8,401 ms and audio throughput "
        "3.64/7.68/11.53/13.60/13.14 -> 3.66/7.05/10.08/12.94/13.34x at c=1/4/8/16/32",
        "the table holds their ratios at c=4/8/16; h100-qwen3tts-1.7b-base is fitted to "
        "those ratios, the absolute figures weighted lightly: its TTFA p95 is 70 % low at "
        "c=1 and 43 % to 2.8x high at c=4-32, its throughput 60 % high at c=1 to 26 % low "
        "at c=32; at c=1 and 32 the run moved both figures by under 5 %",
    ),
    (
        "Code2Wav at batch 1 against cross-request batching (vllm-omni PR #3322, H20-3e, "
        "1.7B, c=4/8/16), the absolute figures: Base TTFA p95 3,293/8,313/12,638 -> "
        "1,063/1,927/6,719 ms, audio throughput 2.39/2.55/3.49x -> 2.34/2.74/3.36x",
        "the table holds their ratios; h20-qwen3tts-1.7b-base's own TTFA p95 is 4 % "
        "low to 25 % high, its throughput 2 % low to 37 % high (at 4 and 8 streams)",
    ),
    (
        "The same comparison for CustomVoice: TTFA p95 188/815/2,004 -> 275/474/2,341 ms, "
        "throughput 15.6/20.6/22.7x -> 9.7/15.1/17.6x",
        "no H20-3e CustomVoice preset; its 22-38 % throughput loss with batching is not "
        "fitted (docs/sim.md, not modelled)",
    ),
    ("Qwen3-TTS 0.6B on L4, 16.59x at batch 16 (third party)", "no 0.6B preset; [U]"),
    ("Qwen3-TTS custom engine on H100, 10 RPS (third party)", "not vLLM-Omni; [U]"),
    (
        "CosyVoice 2 on L20 (TRT-LLM): RTF 0.089 at c=1, first chunk 197/511/1,215 ms "
        "at c=1/4/10; CosyVoice 3 RTF 0.109",
        "no L20 preset; l4-cosyvoice2-0.5b is scaled from the L20 RTF, not fitted",
    ),
    ("VoxCPM2 on RTX 4090, L40, H100", "no VoxCPM2 preset"),
    ("Fish S2 Pro on H200 (SGLang): RTF 0.195, TTFA ~100 ms", "no Fish preset; [U]"),
    ("Orpheus 3B on A10G (vLLM 0.7.3): RTF ~1.57", "no A10G preset"),
)
