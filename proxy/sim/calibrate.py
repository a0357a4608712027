"""Calibration from a live engine: its step cost against batch size, as a preset.

    headroom sim --calibrate URL [--tokens-per-audio-second 12.5] [--write FILE.json]
                 [--calibrate-batch-tokens N]   # the engine's per-step token budget
    headroom sim --describe FILE.json          # plan from the measured costs

:func:`measure` drives a running engine with the probe's client and workload
(:mod:`proxy.probe`) at a short ramp of concurrency levels (1, 2, 4, 8, 16 by default),
each held for a few seconds, and reads every stream's chunk arrivals and the engine's
prompt-token counter (``*prompt_tokens_total`` on its ``/metrics``) before and after
each level. Per level (:class:`LevelCost`):

- the **step time**: each request's wall time from its first to its last token in the
  window over the tokens between (an engine makes one token per sequence per step, so
  this is the mean step its request saw; it holds when the engine or the client
  delivers tokens in bursts, and leaves out the time to first token, where the
  client's and HTTP's own costs are), the median over the level's requests;
- the **tokens in a step**: the streams decoding (time-averaged over the window: a
  stream still in its prompt is not decoding, so the 16-stream level of a 16-slot
  server runs fewer than 16) plus the prompt tokens a step carries (the prompt tokens
  of the requests started per second, times the step time);
- the tail: the 95th percentile of the per-token arrival gaps (and their median);
- the **kinds of step** (:class:`StepGaps`, :func:`_step_gaps`): each arrival gap sorted
  by the step that ends it, the streams decoding in it and whether one newcomer's
  prompt piece shared it, with the mean gap of each kind; the spread of the steps
  beside a prompt piece, and the tail of those without.

:func:`fit` turns the levels into the simulator's step formula (docs/sim.md §1). When
the levels saw steps beside a prompt piece and decode-only steps at two batch sizes or
more, it fits the kinds of step (least squares on relative errors)::

    step = c0 + per_seq x decoding streams + per_token x tokens

where a decode-only step carries one token a stream and a step beside a prompt piece
as many as the engine's per-step budget (``batch_tokens``: llama.cpp's ``-b``, vLLM's
``--max-num-batched-tokens``) allows. On a token engine that step decides the ceiling
(the streams already speaking wait for it), so its cost is taken where it is measured
rather than extrapolated from levels where many prompts queue together. A negative
``per_seq`` is refitted as none; a fit with a negative term or a stream dearer than a
token (gaps a starved reader grouped) is not used. Otherwise, the level fit over the
tokens a step carries::

    step(tokens) = c0 + max(memory, per_token x tokens)   (least squares over the levels)

a floor the step never goes below (reading the weights) and a cost per token past it.
The engine takes prompts in pieces beside the decoding streams, within its budget, a
prompt token costing what a decoding one does; the preset runs the simulator's chunked
prefill (:class:`~proxy.sim.spec.EngineSpec`) with the measured prompt length, its
text part set by the audio the workload's requests ask for (:func:`_requested_audio`).
The tail of the steps without a prompt piece (the median over the levels of their 95th
percentile gap's excess over the median: a level whose window met a burst of other
work does not set it) is time the server or the client lost, not a share of the step:
an arrival late by a few milliseconds on a short step is late by as many on a long
one. So the preset carries it as a delay of each chunk (``delay_s``, the simulator's
``emit_jitter_s``: exponential, so the gap between two chunks differs from the step by
a Laplace variable whose 95th percentile, ``delay_s x ln 10``, is that excess). The
steps beside a prompt piece spread more: with the fit of the kinds of step, their 95th
percentile over their kind's mean (the median over the levels) is the preset's
step-time jitter, which the simulator scales with the step. The time to first
audio of one stream less the steps of its prompt and first token is ``admit_s``: the
client's, HTTP's and the server's own per-request work, reported but not charged to
any step. A :class:`Calibration` holds the measurement and the fit;
:meth:`Calibration.preset` makes the preset (chunks of the tokens an arrival carries,
``tokens_per_audio_second`` tokens per second of audio) that ``describe()`` rates like
any other, and ``as_json``/``from_json`` keep it in a file ``headroom sim --describe``
and ``--preset`` accept.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.sim.presets import TEXT_TOKENS_PER_AUDIO_S, Gpu, Preset, _preset

if TYPE_CHECKING:
    from proxy.probe.workload import Workload

__all__ = [
    "DEFAULT_LEVELS",
    "Calibration",
    "LevelCost",
    "StepGaps",
    "fit",
    "load_calibration",
    "measure",
    "render",
]

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
#: A stand-in card for a measured engine: the fitted terms carry all of its cost, so
#: the memory and compute terms of the formula are kept negligible.
_MEASURED = Gpu("measured engine", 1e15, 1e18, 1e18)
#: The per-step token budget of an engine whose budget is not given: prompts are then
#: taken whole, each token at the decoding cost.
_UNBOUNDED_BATCH = 1 << 20


#: A kind of step enters the fit when a level saw at least this many gaps of it.
_MIN_GAPS = 10
#: The tokens one engine step makes reach the client within this of each other.
_SAME_STEP_S = 0.002


@dataclass(frozen=True, slots=True)
class StepGaps:
    """The per-token arrival gaps of one kind of step a level saw: ``decoding`` streams
    each making a token, beside one newcomer's prompt piece (``prompt``) or alone."""

    decoding: int
    prompt: bool
    mean_s: float  #: seconds per token: the gaps' time over their tokens
    count: int  #: gaps measured


