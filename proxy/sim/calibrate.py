"""Calibration from a live engine: its step cost against batch size, as a preset.

    headroom sim --calibrate URL [--tokens-per-audio-second 12.5] [--write FILE.json]
    headroom sim --describe FILE.json          # plan from the measured costs

:func:`measure` drives a running engine with the probe's client and workload
(:mod:`proxy.probe`) at a short ramp of concurrency levels (1, 2, 4, 8, 16 by default),
each held for a few seconds, and reads every stream's chunk arrivals. A streaming
engine makes one token per sequence per step, so the wall time between a stream's
chunks divided by the tokens they carry is the step time at that load. Per level it
keeps the mean and the 95th percentile of those per-token times and the median time
to first audio.

:func:`fit` turns the levels into the simulator's step formula (docs/sim.md §1)::

    step(batch) = c0 + max(memory, per_stream x batch)   (least squares over the levels)

a floor the step never goes below (reading the weights) and a cost per stream past
it, with the tail of the measured per-token times as the step-time jitter. The time
to first audio of one stream, less one step, is the cost of admitting a request
(``admit_s``: its prompt), charged to the step that admits it, as the simulator
charges a prefill: every running stream waits for it. A
:class:`Calibration` holds the measurement and the fit; :meth:`Calibration.preset`
makes the preset (one chunk per token, ``tokens_per_audio_second`` tokens per second
of audio) that ``describe()`` rates like any other, and ``to_json``/``from_json``
keep it in a file ``headroom sim --describe`` and ``--preset`` accept.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.sim.presets import Gpu, Preset, _preset

if TYPE_CHECKING:
    from proxy.probe.workload import Workload

__all__ = [
    "DEFAULT_LEVELS",
    "Calibration",
    "LevelCost",
    "fit",
    "load_calibration",
    "measure",
    "render",
]

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
#: A stand-in card for a measured engine: the fitted terms carry all of its cost, so
#: the memory and compute terms of the formula are kept negligible.
_MEASURED = Gpu("measured engine", 1e15, 1e18, 1e18)
#: The jitter a fit may carry: the simulator's log-normal needs p95 >= 1, and a
#: measured tail past 3x the mean is a stall, not jitter.
_JITTER_RANGE = (1.0, 3.0)


@dataclass(frozen=True, slots=True)
class LevelCost:
    """What one level of the ramp measured: ``batch`` concurrent streams."""

    batch: int
    tokens: int  #: tokens whose arrival gaps were measured
    mean_step_s: float  #: wall seconds per token, all measured gaps together
    p95_step_s: float  #: the 95th percentile of the per-arrival seconds per token
    ttfa_p50_s: float | None  #: median time to first audio of the level's streams


@dataclass(frozen=True, slots=True)
class Calibration:
    """A measured engine and the step formula fitted to it."""

    url: str
    protocol: str
    tokens_per_audio_second: float
    levels: tuple[LevelCost, ...]
    c0_s: float
    memory_s: float  #: the step's floor: the memory term of the formula
    per_stream_s: float
    jitter_p95: float
    admit_s: float  #: per admitted request: time to first audio alone less one step
    max_num_seqs: int
    measured_at: str = ""  #: when (ISO 8601, UTC)

    def step_s(self, batch: int) -> float:
        """The fitted mean step time at ``batch`` sequences."""
        return self.c0_s + max(self.memory_s, self.per_stream_s * batch)

    def preset(self, name: str = "calibrated") -> Preset:
        """The preset of this engine: one chunk per token, the fitted step costs."""
        rate = self.tokens_per_audio_second
        return _preset(
            name=name,
            kind="tts",
            model="calibrated",
            gpu=_MEASURED,
            description=f"the engine at {self.url} ({self.protocol}), step costs measured",
            weight_bytes=max(self.memory_s, 1e-9) * _MEASURED.bandwidth,
            resident_bytes=0.0,
            activations=0.0,
            kv_per_token=1,
            f_eff=max(self.per_stream_s, 1e-9) * _MEASURED.peak_flops,
            c0=self.c0_s,
            fit_c0=False,
            vocoder_share=0.0,
            prefill_params=0.0,
            prefill_overhead_s=self.admit_s,
            jitter_p95=self.jitter_p95,
            token_rate_hz=rate,
            sample_rate=24000,
            first_chunk=1,
            chunk=1,
            prompt_overhead=0,
            max_num_seqs=self.max_num_seqs,
            sources=tuple(
                f"measured: {lv.batch} streams, {lv.mean_step_s * 1e3:.2f} ms per token "
                f"(p95 {lv.p95_step_s * 1e3:.2f} ms) over {lv.tokens} tokens"
                for lv in self.levels
            ),
            release=f"measured from {self.url} {self.measured_at}".rstrip(),
            published_rtf=None,
            expected_ceiling="calibrated: the probe measures it on the same engine",
        )

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["levels"] = [asdict(lv) for lv in self.levels]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """The inverse of :meth:`as_json`; ``ValueError`` on a malformed document."""
        try:
            levels = tuple(LevelCost(**lv) for lv in data["levels"])
            fields = {k: data[k] for k in ("url", "protocol", "tokens_per_audio_second",
                                           "c0_s", "memory_s", "per_stream_s", "jitter_p95",
                                           "admit_s",
                                           "max_num_seqs")}  # fmt: skip
            calibration = cls(levels=levels, measured_at=str(data.get("measured_at", "")),
                              **fields)  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a calibration document: {exc}") from None
        if not calibration.levels or calibration.c0_s <= 0 or calibration.max_num_seqs < 1:
            raise ValueError("a calibration needs levels, c0_s > 0 and max_num_seqs >= 1")
        return calibration


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file written by ``headroom sim --calibrate URL --write FILE``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read calibration {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a calibration is a JSON object")
    return Calibration.from_json(data)


def fit(
    levels: Sequence[LevelCost],
    *,
    url: str,
    protocol: str,
    tokens_per_audio_second: float,
    max_num_seqs: int,
    measured_at: str = "",
) -> Calibration:
    """The step formula fitted to ``levels`` (at least one with measured tokens)."""
    used = [lv for lv in levels if lv.tokens > 0 and lv.mean_step_s > 0]
    if not used:
        raise ValueError("no level measured any tokens: is the engine streaming?")
    c0, memory, slope = _fit_step(used)
    tails = [lv.p95_step_s / lv.mean_step_s for lv in used]
    low, high = _JITTER_RANGE
    jitter = min(high, max(low, statistics.median(tails)))
    first = min(used, key=lambda lv: lv.batch)
    ttfa = first.ttfa_p50_s
    admit = max(0.0, ttfa - first.mean_step_s) if ttfa is not None else 0.0
    return Calibration(
        url=url,
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        levels=tuple(levels),
        c0_s=c0,
        memory_s=memory,
        per_stream_s=slope,
        jitter_p95=jitter,
        admit_s=admit,
        max_num_seqs=max_num_seqs,
        measured_at=measured_at,
    )


def _fit_step(levels: Sequence[LevelCost]) -> tuple[float, float, float]:
    """``(c0, memory, per_stream)`` minimising the squared relative error of
    ``c0 + max(memory, per_stream x batch)`` over ``levels``: a grid over the floor's
    share and the slope, each candidate's c0 solved in closed form."""
    xs = [float(lv.batch) for lv in levels]
    ys = [lv.mean_step_s for lv in levels]
    low = min(ys)
    slopes = {0.0, *(y / x for x, y in zip(xs, ys, strict=True))}
    for i in range(len(xs)):
        for j in range(len(xs)):
            if xs[j] > xs[i] and ys[j] > ys[i]:
                slopes.add((ys[j] - ys[i]) / (xs[j] - xs[i]))
    best: tuple[float, float, float, float] | None = None
    for slope in sorted(slopes):
        for step in range(41):
            memory = low * step / 40
            shape = [max(memory, slope * x) for x in xs]
            # c0 minimising sum(((c0 + f) / y - 1)^2): weighted least squares.
            c0 = sum((y - f) / (y * y) for f, y in zip(shape, ys, strict=True)) / sum(
                1 / (y * y) for y in ys
            )
            if c0 < -1e-9 * low:
                continue
            c0 = max(c0, 1e-6 * low)  # the simulator needs a positive c0
            error = sum(((c0 + f) / y - 1) ** 2 for f, y in zip(shape, ys, strict=True))
            if best is None or error < best[0]:
                best = (error, c0, memory, slope)
    if best is None:  # every candidate put the whole cost past the floor
        return 0.05 * low, 0.0, statistics.fmean(y / x for x, y in zip(xs, ys, strict=True))
    return best[1], best[2], best[3]


