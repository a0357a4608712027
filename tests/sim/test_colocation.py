"""Two engines on one simulated GPU: each slows the other past a shared knee."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from proxy.sim.colocated_ceilings import colocated_ceiling, colocated_presets
from proxy.sim.presets import get_preset
from proxy.sim.sim_command import add_arguments, run
from proxy.sim.virtual_load import Rules, run_colocated, run_load

ASR, TTS = "h100-voxtral-realtime-4b", "h100-orpheus-3b"


def test_an_idle_engine_takes_no_gpu_time_from_a_busy_one() -> None:
    """An engine given 0 streams runs no step: the busy engine beside it measures what
    it measures with the GPU to itself, in either position (engine ``i`` is seeded
    from ``seed + 7 * i``)."""
    asr = get_preset(ASR)
    for name, n in ((TTS, 5), ("l40s-qwen3tts-1.7b", 9)):
        preset = get_preset(name)
        alone = run_load(preset, n)
        assert run_colocated([(preset, n), (asr, 0)]) == [alone, None]
        assert run_colocated([(asr, 0), (preset, n)]) == [None, run_load(preset, n, seed=7)]
    with pytest.raises(ValueError, match="concurrency must be >= 0"):
        run_colocated([(asr, -1)])
    with pytest.raises(ValueError, match="no engines"):
        run_colocated([])


def test_the_shares_size_each_kv_cache_and_must_fit_one_gpu() -> None:
    asr, tts = colocated_presets([ASR, TTS], [0.45, 0.45])
    assert asr.engine.kv_budget_bytes == pytest.approx(80e9 * 0.45 - 8.8e9 - 3e9)
    assert tts.engine.kv_budget_bytes == pytest.approx(80e9 * 0.45 - 6.6e9 - 3e9)
    assert tts.gpu_memory_utilization == 0.45
    with pytest.raises(ValueError, match="sums above 1"):
        colocated_presets([ASR, TTS], [0.6, 0.5])
    with pytest.raises(ValueError, match="must share one GPU model"):
        colocated_presets([ASR, "h200-voxtral-tts-4b"], [0.45, 0.45])
    with pytest.raises(ValueError, match="leaves no KV cache"):
        colocated_presets([ASR, TTS], [0.1, 0.45])


def test_each_engine_slows_the_other() -> None:
    asr, tts = colocated_presets([ASR, TTS], [0.45, 0.45])
    alone = run_colocated([(tts, 12), (asr, 0)])[0]
    beside = run_colocated([(tts, 12), (asr, 8)])[0]
    assert alone is not None and beside is not None
    # The GPU runs one step at a time: the TTS engine's steps wait for the ASR engine's.
    assert beside.aggregate_delivery_ratio < 0.8 * alone.aggregate_delivery_ratio
    assert beside.worst_1pct < alone.worst_1pct


def test_co_location_lowers_each_engines_ceiling() -> None:
    asr, tts = colocated_presets([ASR, TTS], [0.45, 0.45])
    rules = Rules()
    tts_alone = colocated_ceiling(tts, asr, 0)
    asr_alone = colocated_ceiling(asr, tts, 0)
    assert (tts_alone, asr_alone) == (24, 102)  # describe()'s ceilings (docs/sim.md)
    assert colocated_ceiling(tts, asr, 4, rules=rules) < tts_alone
    assert colocated_ceiling(asr, tts, 12, rules=rules) < asr_alone


def test_cli_colocate_reports_and_refuses_bad_shares(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    args = parser.parse_args(["--colocate", f"{ASR},{TTS}", "--gpu-memory-utilization",
                              "0.7,0.5"])  # fmt: skip
    assert run(args, out) == 2
    assert "sums above 1" in capsys.readouterr().err
    args = parser.parse_args(["--colocate", f"{ASR},{TTS}", "--gpu-memory-utilization", "x"])
    assert run(args, out) == 2
    assert "--gpu-memory-utilization: not numbers" in capsys.readouterr().err
    args = parser.parse_args(["--colocate", "h200-voxtral-tts-4b,h200-qwen3tts-1.7b", "--json"])
    assert run(args, out) == 0
    info = json.loads(out.getvalue())
    voxtral = info["engines"][0]
    assert voxtral["ceiling_alone"] == 34
    assert voxtral["ceiling_beside_other"] < voxtral["ceiling_alone_at_share"]
