"""The overload proof in a short configuration: real processes, real sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.overload import _cap, _trace_from, _trace_json, build_parser, main
from proxy.probe.analysis import Arrival, SessionTrace
from proxy.sim.presets import get_preset


def test_headroom_keeps_admitted_streams_realtime_while_direct_stalls(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    # Cap a little under the preset's ceiling (21): a 6 s window on a loaded 2-core CI
    # machine has less margin for the client's own scheduling jitter than a long run.
    assert main(["--preset", "h100-orpheus-3b", "--cap", "18", "--load", "3", "--hold", "6",
                 "--warmup", "2", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    headroom, direct = result["headroom"], result["direct"]
    assert result["users"] == 54
    # The load came from several load-generator processes, merged into one analysis.
    assert headroom["clients"] == direct["clients"] == 4
    # Headroom: admitted streams never stall; the excess is refused at once
    assert headroom["underruns"] == 0
    assert headroom["worst_delivery_ratio"] >= 1.2
    assert headroom["sessions_refused"] > 0 and headroom["errors"] == 0
    assert headroom["refusal_latency_p99_s"] < 1.0
    # Direct: everyone admitted, everyone slows below realtime
    assert direct["sessions_refused"] == 0
    assert direct["underruns"] > 0
    assert direct["worst_delivery_ratio"] < 1.0


def test_a_workers_traces_survive_the_trip_between_processes() -> None:
    trace = SessionTrace(
        started_at=10.0, ended_at=14.5, outcome="ok",
        arrivals=(Arrival(10.2, 0.32, None, None), Arrival(11.0, 2.0, 0.8, 2.5)),
        underruns=((11.0, 0.28),), detail="",
    )  # fmt: skip
    assert _trace_from(json.loads(json.dumps(_trace_json(trace)))) == trace


def test_the_cap_comes_from_the_probe_when_asked(tmp_path: Path) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"ceiling": 6, "ceiling_range": [5, 6], "limited_by": ["stalls"]}))
    preset = get_preset("l40s-qwen3tts-1.7b")
    args = build_parser().parse_args(["--cap-from", str(probe)])
    # The low end of the probe's range (6 passed once and failed once), not its ceiling.
    assert _cap(args, preset) == (5, f"headroom probe ({probe}), the low end of its ceiling_range")
    assert _cap(build_parser().parse_args(["--cap", "3"]), preset) == (3, "--cap")
    probe.write_text(json.dumps({"ceiling": 0}))
    with pytest.raises(SystemExit, match="ceiling is 0"):
        _cap(args, preset)


def test_the_default_cap_is_the_low_end_of_the_ceiling_over_seeds() -> None:
    from proxy.sim.capacity import describe

    preset = get_preset("l40s-qwen3tts-1.7b").with_schedule(ramp=(4, 4, 8, 16, 25))
    args = build_parser().parse_args(["--codec-chunk-ramp", "4,4,8,16,25"])
    cap, source = _cap(args, preset)
    info = describe(preset)
    assert cap == info["recommended_cap"] <= min(info["ceiling_by_seed"].values())
    assert "over seeds 0, 1, 2, 3, 4" in source