@dataclass(frozen=True, slots=True)
class LevelCost:
    """What one level of the ramp measured: ``batch`` concurrent streams."""

    batch: int
    tokens: int  #: tokens whose arrivals were measured
    mean_step_s: float  #: the step time: the median request's wall seconds per token
    p95_step_s: float  #: the 95th percentile of the per-arrival seconds per token
    ttfa_p50_s: float | None  #: median time to first audio of the level's streams
    #: streams decoding, time-averaged over the window (None: taken to be ``batch``)
    decoding: float | None = None
    prompt_tokens_per_step: float = 0.0  #: prompt tokens a step carried on average
    p50_step_s: float | None = None  #: the median per-arrival seconds per token
    steps: tuple[StepGaps, ...] = ()  #: the gaps by kind of step (:func:`_step_gaps`)
    #: the median and 95th percentile per-token gap of the steps without a prompt piece
    alone_p50_s: float | None = None
    alone_p95_s: float | None = None
    #: the 95th percentile of the steps beside a prompt piece over their kind's mean
    #: (kinds with at least ``_MIN_GAPS`` gaps; None: none measured)
    prompt_p95_ratio: float | None = None

    @property
    def step_tokens(self) -> float:
        """The tokens a step of this level carried: decoding streams and prompt pieces."""
        decoding = float(self.batch) if self.decoding is None else self.decoding
        return max(decoding + self.prompt_tokens_per_step, 1.0)


