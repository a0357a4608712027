"""Chunk schedules and the codec stage, on the pure engine (virtual clock, no jitter)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.sim.chunks import ChunkSchedule, parse_ramp
from proxy.sim.engine import Emission, Engine
from proxy.sim.presets import get_preset
from proxy.sim.spec import CodecSpec
from tests.sim.test_engine import SPEC

QWEN = get_preset("h200-qwen3tts-1.7b").schedule


def test_qwen3_tts_first_chunk_follows_the_load_quartile() -> None:
    # running / max_num_seqs: (0, 1/4] -> 2, (1/4, 1/2] -> 4, (1/2, 3/4] -> 8, above -> 16
    firsts = {n: QWEN.plan(n, 10)[0] for n in range(1, 11)}
    assert firsts == {1: 2, 2: 2, 3: 4, 4: 4, 5: 4, 6: 8, 7: 8, 8: 16, 9: 16, 10: 16}
    assert QWEN.steady == 25 and QWEN.left_context == 72


def test_engine_options_replace_the_start() -> None:
    assert QWEN.with_first(8).plan(10, 10) == (8,)  # initial_codec_chunk_frames
    assert QWEN.with_ramp((4, 4, 8, 16, 25)).plan(10, 10) == (4, 4, 8, 16, 25)
    assert parse_ramp("[4, 4,8,16,25]") == (4, 4, 8, 16, 25)
    for bad in ("4,x", "", "0,4"):
        with pytest.raises(ValueError, match="ramp"):
            parse_ramp(bad)
    with pytest.raises(ValueError, match=">= 1"):
        ChunkSchedule(steady=0)


def sizes(engine: Engine, seq: int) -> list[int]:
    out: list[int] = []
    now = 0.0
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        out += [e.end - e.start for e in step.emissions if e.seq_id == seq]
    out += [e.end - e.start for e in engine.drain_codec() if e.seq_id == seq]
    return out


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("h200-voxtral-tts-4b", [5, 5, 5, 5, 5, 25, 25, 25, 25, 25, 25, 25, 25, 25, 25, 25]),
        ("l4-cosyvoice2-0.5b", [25, 50, 100, 100, 100, 100, 25]),
        ("h100-orpheus-3b", [28] + [7] * 53 + [1]),
    ],
)
def test_presets_chunk_like_their_engines(preset: str, expected: list[int]) -> None:
    schedule = get_preset(preset).schedule
    engine = Engine(SPEC)
    seq = engine.submit(now=0.0, prompt_tokens=10, output_tokens=sum(expected), schedule=schedule)
    assert sizes(engine, seq) == expected


def test_load_dependent_first_chunk_in_the_engine() -> None:
    engine = Engine(replace(SPEC, max_num_seqs=4))
    ids = [
        engine.submit(now=0.0, prompt_tokens=1, output_tokens=60, schedule=QWEN) for _ in range(4)
    ]
    firsts: dict[int, int] = {}
    now = 0.0
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        for e in step.emissions:
            firsts.setdefault(e.seq_id, e.end - e.start)
    # Admitted in one step, one after the other: 1/4 -> 2, 2/4 -> 4, 3/4 -> 8, 4/4 -> 16
    assert [firsts[i] for i in ids] == [2, 4, 8, 16]


def test_codec_stage_decodes_after_the_step_one_call_at_a_time() -> None:
    codec = CodecSpec(batch=1, call_s=0.010, frame_s=0.001)
    engine = Engine(replace(SPEC, codec=codec))
    schedule = ChunkSchedule(steady=3, initial=(2,), left_context=4)
    a = engine.submit(now=0.0, prompt_tokens=0, output_tokens=5, schedule=schedule)
    b = engine.submit(now=0.0, prompt_tokens=0, output_tokens=5, schedule=schedule)
    made: list[Emission] = []
    now = 0.0
    ends = []
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        ends.append(now)
        made += step.emissions
    made += engine.drain_codec()
    first_a, first_b = (next(e for e in made if e.seq_id == s) for s in (a, b))
    # Both first chunks (2 frames, no history) are made by step 2 and decoded one
    # call after the other: 10 ms + 2 x 1 ms each.
    assert first_a.at == pytest.approx(ends[1] + 0.012)
    assert first_b.at == pytest.approx(ends[1] + 0.024)
    # The second chunk re-decodes its left context: 3 frames + min(4, 2) = 5 frames.
    second_a = [e for e in made if e.seq_id == a][1]
    assert (second_a.start, second_a.end, second_a.final) == (2, 5, True)
    assert second_a.at >= ends[-1] + 0.015
    # Per stream the chunks stay in order.
    for seq in (a, b):
        times = [e.at for e in made if e.seq_id == seq]
        assert times == sorted(times)


def test_codec_batches_chunks_that_are_ready_together() -> None:
    codec = CodecSpec(batch=4, call_s=0.010, frame_s=0.0)
    engine = Engine(replace(SPEC, codec=codec))
    for _ in range(3):
        engine.submit(now=0.0, prompt_tokens=0, output_tokens=2, first_chunk_tokens=2,
                      chunk_tokens=2)  # fmt: skip
    step = engine.step(0.0)
    step = engine.step(step.ends_at)
    made = engine.drain_codec()
    assert len({e.at for e in made}) == 1  # one call for all three
    assert made[0].at == pytest.approx(step.ends_at + 0.010)


def test_emit_jitter_delays_chunks_per_stream_in_order() -> None:
    engine = Engine(replace(SPEC, emit_jitter_s=0.02), seed=3)
    seq = engine.submit(now=0.0, prompt_tokens=0, output_tokens=40, first_chunk_tokens=2,
                        chunk_tokens=2)  # fmt: skip
    delays, times = [], []
    now = 0.0
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        for e in step.emissions:
            if e.seq_id == seq:
                delays.append(e.at - step.ends_at)
                times.append(e.at)
    assert times == sorted(times) and len(set(times)) == len(times)
    assert max(delays) > 0.02 > min(delays) >= 0.0