def _level_cost(batch: int, run: Any, tokens_per_audio_second: float) -> LevelCost:
    """One probe level's per-token step times (arrivals inside its measured window)."""
    window = run.window
    per_token: list[float] = []
    wall = tokens = 0.0
    ttfas: list[float] = []
    for trace in run.traces:
        first = trace.first_output("tts")
        if first is not None and window.warm_end <= trace.started_at <= window.ended_at:
            ttfas.append(first - trace.started_at)
        for arrival in trace.arrivals:
            if arrival.gap is None or arrival.audio_s <= 0.0:
                continue
            if not window.warm_end <= arrival.at <= window.ended_at:
                continue
            count = arrival.audio_s * tokens_per_audio_second
            wall += arrival.gap
            tokens += count
            per_token.append(arrival.gap / count)
    if not per_token:
        return LevelCost(batch, 0, 0.0, 0.0, statistics.median(ttfas) if ttfas else None)
    ordered = sorted(per_token)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return LevelCost(
        batch=batch,
        tokens=round(tokens),
        mean_step_s=wall / tokens,
        p95_step_s=p95,
        ttfa_p50_s=statistics.median(ttfas) if ttfas else None,
    )


async def measure(
    url: str,
    *,
    protocol: str = "openai-completions-tokens",
    tokens_per_audio_second: float = 12.5,
    levels: Sequence[int] = DEFAULT_LEVELS,
    hold_s: float = 6.0,
    warmup_s: float = 3.0,
    seed: int = 0,
    max_num_seqs: int | None = None,
    model: str | None = None,
    workload: Workload | None = None,
) -> Calibration:
    """Ramp the engine at ``url`` through ``levels`` and fit its step costs.

    ``max_num_seqs`` is the engine's own batch limit (its slots); by default the
    largest level measured. ``workload`` is the probe's (default its bundled TTS
    texts): an engine that needs fields in each request (vLLM's running usage,
    ``ignore_eos``) gets them through the workload's ``extra``."""
    import time

    from proxy.probe.probe_session import ClientOptions, endpoint_url
    from proxy.probe.ramp import ProbeSettings, run_probe
    from proxy.probe.workload import bundled

    if not levels or min(levels) < 1:
        raise ValueError("calibration levels must be integers >= 1")
    if tokens_per_audio_second <= 0 or hold_s <= 0 or warmup_s < 0:
        raise ValueError("tokens_per_audio_second and hold_s must be > 0, warmup_s >= 0")
    client = ClientOptions(
        url=endpoint_url(url, protocol),
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        model=model,
    )
    costs: list[LevelCost] = []
    for batch in levels:
        settings = ProbeSettings(
            client=client,
            workload=workload or bundled("tts"),
            levels=(batch,),
            extend=False,
            bisect=False,
            hold_s=hold_s,
            warmup_s=warmup_s,
            seed=seed,
            time_limit_s=warmup_s + hold_s + 120.0,
            session_timeout_s=300.0,
            max_error_rate=1.0,
            preflight=False,
            max_stall_share=None,
            ttfa_limit_s=None,
        )
        result = await run_probe(settings)
        if not result.runs:
            raise ValueError(f"level {batch} was not measured: {result.stopped}")
        costs.append(_level_cost(batch, result.runs[0], tokens_per_audio_second))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return fit(
        costs,
        url=url,
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        max_num_seqs=max_num_seqs or max(levels),
        measured_at=stamp,
    )


