"""The codec stage sharing the talker's GPU, on the pure engine (virtual clock, no
jitter): padded and eager batched calls, the talker steps they lengthen, and the
request slots of the stage."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from proxy.sim.codec import CodecJob, CodecQueue, SharedCodecSpec, call_time, talker_delay
from proxy.sim.engine import Emission, Engine
from proxy.sim.spec import CodecSpec
from tests.sim.test_engine import SPEC


def test_a_padded_call_pays_every_chunk_at_the_longest() -> None:
    padded = SharedCodecSpec(batch=4, call_s=0.010, frame_s=0.001)
    assert call_time(padded, [2, 97, 97]) == pytest.approx(0.010 + 3 * 97 * 0.001)
    assert call_time(replace(padded, pad=False), [2, 97]) == pytest.approx(0.010 + 0.099)
    assert call_time(CodecSpec(batch=4, call_s=0.010, frame_s=0.001), [2, 97]) == (
        pytest.approx(0.109)
    )


def test_only_the_frame_work_takes_talker_time() -> None:
    shared = SharedCodecSpec(batch=1, call_s=0.010, frame_s=0.001, gpu_share=0.5)
    assert talker_delay(shared, 0.030) == pytest.approx(0.010)  # half of 20 ms of frames
    assert talker_delay(CodecSpec(batch=1, call_s=0.010, frame_s=0.001), 0.030) == 0.0
    with pytest.raises(ValueError, match="gpu_share"):
        SharedCodecSpec(gpu_share=1.5)


def _run(codec: CodecSpec) -> tuple[list[float], list[Emission]]:
    engine = Engine(replace(SPEC, codec=codec))
    for _ in range(2):
        engine.submit(now=0.0, prompt_tokens=0, output_tokens=6, first_chunk_tokens=2,
                      chunk_tokens=2)  # fmt: skip
    durations: list[float] = []
    made: list[Emission] = []
    now = 0.0
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        durations.append(step.duration)
        made += step.emissions
    return durations, made + engine.drain_codec()


def test_codec_calls_lengthen_the_talker_steps_beside_them() -> None:
    alone = SharedCodecSpec(batch=1, call_s=0.001, frame_s=0.002)
    own_card, _ = _run(alone)
    shared, made = _run(replace(alone, gpu_share=1.0))
    assert len(shared) == len(own_card)
    # No call runs before the second step's chunks; then each step pays for the call
    # that started by its start. Six 2-frame chunks, one per call; the last step's two
    # are decoded with the talker idle, so four calls' frame work lengthens the steps.
    assert shared[:2] == pytest.approx(own_card[:2])
    assert shared[2] == pytest.approx(own_card[2] + 2 * 0.002)
    assert sum(shared) == pytest.approx(sum(own_card) + 4 * 2 * 0.002)
    assert len(made) == 6


def test_an_idle_talker_is_not_charged_for_the_drained_calls() -> None:
    codec = SharedCodecSpec(batch=1, call_s=0.001, frame_s=0.002, gpu_share=1.0)
    engine = Engine(replace(SPEC, codec=codec))
    engine.submit(now=0.0, prompt_tokens=0, output_tokens=2, first_chunk_tokens=2,
                  chunk_tokens=2)  # fmt: skip
    now = 0.0
    while engine.has_work():
        now = engine.step(now).ends_at
    assert len(engine.drain_codec()) == 1
    engine.submit(now=now, prompt_tokens=0, output_tokens=1, first_chunk_tokens=1,
                  chunk_tokens=1)  # fmt: skip
    fresh = Engine(replace(SPEC, codec=codec))
    fresh.submit(now=0.0, prompt_tokens=0, output_tokens=1, first_chunk_tokens=1,
                 chunk_tokens=1)  # fmt: skip
    assert engine.step(now).duration == pytest.approx(fresh.step(0.0).duration)


def test_a_call_of_more_than_one_chunk_pays_the_eager_work() -> None:
    codec = SharedCodecSpec(batch=4, call_s=0.010, frame_s=0.001, gpu_share=0.5, eager_s=0.004)
    assert call_time(codec, [97]) == pytest.approx(0.010 + 0.097)  # a captured graph
    assert call_time(codec, [2, 97]) == pytest.approx(0.010 + 2 * 0.097 + 0.004)
    # The eager work is GPU work: the talker loses its share of it with the frames'.
    assert talker_delay(codec, call_time(codec, [2, 97])) == pytest.approx(0.5 * 0.198)
    with pytest.raises(ValueError, match="eager_s"):
        SharedCodecSpec(eager_s=-0.001)


def _decode(codec: CodecSpec, jobs: list[tuple[float, int, bool]]) -> list[tuple[str, float]]:
    """Queue (ready_at, seq_id, final) chunks of 10 frames; each decoded chunk's name
    ("<seq>.<index>") and the end of its call."""
    queue: CodecQueue[str] = CodecQueue(codec)
    counts: dict[int, int] = {}
    for ready_at, seq_id, final in jobs:
        counts[seq_id] = counts.get(seq_id, 0) + 1
        queue.add(CodecJob(ready_at, seq_id, final, 10, f"{seq_id}.{counts[seq_id]}"))
    return [(job.item, end) for taken, end in queue.calls(math.inf) for job in taken]


CHUNKS = [(0.0, 1, False), (0.0, 2, False), (0.5, 1, True), (0.5, 2, True)]


def test_a_chunk_queue_decodes_in_the_order_the_chunks_were_made() -> None:
    fifo = SharedCodecSpec(batch=1, call_s=0.1, frame_s=0.0)
    decoded = _decode(fifo, CHUNKS)
    assert [name for name, _ in decoded] == ["1.1", "2.1", "1.2", "2.2"]
    assert [end for _, end in decoded] == pytest.approx([0.1, 0.2, 0.6, 0.7])


def test_request_slots_make_a_new_request_wait_for_the_older_ones() -> None:
    slots = SharedCodecSpec(batch=1, call_s=0.1, frame_s=0.0, request_slots=True)
    # Request 2's first chunk waits while request 1 holds the only slot, even with the
    # codec idle until request 1's last chunk is ready.
    decoded = _decode(slots, CHUNKS)
    assert [name for name, _ in decoded] == ["1.1", "1.2", "2.1", "2.2"]
    assert [end for _, end in decoded] == pytest.approx([0.1, 0.6, 0.7, 0.8])
    two = replace(slots, batch=2)
    # Two slots: one chunk of each request a call, batched.
    assert [end for _, end in _decode(two, CHUNKS)] == pytest.approx([0.1, 0.1, 0.6, 0.6])


def test_a_cancelled_request_frees_its_slot() -> None:
    slots = SharedCodecSpec(batch=1, call_s=0.1, frame_s=0.0, request_slots=True)
    queue: CodecQueue[str] = CodecQueue(slots)
    queue.add(CodecJob(0.0, 1, False, 10, "1.1"))
    queue.add(CodecJob(0.0, 2, True, 10, "2.1"))
    assert [job.item for taken, _ in queue.calls(math.inf) for job in taken] == ["1.1"]
    assert len(queue) == 1  # request 2 waits for request 1's slot
    queue.cancel(1)
    assert [job.item for taken, _ in queue.calls(math.inf) for job in taken] == ["2.1"]
