"""Calibration from a live engine: the fit, the preset it makes, its file and the CLI.

The round trip against a real engine (calibrate, predict, probe) is the slow test in
tests/real_engine/test_calibration.py.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from proxy.probe.analysis import Arrival, LevelWindow, SessionTrace
from proxy.sim.calibrate import (
    Calibration,
    LevelCost,
    StepGaps,
    _level_cost,
    fit,
    load_calibration,
    render,
)
from proxy.sim.capacity import describe
from proxy.sim.sim_command import add_arguments, run


def _levels(c0: float, per_stream: float, tail: float = 1.2) -> list[LevelCost]:
    return [
        LevelCost(
            b, 400, c0 + per_stream * b, (c0 + per_stream * b) * tail, 0.05 if b == 1 else None
        )
        for b in (1, 2, 4, 8, 16)
    ]


def _fit(levels: list[LevelCost], slots: int = 16) -> Calibration:
    return fit(levels, url="http://127.0.0.1:1", protocol="openai-completions-tokens",
               tokens_per_audio_second=8.0, max_num_seqs=slots)  # fmt: skip


def test_the_fit_recovers_a_linear_step_cost_and_its_tail() -> None:
    cal = _fit(_levels(0.010, 0.004, tail=1.4))
    assert cal.c0_s == pytest.approx(0.010)
    assert cal.per_stream_s == pytest.approx(0.004)
    # The one-stream tail (p95 14 ms x 1.4 over a 14 ms median) is a delay of each chunk.
    assert cal.jitter_p95 == 1.0
    assert cal.delay_s == pytest.approx(0.014 * 0.4 / math.log(10))
    assert cal.preset().engine.emit_jitter_s == cal.delay_s
    assert cal.admit_s == pytest.approx(0.05 - 0.014)
    assert cal.step_s(8) == pytest.approx(0.042)


def test_a_flat_or_noisy_ramp_never_gives_a_negative_cost() -> None:
    falling = [LevelCost(b, 100, 0.02 - 0.0005 * b, 0.03, None) for b in (1, 2, 4, 8)]
    cal = _fit(falling)
    assert cal.c0_s > 0 and cal.step_s(8) <= cal.step_s(1) * 1.2
    steep = [LevelCost(b, 100, 0.01 * b, 0.012 * b, None) for b in (2, 4, 8)]
    cal = _fit(steep)
    assert cal.c0_s > 0 and cal.per_stream_s > 0


def test_a_ramp_without_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="no level measured any tokens"):
        _fit([LevelCost(1, 0, 0.0, 0.0, None)])


def test_the_calibrated_preset_predicts_the_ceiling_its_costs_imply() -> None:
    # 8 tokens per audio second: a step must stay under 1 / (8 x 1.2) = 104 ms; with
    # 20 ms + 8 ms per stream the mean reaches that at ~10 streams, the tail earlier.
    cal = _fit(_levels(0.020, 0.008, tail=1.1))
    preset = cal.preset("measured")
    assert preset.engine.mean_step_s(10) == pytest.approx(0.1, rel=0.01)
    info = describe(preset)
    assert 4 <= info["ceiling"] <= 10
    assert info["release"].startswith("measured from http://127.0.0.1:1")
    slower = describe(_fit(_levels(0.020, 0.016, tail=1.1)).preset("slower"))
    assert slower["ceiling"] < info["ceiling"]


def test_a_calibration_survives_its_file_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    cal = _fit(_levels(0.010, 0.004))
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cal.as_json()))
    assert load_calibration(path) == cal
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"levels": []}))
    with pytest.raises(ValueError, match="not a calibration document"):
        load_calibration(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_calibration(bad)
    assert "fit: step = 10.000 ms + max(0.000 ms, 4.0000 ms x tokens)" in render(cal)


def test_describe_accepts_a_calibration_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(_fit(_levels(0.010, 0.004)).as_json()))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    assert run(parser.parse_args(["--describe", str(path), "--json"]), out) == 0
    info = json.loads(out.getvalue())
    assert info["preset"] == "engine" and info["ceiling"] >= 1
    assert info["release"].startswith("measured from")


def test_a_measured_prompt_is_taken_in_pieces_of_the_engine_step() -> None:
    # 20 ms + 8 ms a token; a 40-token prompt in steps of 16 tokens: 3 steps (148, 148
    # and 84 ms); one stream's time to first audio 0.5 s, so 120 ms are in no step.
    levels = _levels(0.020, 0.008, tail=1.1)
    levels[0] = replace(levels[0], ttfa_p50_s=0.5)
    cal = fit(levels, url="http://127.0.0.1:1", protocol="openai-completions-tokens",
              tokens_per_audio_second=8.0, max_num_seqs=16, prompt_tokens=40.0,
              audio_per_request_s=8.0, batch_tokens=16, chunk_tokens=5)  # fmt: skip
    assert cal.admit_s == pytest.approx(0.5 - (0.148 + 0.148 + 0.084))
    preset = cal.preset("measured")
    assert preset.engine.chunked_prefill and preset.engine.max_num_batched_tokens == 16
    assert preset.engine.prefill_overhead_s == 0.0  # the rest is not the engine's step
    assert preset.prompt_overhead_tokens == 40 - 28  # 3.5 text tokens an audio second
    assert preset.first_chunk_tokens == preset.chunk_tokens == 5
    assert cal.step_s(16) == pytest.approx(0.020 + 16 * 0.008)
    assert Calibration.from_json(json.loads(json.dumps(cal.as_json()))) == cal
    assert "prompt 40.0 tokens a request, taken in steps of 16 tokens" in render(cal)


def test_a_level_reads_each_request_over_its_wall_time_and_the_prompts_in_its_steps() -> None:
    # Two streams in a 10 s window: one decodes throughout, its tokens arriving in
    # bursts of 4 every 0.4 s (100 ms a token); the other is in its prompt for the first
    # 2 s of the window (a 30-token prompt begun 1 s before it), then decodes likewise.
    window = LevelWindow(2, 0.0, 1.0, 11.0)

    def stream(start: float, first: float) -> SessionTrace:
        times = [first + 0.4 * i for i in range(int((11.0 - first) / 0.4) + 1)]
        arrivals = tuple(
            Arrival(at, 0.5, None if i == 0 else 0.4, None) for i, at in enumerate(times)
        )
        return SessionTrace(start, 11.0, "cancelled", arrivals)

    run = SimpleNamespace(window=window, traces=(stream(0.0, 0.5), stream(0.0, 3.0)))
    level = _level_cost(2, run, 8.0, prompt_tokens=30.0)
    assert level.mean_step_s == pytest.approx(0.1)
    assert level.p95_step_s == pytest.approx(0.1)
    # Decoding from the window's start (or its first token) to its last token: 9.9 s
    # (the first stream's last burst comes at 10.9 s) and 8 s.
    assert level.decoding == pytest.approx((9.9 + 8.0) / 10.0)
    # 20 of the prompt's 30 tokens fell in the window: 2 tokens a second, 0.2 a step.
    assert level.prompt_tokens_per_step == pytest.approx(0.2)
    assert level.step_tokens == pytest.approx(1.99)


def test_a_step_is_fitted_at_no_more_tokens_than_the_engine_batches() -> None:
    # The 16-stream level read 30 tokens a step (prompts waiting for room counted as
    # taken); with a budget of 16 it is fitted at 16, where 20 ms + 8 ms a token holds.
    levels = [
        LevelCost(b, 400, 0.020 + 0.008 * min(b, 16), 0.030, None, decoding=float(b))
        for b in (1, 2, 4, 8)
    ]
    levels.append(LevelCost(16, 400, 0.148, 0.2, None, decoding=14.0, prompt_tokens_per_step=16.0))
    cal = fit(levels, url="http://127.0.0.1:1", protocol="openai-completions-tokens",
              tokens_per_audio_second=8.0, max_num_seqs=16, prompt_tokens=40.0,
              batch_tokens=16)  # fmt: skip
    assert cal.c0_s == pytest.approx(0.020) and cal.per_stream_s == pytest.approx(0.008)


def test_a_level_sorts_its_gaps_by_the_step_that_ends_them() -> None:
    # Two streams decode from 0.5 s, a token every 50 ms; a third request is sent at
    # 4.0 s and its first token comes at 4.75 s: the steps between carry its prompt and
    # the two streams' tokens come 140 and 160 ms apart. The gap that began before it
    # was sent is left out (the step it ends did not carry the prompt).
    window = LevelWindow(3, 0.0, 1.0, 8.0)

    def stream(sent: float, at: list[float]) -> SessionTrace:
        arrivals = tuple(
            Arrival(t, 0.125, None if i == 0 else t - at[i - 1], None) for i, t in enumerate(at)
        )
        return SessionTrace(sent, 8.0, "cancelled", arrivals)

    decoding = [0.5 + 0.05 * i for i in range(71)]  # to 4.0 s
    decoding += [4.14, 4.3, 4.44, 4.6, 4.75] + [4.75 + 0.05 * i for i in range(1, 66)]
    newcomer = [4.75 + 0.05 * i for i in range(20)]
    run = SimpleNamespace(
        window=window, traces=(stream(0.0, decoding), stream(0.0, decoding), stream(4.0, newcomer))
    )
    level = _level_cost(3, run, 8.0, 60.0)
    kinds = {(k.decoding, k.prompt): k for k in level.steps}
    assert kinds[(2, True)].mean_s == pytest.approx(0.15)
    assert kinds[(2, True)].count == 2 * 5  # 4.14, 4.3, 4.44, 4.6 and 4.75 for each stream
    assert kinds[(2, False)].mean_s == pytest.approx(0.05)
    assert kinds[(3, False)].mean_s == pytest.approx(0.05)
    assert set(kinds) == {(2, True), (2, False), (3, False)}
    assert level.alone_p50_s == pytest.approx(0.05)
    assert level.alone_p95_s == pytest.approx(0.05)
    assert level.prompt_p95_ratio == pytest.approx(0.16 / 0.15)


def _kinds(c0: float, per_seq: float, per_token: float, budget: int = 16) -> list[LevelCost]:
    """Levels whose steps cost ``c0 + per_seq x decoding + per_token x tokens``."""

    def kind(decoding: int, prompt: bool) -> StepGaps:
        tokens = budget if prompt else decoding
        return StepGaps(decoding, prompt, c0 + per_seq * decoding + per_token * tokens, 50)

    levels = []
    for b in (1, 2, 4, 8):
        kinds = (kind(b, False), *([kind(b - 1, True)] if b > 1 else []))
        step = c0 + (per_seq + per_token) * b
        levels.append(LevelCost(b, 400, step, step * 1.1, 0.5 if b == 1 else None,
                                decoding=float(b), steps=kinds, alone_p50_s=step,
                                alone_p95_s=step + 0.004,
                                prompt_p95_ratio=None if b == 1 else 1.1))  # fmt: skip
    return levels


def test_the_fit_takes_the_cost_of_each_kind_of_step_and_a_cost_per_decoding_stream() -> None:
    # 20 ms + 2 ms a decoding stream + 5 ms a token: one stream decoding alone 27 ms, a
    # step of 3 streams beside a prompt piece (16 tokens) 106 ms.
    def calibrate(levels: list[LevelCost]) -> Calibration:
        return fit(levels, url="http://127.0.0.1:1", protocol="openai-completions-tokens",
                   tokens_per_audio_second=8.0, max_num_seqs=16, prompt_tokens=40.0,
                   audio_per_request_s=8.0, batch_tokens=16)  # fmt: skip

    levels = _kinds(0.020, 0.002, 0.005)
    cal = calibrate(levels)
    assert (cal.c0_s, cal.per_seq_s, cal.per_stream_s) == pytest.approx((0.020, 0.002, 0.005))
    assert cal.memory_s == 0.0
    # The steps beside a prompt piece spread 10 % (their 95th percentile over their
    # mean): the step jitter. The decode-only steps' tail, 4 ms past their median at
    # every level, is each chunk's delay.
    assert cal.jitter_p95 == pytest.approx(1.1)
    assert cal.delay_s == pytest.approx(0.004 / math.log(10))
    # One level's window met a burst of other work: the median over the levels holds.
    burst = [replace(levels[0], alone_p95_s=0.1), *levels[1:]]
    assert calibrate(burst).delay_s == pytest.approx(cal.delay_s)
    engine = cal.preset().engine
    assert engine.per_seq_overhead_s == cal.per_seq_s
    assert engine.mean_step_s(1) == pytest.approx(0.027)
    # A lone prompt's steps carry no decoding stream: 40 tokens in 16 + 16 + 8.
    assert cal.admit_s == pytest.approx(0.5 - (0.1 + 0.1 + 0.06))
    assert Calibration.from_json(json.loads(json.dumps(cal.as_json()))) == cal
    assert "+ 2.0000 ms x decoding streams + max(0.000 ms, 5.0000 ms x tokens)" in render(cal)
    assert "step jitter p95 1.10; each chunk delayed 1.7 ms" in render(cal)
    assert "steps beside a prompt piece: 1 decoding 102.0 ms (50 gaps)" in render(cal)
    # The step beside a prompt piece decides the ceiling: dearer, the ceiling falls.
    ceiling = describe(calibrate(_kinds(0.020, 0.001, 0.004)).preset())["ceiling"]
    assert ceiling >= 2
    assert describe(calibrate(_kinds(0.020, 0.004, 0.006)).preset())["ceiling"] < ceiling
    # Prompt steps cheaper than the decode-only steps imply: no cost per stream, and the
    # step beside a prompt piece stays near the measured one (113 ms beside 3 streams).
    cheaper = calibrate(_kinds(0.020, -0.001, 0.006))
    assert cheaper.per_seq_s == 0.0 and cheaper.memory_s == 0.0
    assert cheaper.c0_s + 16 * cheaper.per_stream_s == pytest.approx(
        0.020 + 0.096 - 0.003, rel=0.05
    )
    # No step with a prompt piece measured: the level fit stands, with no such cost.
    plain = [
        replace(lv, steps=tuple(k for k in lv.steps if not k.prompt))
        for lv in _kinds(0.020, 0.002, 0.005)
    ]
    assert calibrate(plain).per_seq_s == 0.0
    # Too few gaps of a kind: not used.
    sparse = [
        replace(lv, steps=tuple(replace(k, count=3) for k in lv.steps))
        for lv in _kinds(0.020, 0.002, 0.005)
    ]
    assert calibrate(sparse).per_seq_s == 0.0


def test_the_cli_passes_the_engine_step_budget_and_refuses_a_bad_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import proxy.sim.calibrate as calibrate

    seen: dict[str, object] = {}

    async def fake_measure(url: str, **kwargs: object) -> Calibration:
        seen.update(kwargs, url=url)
        return _fit(_levels(0.020, 0.008))

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--calibrate", "http://127.0.0.1:1", "--calibrate-batch-tokens"]
    with monkeypatch.context() as patched:
        patched.setattr(calibrate, "measure", fake_measure)
        assert run(parser.parse_args([*args, "16"]), io.StringIO()) == 0
    assert seen["url"] == "http://127.0.0.1:1" and seen["batch_tokens"] == 16
    # The real measure refuses it before it connects.
    assert run(parser.parse_args([*args, "0"]), io.StringIO()) == 2
    assert "batch_tokens must be >= 1" in capsys.readouterr().err


def test_the_prompts_belong_to_the_audio_the_requests_ask_for() -> None:
    from proxy.probe.probe_session import ClientOptions
    from proxy.probe.workload import SpeechRequest, Workload
    from proxy.sim.calibrate import _requested_audio

    def client(protocol: str = "openai-completions-tokens") -> ClientOptions:
        return ClientOptions(url="http://127.0.0.1:1/v1/completions", protocol=protocol,
                             tokens_per_audio_second=8.0)  # fmt: skip

    # 14 characters a second of speech: 28 and 70 characters ask for 2 s and 5 s, the
    # second drawn three times as often.
    texts = (SpeechRequest("a" * 28), SpeechRequest("b" * 70, weight=3.0))
    workload = Workload("tts", texts, "test")
    assert _requested_audio(client(), workload) == pytest.approx((2.0 + 3 * 5.0) / 4)
    # A max_tokens in the request's extra fields is what it asks for.
    fixed = Workload("tts", (SpeechRequest("a" * 28, extra={"max_tokens": 40}),), "test")
    assert _requested_audio(client(), fixed) == pytest.approx(5.0)
    assert _requested_audio(client("openai-speech"), workload) is None
