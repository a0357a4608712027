"""The pure engine core, stepped by hand on a virtual clock (no sockets, no sleeping)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from proxy.sim.engine import Engine, EngineSpec, jitter_sigma

# A toy GPU with round numbers: memory term 10 ms, 2 ms of compute per stream,
# 5 ms fixed overhead, no jitter (so step times are exact).
SPEC = EngineSpec(
    mem_bandwidth=1e12,
    peak_flops=1e12,
    weight_bytes_per_step=1e10,
    kv_bytes_per_token=1000,
    kv_budget_bytes=1e9,
    flops_per_token=2e9,
    step_overhead_s=0.005,
    jitter_p95=1.0,
)


def submit(engine: Engine, now: float = 0.0, *, out: int | None = 10, prompt: int = 0) -> int:
    return engine.submit(
        now=now, prompt_tokens=prompt, output_tokens=out, first_chunk_tokens=2, chunk_tokens=3
    )


def test_step_time_is_max_of_memory_and_compute_plus_overheads() -> None:
    engine = Engine(SPEC)
    for _ in range(3):
        submit(engine)
    step = engine.step(0.0)
    assert step.batch == 3
    assert step.duration == pytest.approx(max(0.010, 3 * 0.002) + 0.005)
    for _ in range(5):
        submit(engine)
    step = engine.step(step.ends_at)
    assert step.batch == 8
    # Compute-bound now: 8 x 2 ms > 10 ms, plus the KV of the three older sequences.
    assert step.duration == pytest.approx(max((1e10 + 3 * 1000) / 1e12, 0.016) + 0.005)


def test_mean_step_and_knee_follow_the_formula() -> None:
    spec = replace(SPEC, per_seq_overhead_s=0.001)
    assert spec.mean_step_s(1) == pytest.approx(0.010 + 0.005 + 0.001)
    assert spec.mean_step_s(10) == pytest.approx(0.020 + 0.005 + 0.010)
    assert spec.knee_batch() == 5  # 5 x 2 ms == 10 ms memory term


def test_chunks_are_first_then_regular_and_the_last_is_final() -> None:
    engine = Engine(SPEC)
    seq = submit(engine, out=10)
    now, spans = 0.0, []
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        spans += [(e.start, e.end, e.final) for e in step.emissions if e.seq_id == seq]
    assert spans == [(0, 2, False), (2, 5, False), (5, 8, False), (8, 10, True)]
    assert not engine.contains(seq)
    assert engine.stats().running == 0
    assert engine.stats().kv_tokens == 0


def test_without_async_chunk_a_request_is_one_chunk_when_it_ends() -> None:
    engine = Engine(replace(SPEC, async_chunk=False))
    seq = submit(engine, out=10)
    now, spans = 0.0, []
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        spans += [(e.start, e.end, e.final) for e in step.emissions if e.seq_id == seq]
    assert spans == [(0, 10, True)]


def test_async_chunk_hand_off_and_eager_launches_are_paid_on_every_step() -> None:
    spec = replace(SPEC, handoff_s=0.003, handoff_per_seq_s=0.001, eager_step_s=0.007)
    base = max(0.010, 2 * 0.002) + 0.005
    for async_chunk, cuda_graph, extra in (
        (True, True, 0.003 + 2 * 0.001),
        (False, True, 0.0),
        (False, False, 0.007),
        (True, False, 0.003 + 2 * 0.001 + 0.007),
    ):
        engine = Engine(replace(spec, async_chunk=async_chunk, cuda_graph=cuda_graph))
        submit(engine)
        submit(engine)
        assert engine.step(0.0).duration == pytest.approx(base + extra)
        mean = replace(spec, async_chunk=async_chunk, cuda_graph=cuda_graph).mean_step_s(2)
        assert mean == pytest.approx(base + extra)


def test_first_token_queue_time_and_finish_are_reported() -> None:
    engine = Engine(replace(SPEC, max_num_seqs=1))
    a = submit(engine, 0.0, out=2)
    b = submit(engine, 0.0, out=2)
    first = engine.step(0.0)
    assert first.admitted == (a,)
    assert first.first_tokens == ((a, pytest.approx(first.duration)),)
    now = first.ends_at
    second = engine.step(now)
    assert second.finished == ((a, pytest.approx(second.ends_at)),)
    third = engine.step(second.ends_at)
    assert third.admitted == (b,)
    assert third.queue_times == ((b, pytest.approx(second.ends_at)),)


def test_waiting_only_when_max_num_seqs_is_reached() -> None:
    engine = Engine(replace(SPEC, max_num_seqs=4))
    for _ in range(4):
        submit(engine, out=50)
    engine.step(0.0)
    assert (engine.stats().running, engine.stats().waiting) == (4, 0)
    for _ in range(3):
        submit(engine, out=50)
    step = engine.step(1.0)
    assert step.admitted == ()
    assert (engine.stats().running, engine.stats().waiting) == (4, 3)


def test_waiting_only_when_the_kv_budget_is_full() -> None:
    # Room for 100 tokens of KV: two prompts of 40 fit, the third waits.
    engine = Engine(replace(SPEC, kv_budget_bytes=100 * 1000))
    ids = [submit(engine, out=5, prompt=40) for _ in range(3)]
    step = engine.step(0.0)
    assert step.admitted == tuple(ids[:2])
    assert engine.stats().waiting == 1
    assert engine.stats().kv_usage == pytest.approx(0.82)
    now = step.ends_at
    while ids[2] not in engine.step(now).admitted:
        now += 1.0
    assert engine.stats().waiting == 0


def test_growth_past_the_kv_budget_preempts_the_newest_sequence() -> None:
    engine = Engine(replace(SPEC, kv_budget_bytes=30 * 1000))
    old = submit(engine, out=40, prompt=5)
    new = submit(engine, out=40, prompt=5)
    now, preempted = 0.0, ()
    for _ in range(15):
        step = engine.step(now)
        now = step.ends_at
        preempted += step.preempted
    assert preempted
    assert preempted[0] == new
    assert old not in preempted
    assert engine.stats().preemptions >= 1
    assert engine.stats().kv_tokens * 1000 <= 30 * 1000


def test_a_prompt_that_can_never_fit_is_refused_at_submit() -> None:
    engine = Engine(replace(SPEC, kv_budget_bytes=10 * 1000))
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        submit(engine, prompt=100)


def test_gated_sequence_generates_only_what_its_input_allows() -> None:
    engine = Engine(SPEC)
    seq = submit(engine, out=None)
    engine.step(0.0)  # admitted, but no input yet: idle, holds its slot
    assert engine.stats().running == 1
    assert not engine.has_work()
    engine.extend_input(seq, 4)
    made: list[tuple[int, int, bool]] = []
    now = 1.0
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        made += [(e.start, e.end, e.final) for e in step.emissions]
    assert made == [(0, 2, False)]  # token 4 waits for the next chunk boundary (5)
    engine.extend_input(seq, 2)
    engine.close_input(seq)
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        made += [(e.start, e.end, e.final) for e in step.emissions]
    assert made == [(0, 2, False), (2, 5, False), (5, 6, True)]
    assert engine.stats().running == 0


def test_closing_a_caught_up_gated_sequence_emits_an_empty_final_chunk() -> None:
    engine = Engine(SPEC)
    seq = submit(engine, out=None)
    engine.extend_input(seq, 2)
    now = 0.0
    for _ in range(2):
        now = engine.step(now).ends_at
    engine.close_input(seq)
    step = engine.step(now)
    assert [(e.start, e.end, e.final) for e in step.emissions] == [(2, 2, True)]


def test_cancel_frees_the_slot_and_kv_for_running_and_waiting() -> None:
    engine = Engine(replace(SPEC, max_num_seqs=1))
    a = submit(engine, prompt=10)
    b = submit(engine, prompt=10)
    engine.step(0.0)
    engine.cancel(b)  # waiting
    engine.cancel(a)  # running
    engine.cancel(a)  # idempotent
    assert engine.stats() == replace(engine.stats(), running=0, waiting=0, kv_tokens=0)
    assert not engine.has_work()


def test_jitter_is_seeded_and_has_the_configured_tail() -> None:
    spec = replace(SPEC, jitter_p95=1.3, jitter_tau_s=0.05)

    def durations(seed: int) -> list[float]:
        engine = Engine(spec, seed=seed)
        submit(engine, out=4000)
        now, out = 0.0, []
        while engine.has_work():
            step = engine.step(now)
            now = step.ends_at
            out.append(step.duration)
        return out[1:]

    a, b = durations(1), durations(1)
    assert a == b
    assert a != durations(2)
    mean = sum(a) / len(a)
    p95 = sorted(a)[int(0.95 * len(a))]
    assert mean == pytest.approx(0.015, rel=0.05)
    assert p95 / mean == pytest.approx(1.3, abs=0.06)


def test_jitter_sigma_solves_the_p95() -> None:
    import math

    s = jitter_sigma(1.3)
    assert math.exp(1.6448536 * s - s * s / 2) == pytest.approx(1.3)
    assert jitter_sigma(1.0) == 0.0


@pytest.mark.parametrize(
    "field", ["mem_bandwidth", "peak_flops", "kv_budget_bytes", "flops_per_token"]
)
def test_spec_rejects_nonpositive_figures(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        replace(SPEC, **{field: 0})


def test_chunked_prefill_takes_a_prompt_in_pieces_beside_the_decoding_streams() -> None:
    # Budget 4 tokens a step: the decoding stream's token first, then 3 prompt tokens,
    # each costing what a decoding stream's token costs (2 ms past the 10 ms floor).
    spec = replace(SPEC, chunked_prefill=True, max_num_batched_tokens=4)
    engine = Engine(spec)
    old = submit(engine, out=50)
    step = engine.step(0.0)  # the old stream's 0-token prompt: it decodes at once
    assert step.batch == 1
    new = submit(engine, now=step.ends_at, prompt=7)
    now, firsts, batches, durations = step.ends_at, [], [], []
    for _ in range(4):
        step = engine.step(now)
        now = step.ends_at
        batches.append(step.batch)
        durations.append(step.duration)
        firsts += [seq for seq, _ in step.first_tokens]
    # 7 prompt tokens at 3 a step: the new stream's first token comes with the third step.
    assert firsts == [new]
    assert batches == [1, 1, 2, 2]
    assert durations[0] == pytest.approx(max(0.010, 4 * 0.002) + 0.005)
    # The third step carries the old token and the prompt's last one, which yields the
    # new stream's first token: 2 tokens, not 3.
    assert durations[2] == pytest.approx(max(0.010, 2 * 0.002) + 0.005)
    assert engine.contains(old)


def test_chunked_prefill_waits_while_decoding_streams_fill_the_budget() -> None:
    spec = replace(SPEC, chunked_prefill=True, max_num_batched_tokens=2)
    engine = Engine(spec)
    first, second = submit(engine, out=3), submit(engine, out=3)
    step = engine.step(0.0)
    late = submit(engine, now=step.ends_at, out=1, prompt=1)
    now, events = step.ends_at, []
    while engine.has_work():
        step = engine.step(now)
        now = step.ends_at
        events.append(({seq for seq, _ in step.finished}, [s for s, _ in step.first_tokens]))
    # No prompt token fits beside two decoding streams: the late prompt starts in the
    # step after both finished (their third token) and yields its only token there.
    assert events == [(set(), []), ({first, second}, []), ({late}, [late])]