@dataclass(frozen=True, slots=True)
class Calibration:
    """A measured engine and the step formula fitted to it."""

    url: str
    protocol: str
    tokens_per_audio_second: float
    levels: tuple[LevelCost, ...]
    c0_s: float
    memory_s: float  #: the step's floor: the memory term of the formula
    per_stream_s: float  #: the cost of each token a step carries past the floor
    #: the step-time jitter: the spread of the steps beside a prompt piece (1: none)
    jitter_p95: float
    #: time to first audio alone that no engine step accounts for (client, HTTP, the
    #: server's per-request work); with ``prompt_tokens`` 0 (an older file) it is the
    #: prompt's cost, charged to the step that admits a request
    admit_s: float
    max_num_seqs: int
    measured_at: str = ""  #: when (ISO 8601, UTC)
    prompt_tokens: float = 0.0  #: mean prompt tokens per request (0: not measured)
    audio_per_request_s: float = 0.0  #: mean audio seconds per measured request
    batch_tokens: int | None = None  #: the engine's per-step token budget (None: unknown)
    chunk_tokens: int = 1  #: tokens an arrival carries (vLLM's --stream-interval)
    delay_s: float = 0.0  #: mean extra delay of each chunk (the decode-only steps' tail)
    per_seq_s: float = 0.0  #: the cost of each decoding stream in a step, past its token

    def step_s(self, batch: int) -> float:
        """The fitted mean step time at ``batch`` tokens a step (decoding streams)."""
        return self.preset().engine.mean_step_s(batch)

    def prompt_overhead(self) -> int:
        """The preset's prompt tokens beyond the text the simulator's load sends with
        each request (``TEXT_TOKENS_PER_AUDIO_S`` per audio second)."""
        text = TEXT_TOKENS_PER_AUDIO_S * self.audio_per_request_s
        return max(0, round(self.prompt_tokens - text))

    def preset(self, name: str = "calibrated") -> Preset:
        """The preset of this engine: chunks of ``chunk_tokens``, the fitted step costs,
        its prompts taken in pieces within its step budget."""
        rate = self.tokens_per_audio_second
        chunked = self.prompt_tokens > 0
        preset = _preset(
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
            c_seq=self.per_seq_s,
            fit_c0=False,
            vocoder_share=0.0,
            prefill_params=0.0,
            prefill_overhead_s=0.0 if chunked else self.admit_s,
            jitter_p95=self.jitter_p95,
            emit_jitter_s=self.delay_s,
            token_rate_hz=rate,
            sample_rate=24000,
            first_chunk=self.chunk_tokens,
            chunk=self.chunk_tokens,
            prompt_overhead=self.prompt_overhead() if chunked else 0,
            max_num_seqs=self.max_num_seqs,
            sources=tuple(
                f"measured: {lv.batch} streams ({lv.step_tokens:.1f} tokens a step), "
                f"{lv.mean_step_s * 1e3:.2f} ms per token (p95 {lv.p95_step_s * 1e3:.2f} ms) "
                f"over {lv.tokens} tokens"
                for lv in self.levels
            ),
            release=f"measured from {self.url} {self.measured_at}".rstrip(),
            published_rtf=None,
            expected_ceiling="calibrated: the probe measures it on the same engine",
        )
        if not chunked:
            return preset
        budget = self.batch_tokens or _UNBOUNDED_BATCH
        engine = replace(preset.engine, chunked_prefill=True, max_num_batched_tokens=budget)
        return replace(preset, engine=engine)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["levels"] = [asdict(lv) for lv in self.levels]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """The inverse of :meth:`as_json`; ``ValueError`` on a malformed document."""
        try:
            levels = tuple(
                LevelCost(**{**lv, "steps": tuple(StepGaps(**g) for g in lv.get("steps", ()))})
                for lv in data["levels"]
            )
            fields = {k: data[k] for k in ("url", "protocol", "tokens_per_audio_second",
                                           "c0_s", "memory_s", "per_stream_s", "jitter_p95",
                                           "admit_s",
                                           "max_num_seqs")}  # fmt: skip
            optional = {k: data[k] for k in ("prompt_tokens", "audio_per_request_s",
                                             "batch_tokens", "chunk_tokens", "delay_s",
                                             "per_seq_s")
                        if k in data}  # fmt: skip
            calibration = cls(levels=levels, measured_at=str(data.get("measured_at", "")),
                              **fields, **optional)  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a calibration document: {exc}") from None
        if not calibration.levels or calibration.c0_s <= 0 or calibration.max_num_seqs < 1:
            raise ValueError("a calibration needs levels, c0_s > 0 and max_num_seqs >= 1")
        if calibration.batch_tokens is not None and calibration.batch_tokens < 1:
            raise ValueError("a calibration's batch_tokens must be >= 1")
        if calibration.chunk_tokens < 1:
            raise ValueError("a calibration's chunk_tokens must be >= 1")
        if not calibration.jitter_p95 >= 1.0 or not calibration.delay_s >= 0.0:
            raise ValueError("a calibration needs jitter_p95 >= 1 and delay_s >= 0")
        if not calibration.per_seq_s >= 0.0:
            raise ValueError("a calibration's per_seq_s must be >= 0")
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
    prompt_tokens: float = 0.0,
    audio_per_request_s: float = 0.0,
    batch_tokens: int | None = None,
    chunk_tokens: int = 1,
) -> Calibration:
    """The step formula fitted to ``levels`` (at least one with measured tokens).

    With ``prompt_tokens`` (the mean prompt per request) the prompt is taken in
    pieces of the steps (:class:`Calibration`), and the time to first audio of one
    stream less its prompt's steps is reported as ``admit_s``; without it the whole of
    that time less one step is the admission cost, charged to the admitting step."""
    used = [lv for lv in levels if lv.tokens > 0 and lv.mean_step_s > 0]
    if not used:
        raise ValueError("no level measured any tokens: is the engine streaming?")
    if prompt_tokens < 0 or audio_per_request_s < 0:
        raise ValueError("prompt_tokens and audio_per_request_s must be >= 0")
    c0, memory, slope = _fit_step(used, batch_tokens)
    per_seq = 0.0
    kinds = _fit_step_kinds(used, batch_tokens, prompt_tokens) if prompt_tokens > 0 else None
    jitter = 1.0
    spreads = [lv.prompt_p95_ratio for lv in used if lv.prompt_p95_ratio is not None]
    if kinds is not None:
        c0, per_seq, slope = kinds
        memory = 0.0
        jitter = max(1.0, statistics.median(spreads)) if spreads else 1.0
    first = min(used, key=lambda lv: lv.batch)
    chunk = max(1, chunk_tokens)
    tails = [
        lv.alone_p95_s - lv.alone_p50_s
        for lv in used
        if lv.alone_p50_s is not None and lv.alone_p95_s is not None
    ]
    if tails:
        excess = statistics.median(tails)
    else:
        excess = first.p95_step_s - (first.p50_step_s or first.mean_step_s)
    delay = max(0.0, excess) * chunk / math.log(10)
    calibration = Calibration(
        url=url,
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        levels=tuple(levels),
        c0_s=c0,
        memory_s=memory,
        per_stream_s=slope,
        jitter_p95=jitter,
        admit_s=0.0,
        max_num_seqs=max_num_seqs,
        measured_at=measured_at,
        prompt_tokens=prompt_tokens,
        audio_per_request_s=audio_per_request_s,
        batch_tokens=batch_tokens,
        chunk_tokens=chunk,
        delay_s=delay,
        per_seq_s=per_seq,
    )
    ttfa = first.ttfa_p50_s
    if ttfa is None:
        return calibration
    if prompt_tokens <= 0:
        return replace(calibration, admit_s=max(0.0, ttfa - first.mean_step_s))
    return replace(calibration, admit_s=max(0.0, ttfa - _prompt_time(calibration)))


