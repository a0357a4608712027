"""Calibration from a live engine: the fit, the preset it makes, its file and the CLI.

The round trip against a real engine (calibrate, predict, probe) is the slow test in
tests/real_engine/test_calibration.py.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from proxy.sim.calibrate import Calibration, LevelCost, fit, load_calibration, render
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
    assert cal.jitter_p95 == pytest.approx(1.4)
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
    assert "fit: step = 10.000 ms + max(0.000 ms, 4.0000 ms x streams)" in render(cal)


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