def render(calibration: Calibration) -> str:
    """The measured levels and the fit, as ``headroom sim --calibrate`` prints them."""
    lines = [
        f"engine {calibration.url} ({calibration.protocol}, "
        f"{calibration.tokens_per_audio_second:g} tokens per audio second)",
        "  streams  tokens  ms/token (mean, p95)  fitted  TTFA p50",
    ]
    for lv in calibration.levels:
        ttfa = "-" if lv.ttfa_p50_s is None else f"{lv.ttfa_p50_s * 1e3:.0f} ms"
        lines.append(
            f"  {lv.batch:7d}  {lv.tokens:6d}  {lv.mean_step_s * 1e3:8.2f}, "
            f"{lv.p95_step_s * 1e3:8.2f}  {calibration.step_s(lv.batch) * 1e3:8.2f}  {ttfa}"
        )
    lines.append(
        f"fit: step = {calibration.c0_s * 1e3:.3f} ms + max({calibration.memory_s * 1e3:.3f} ms, "
        f"{calibration.per_stream_s * 1e3:.4f} ms x streams); jitter p95 "
        f"{calibration.jitter_p95:.2f}; admission "
        f"{calibration.admit_s * 1e3:.1f} ms; max_num_seqs {calibration.max_num_seqs}"
    )
    return "\n".join(lines)