def _prompt_time(calibration: Calibration) -> float:
    """Seconds one request alone spends in engine steps up to its first token: its
    prompt in pieces of the step budget, the last piece yielding the first token."""
    spec = calibration.preset().engine
    budget = calibration.batch_tokens or _UNBOUNDED_BATCH
    left, seconds = max(1, round(calibration.prompt_tokens)), 0.0
    while left > 0:
        take = min(left, budget)
        seconds += spec.step_s(0, take)  # no stream decodes yet: no per-stream cost
        left -= take
    return seconds


def _fit_step_kinds(
    levels: Sequence[LevelCost], batch_tokens: int | None, prompt_tokens: float
) -> tuple[float, float, float] | None:
    """``(c0, per_seq, per_token)`` of ``c0 + per_seq x decoding + per_token x tokens``
    fitted (least squares on relative errors) to the mean gap of each kind of step
    the levels saw (:class:`StepGaps`, those with at least ``_MIN_GAPS`` gaps): steps
    of decoding streams alone carry one token each, steps beside a newcomer's prompt
    piece as many tokens as the budget allows. A negative cost per stream is refitted
    as none. None when the levels saw no step with a prompt piece or decode-only steps
    at fewer than two batch sizes, or when the fit gives a negative term or a stream's
    cost above a token's: the level fit (:func:`_fit_step`) then stands."""
    budget = float(batch_tokens) if batch_tokens else math.inf
    rows: list[tuple[float, float, float]] = []
    for lv in levels:
        for kind in lv.steps:
            if kind.count < _MIN_GAPS or kind.mean_s <= 0:
                continue
            tokens = min(budget, kind.decoding + prompt_tokens) if kind.prompt else kind.decoding
            rows.append((float(kind.decoding), tokens, kind.mean_s))
    alone = {d for d, tokens, _ in rows if tokens == d}
    if len(alone) < 2 or len(alone) == len(rows):
        return None
    # Normal equations of the weighted least squares (weights 1 / y, relative errors).
    a = [[0.0] * 3 for _ in range(3)]
    b = [0.0] * 3
    for d, tokens, y in rows:
        x = (1.0, d, tokens)
        for i in range(3):
            b[i] += x[i] * y / (y * y)
            for j in range(3):
                a[i][j] += x[i] * x[j] / (y * y)
    solution = _solve3(a, b)
    if solution is not None and solution[1] < 0:
        # No cost per stream past its token: the same fit without that term.
        a[1] = [0.0, 1.0, 0.0]
        a[0][1] = a[2][1] = b[1] = 0.0
        solution = _solve3(a, b)
    if solution is None:
        return None
    c0, per_seq, per_token = solution
    # A stream's own work in a step (sampling, sending) is less than its token's pass
    # through the model: a fit that says otherwise read gaps a starved reader grouped.
    if c0 <= 0 or per_token <= 0 or not 0 <= per_seq <= per_token:
        return None
    return c0, per_seq, per_token


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """The solution of the 3 x 3 system ``a x = b`` (Cramer's rule); None if singular."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    whole = det(a)
    scale = max(abs(v) for row in a for v in row) ** 3
    if abs(whole) <= 1e-12 * scale:
        return None
    x = []
    for col in range(3):
        m = [[b[i] if j == col else a[i][j] for j in range(3)] for i in range(3)]
        x.append(det(m) / whole)
    return x[0], x[1], x[2]


def _fit_step(
    levels: Sequence[LevelCost], batch_tokens: int | None = None
) -> tuple[float, float, float]:
    """``(c0, memory, per_token)`` minimising the squared relative error of
    ``c0 + max(memory, per_token x tokens)`` over ``levels`` (each level's tokens a
    step, at most ``batch_tokens``: prompts that wait for room in the steps are not in
    them): a grid over the floor's share and the slope, each candidate's c0 solved in
    closed form."""
    cap = float(batch_tokens) if batch_tokens else math.inf
    xs = [min(lv.step_tokens, cap) for lv in levels]
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


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _level_cost(
    batch: int, run: Any, tokens_per_audio_second: float, prompt_tokens: float = 0.0
) -> LevelCost:
    """One probe level's step time, tokens a step and tail (arrivals inside its
    measured window); ``prompt_tokens`` is the mean prompt of a request."""
    window = run.window
    span = max(window.ended_at - window.warm_end, 1e-9)
    per_token: list[float] = []
    per_request: list[float] = []
    tokens = 0.0
    decoding = 0.0
    prompting = 0.0  #: prompt tokens taken inside the window
    ttfas: list[float] = []
    for trace in run.traces:
        first = trace.first_output("tts")
        if first is not None and window.warm_end <= trace.started_at <= window.ended_at:
            ttfas.append(first - trace.started_at)
        # Its prompt is taken between its start and its first token, evenly (as far as
        # the client can tell): the part of that inside the window counts.
        begun, answered = trace.started_at, trace.ended_at if first is None else first
        inside_s = min(answered, window.ended_at) - max(begun, window.warm_end)
        if answered > begun and inside_s > 0:
            prompting += prompt_tokens * inside_s / (answered - begun)
        audio = [a for a in trace.arrivals if a.audio_s > 0.0]
        if audio:
            begin, end = max(audio[0].at, window.warm_end), min(audio[-1].at, window.ended_at)
            decoding += max(0.0, end - begin) / span
        inside = [a for a in audio if window.warm_end <= a.at <= window.ended_at]
        for arrival in inside:
            if arrival.gap is None:
                continue
            count = arrival.audio_s * tokens_per_audio_second
            tokens += count
            per_token.append(arrival.gap / count)
        if len(inside) >= 2:
            made = sum(a.audio_s for a in inside[1:]) * tokens_per_audio_second
            per_request.append((inside[-1].at - inside[0].at) / made)
    ttfa = statistics.median(ttfas) if ttfas else None
    if not per_token or not per_request:
        return LevelCost(batch, 0, 0.0, 0.0, ttfa)
    ordered = sorted(per_token)
    step = statistics.median(per_request)
    kinds, alone, spread = _step_gaps(run, tokens_per_audio_second)
    alone.sort()
    return LevelCost(
        steps=kinds,
        prompt_p95_ratio=spread,
        alone_p50_s=statistics.median(alone) if alone else None,
        alone_p95_s=_percentile(alone, 0.95) if alone else None,
        batch=batch,
        tokens=round(tokens),
        mean_step_s=step,
        p95_step_s=_percentile(ordered, 0.95),
        ttfa_p50_s=ttfa,
        decoding=decoding,
        prompt_tokens_per_step=prompting / span * step,
        p50_step_s=statistics.median(ordered),
    )


def _step_gaps(
    run: Any, tokens_per_audio_second: float
) -> tuple[tuple[StepGaps, ...], list[float], float | None]:
    """A level's per-token arrival gaps by the kind of step that ends each (their mean:
    time over tokens, which arrivals grouped by a late reader leave unchanged): the streams
    decoding in it (those with tokens before and after the gap), and whether one other
    request was in its prompt throughout (sent before the gap began, its first token
    not before the gap's end). A gap that another prompt covers only in part (the
    newcomer was sent during the step) or that two prompts share is left out. Also the
    per-token gaps of the steps without a prompt piece, one by one, and the spread of
    the steps beside a prompt piece: the 95th percentile of each gap over its kind's
    mean (kinds with at least ``_MIN_GAPS`` gaps; None without)."""
    window = run.window
    spans: list[tuple[float, float, float | None]] = []  #: (sent, first token, last token)
    for trace in run.traces:
        audio = [a.at for a in trace.arrivals if a.audio_s > 0.0]
        spans.append(
            (trace.started_at, audio[0] if audio else trace.ended_at, audio[-1] if audio else None)
        )
    gaps: dict[tuple[int, bool], list[tuple[float, float]]] = {}  #: (gap, tokens)
    for i, trace in enumerate(run.traces):
        for arrival in trace.arrivals:
            if arrival.audio_s <= 0.0 or arrival.gap is None:
                continue
            if not window.warm_end <= arrival.at <= window.ended_at:
                continue
            begin, end = arrival.at - arrival.gap, arrival.at
            prompting = [
                (sent, first)
                for j, (sent, first, _) in enumerate(spans)
                if j != i and sent < end and first + _SAME_STEP_S > begin
            ]
            if len(prompting) > 1:
                continue
            if prompting and not (
                prompting[0][0] <= begin and end <= prompting[0][1] + _SAME_STEP_S
            ):
                continue
            decoding = sum(
                1
                for _, first, last in spans
                if last is not None and first <= begin + _SAME_STEP_S and last >= end - _SAME_STEP_S
            )
            tokens = arrival.audio_s * tokens_per_audio_second
            gaps.setdefault((decoding, bool(prompting)), []).append((arrival.gap, tokens))
    kinds = tuple(
        StepGaps(decoding, prompt, sum(g for g, _ in pairs) / sum(t for _, t in pairs), len(pairs))
        for (decoding, prompt), pairs in sorted(gaps.items())
    )
    alone = [g / t for (_, prompt), pairs in gaps.items() if not prompt for g, t in pairs]
    ratios = sorted(
        g / t / kind.mean_s
        for kind in kinds
        if kind.prompt and kind.count >= _MIN_GAPS and kind.mean_s > 0
        for g, t in gaps[(kind.decoding, True)]
    )
    return kinds, alone, _percentile(ratios, 0.95) if ratios else None


async def _prompt_counter(http: Any, url: str) -> float | None:
    """The engine's prompt tokens so far: the sum of its ``*prompt_tokens_total``
    samples on ``/metrics`` (llama.cpp's server and vLLM both keep one); None when
    the page or the counter is missing."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await http.get(url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    total, seen = 0.0, False
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith("prompt_tokens_total"):
                total += sample.value
                seen = True
    return total if seen else None


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
    batch_tokens: int | None = None,
) -> Calibration:
    """Ramp the engine at ``url`` through ``levels`` and fit its step costs.

    ``max_num_seqs`` is the engine's own batch limit (its slots); by default the
    largest level measured. ``batch_tokens`` is its per-step token budget (llama.cpp's
    ``-b``, vLLM's ``--max-num-batched-tokens``; None: prompts are taken whole).
    ``workload`` is the probe's (default its bundled TTS texts): an engine that needs
    fields in each request (vLLM's running usage, ``ignore_eos``) gets them through
    the workload's ``extra``."""
    import time

    import httpx

    from proxy.probe.probe_session import ClientOptions, endpoint_url
    from proxy.probe.ramp import ProbeSettings, run_probe
    from proxy.probe.workload import bundled

    if not levels or min(levels) < 1:
        raise ValueError("calibration levels must be integers >= 1")
    if tokens_per_audio_second <= 0 or hold_s <= 0 or warmup_s < 0:
        raise ValueError("tokens_per_audio_second and hold_s must be > 0, warmup_s >= 0")
    if batch_tokens is not None and batch_tokens < 1:
        raise ValueError("batch_tokens must be >= 1")
    client = ClientOptions(
        url=endpoint_url(url, protocol),
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        model=model,
    )
    runs: list[Any] = []
    prompts = 0.0  #: prompt tokens the engine counted over every level
    counted = True  #: the engine's counter was read around every level
    async with httpx.AsyncClient(timeout=5.0) as http:
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
            before = await _prompt_counter(http, url)
            result = await run_probe(settings)
            after = await _prompt_counter(http, url)
            if not result.runs:
                raise ValueError(f"level {batch} was not measured: {result.stopped}")
            runs.append(result.runs[0])
            if before is None or after is None:
                counted = False
            else:
                prompts += after - before
    traces = [t for run in runs for t in run.traces]
    done = [t for t in traces if t.outcome == "ok"]
    mean_prompt = prompts / len(traces) if counted and traces else 0.0
    audio = _requested_audio(client, workload or bundled("tts"))
    if audio is None:
        audio = sum(a.audio_s for t in done for a in t.arrivals) / len(done) if done else 0.0
    carried = [a.audio_s * tokens_per_audio_second for t in traces for a in t.arrivals
               if a.audio_s > 0]  # fmt: skip
    chunk = max(1, round(statistics.median(carried))) if carried else 1
    costs = [
        _level_cost(batch, run, tokens_per_audio_second, mean_prompt)
        for batch, run in zip(levels, runs, strict=True)
    ]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return fit(
        costs,
        url=url,
        protocol=protocol,
        tokens_per_audio_second=tokens_per_audio_second,
        max_num_seqs=max_num_seqs or max(levels),
        measured_at=stamp,
        prompt_tokens=mean_prompt,
        audio_per_request_s=audio if mean_prompt else 0.0,
        batch_tokens=batch_tokens,
        chunk_tokens=chunk,
    )


