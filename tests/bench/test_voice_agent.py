"""The voice-agent scenario (issue 19) in a short configuration: real processes, real
sockets, both modes against one gateway."""

from __future__ import annotations

import json
from pathlib import Path

from bench.voice_agent import build_parser, caps, classify, main, summarize
from proxy.probe.probe_session import Refusal, SessionFailed
from proxy.sim.capacity import describe


def test_reservations_leave_no_caller_heard_but_unanswered(tmp_path: Path) -> None:
    out = tmp_path / "voice.json"
    assert main(["--tts-cap", "3", "--load", "2", "--hold", "6", "--warmup", "2",
                 "--clients", "2", "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    plain, reserved = result["plain"], result["reserved"]
    assert result["users"] == 6 and result["asr_cap"] >= 6
    # Without reservations: ASR always admits, TTS (3 slots for 6 callers) refuses
    # callers after they spoke.
    assert plain["refused_at_start"] == 0
    assert plain["heard_not_answered"] > 0
    # With reservations: nobody is heard and then refused; refusals come first.
    assert reserved["heard_not_answered"] == 0
    assert reserved["refused_at_start"] > 0 and reserved["completed"] > 0
    assert plain["failed"] == reserved["failed"] == 0
    metrics = reserved["metrics"]
    assert metrics['headroom_reservation_refusals_total{pool="tts-main",reason="pool_full"}'] > 0
    assert metrics['headroom_reservations_total{outcome="granted"}'] > 0
    # Without reservations none were asked for.
    assert not any(k.startswith("headroom_reservations_total") for k in plain["metrics"])


def test_a_tts_refusal_after_asr_counts_as_heard_not_answered() -> None:
    assert classify(Refusal("pool_full", 1.0)) == ("heard_not_answered", "pool_full")
    rejected = SessionFailed("WebSocket handshake rejected: HTTP 409")
    assert classify(rejected)[0] == "heard_not_answered"
    assert classify(SessionFailed("connection closed early (1011)"))[0] == "failed"


def test_the_figures_count_only_calls_started_in_the_window() -> None:
    def call(at: float, outcome: str, took: float) -> dict[str, object]:
        return {"started_at": at, "ended_at": at + took, "outcome": outcome, "detail": outcome}

    records = [call(0.5, "heard_not_answered", 1.0),  # warm-up: not counted
               call(1.0, "completed", 5.0), call(2.0, "heard_not_answered", 1.0),
               call(3.0, "refused_at_start", 0.01), call(9.0, "failed", 1.0),
               call(10.0, "completed", 1.0)]  # after the window  # fmt: skip
    figures = summarize(records, 1.0, 10.0)
    assert figures["calls"] == 4
    assert (figures["completed"], figures["heard_not_answered"], figures["refused_at_start"],
            figures["failed"]) == (1, 1, 1, 1)  # fmt: skip
    assert figures["heard_not_answered_share"] == 0.25
    assert figures["heard_not_answered_told_p50_s"] == 1.0


def test_the_default_caps_are_the_presets_recommended_caps_over_seeds() -> None:
    (tts_cap, tts_from), (asr_cap, asr_from) = caps(build_parser().parse_args([]))
    assert tts_cap == describe("h100-orpheus-3b")["recommended_cap"]
    assert asr_cap == describe("h100-voxtral-realtime-4b")["recommended_cap"]
    assert "recommended_cap" in tts_from and "recommended_cap" in asr_from
    given = caps(build_parser().parse_args(["--tts-cap", "3", "--asr-cap", "9"]))
    assert given == ((3, "--tts-cap"), (9, "--asr-cap"))