def _requested_audio(client: Any, workload: Workload) -> float | None:
    """The mean audio seconds the workload's requests ask for (by their weights): the
    audio the prompts counted on ``/metrics`` belong to. The requests that finished in
    a level's window are the short ones, so their audio would put a long prompt on
    short speech. None when the protocol does not size its requests (only a token
    stream's ``max_tokens`` does)."""
    from proxy.probe.completions_session import completion_body
    from proxy.probe.workload import SpeechRequest

    if client.protocol != "openai-completions-tokens":
        return None
    total = weights = 0.0
    for request in workload.requests:
        if not isinstance(request, SpeechRequest):
            return None
        tokens = completion_body(client, request)["max_tokens"]
        total += request.weight * tokens / client.tokens_per_audio_second
        weights += request.weight
    return total / weights if weights > 0 else None


def render(calibration: Calibration) -> str:
    """The measured levels and the fit, as ``headroom sim --calibrate`` prints them."""
    lines = [
        f"engine {calibration.url} ({calibration.protocol}, "
        f"{calibration.tokens_per_audio_second:g} tokens per audio second)",
        "  streams  tokens/step  tokens  ms/token (median request, p95)  fitted  TTFA p50",
    ]
    for lv in calibration.levels:
        ttfa = "-" if lv.ttfa_p50_s is None else f"{lv.ttfa_p50_s * 1e3:.0f} ms"
        fitted = calibration.step_s(max(1, round(lv.step_tokens)))
        lines.append(
            f"  {lv.batch:7d}  {lv.step_tokens:11.1f}  {lv.tokens:6d}  "
            f"{lv.mean_step_s * 1e3:8.2f}, {lv.p95_step_s * 1e3:8.2f}  "
            f"{fitted * 1e3:8.2f}  {ttfa}"
        )
    budget = calibration.batch_tokens or "unbounded"
    jitter = f"each chunk delayed {calibration.delay_s * 1e3:.1f} ms on average"
    if calibration.jitter_p95 > 1.0:
        jitter = f"step jitter p95 {calibration.jitter_p95:.2f}; {jitter}"
    prompt = (
        f"prompt {calibration.prompt_tokens:.1f} tokens a request, taken in steps of "
        f"{budget} tokens; not in any step: {calibration.admit_s * 1e3:.1f} ms"
        if calibration.prompt_tokens > 0
        else f"admission {calibration.admit_s * 1e3:.1f} ms"
    )
    beside = [
        f"{kind.decoding} decoding {kind.mean_s * 1e3:.1f} ms ({kind.count} gaps)"
        for lv in calibration.levels
        for kind in lv.steps
        if kind.prompt and kind.count >= _MIN_GAPS
    ]
    if beside:
        lines.append("  steps beside a prompt piece: " + ", ".join(beside))
    per_seq = (
        f" + {calibration.per_seq_s * 1e3:.4f} ms x decoding streams"
        if calibration.per_seq_s > 0
        else ""
    )
    lines.append(
        f"fit: step = {calibration.c0_s * 1e3:.3f} ms{per_seq} + "
        f"max({calibration.memory_s * 1e3:.3f} ms, "
        f"{calibration.per_stream_s * 1e3:.4f} ms x tokens); {jitter}; {prompt}; "
        f"max_num_seqs {calibration.max_num_seqs}; "
        f"{calibration.chunk_tokens} tokens a chunk"
    )
    return "\n".join(lines)
