"""The pure continuous-batching engine model of one simulated GPU.

No asyncio, no clock reads: the caller owns time. It calls :meth:`Engine.step`
with the time the step starts; the engine admits waiting sequences, advances every
ready running sequence by one token, and returns a :class:`Step` saying how long
the step takes and which chunks it emits. The emissions become visible at
``step.started_at + step.duration``; the next step may start then. Tests drive it on
a virtual clock; :mod:`proxy.sim.engine_runner` drives it in real time, one loop per GPU.

Step time (docs/sim.md §1)::

    memory  = (weight bytes read per step + KV bytes of the ready sequences) / bandwidth
    compute = batch ** batch_exponent x (1 - vocoder_share) x F_eff / peak FLOPs
    step    = (max(memory, compute) + c0 + c_seq x batch
               + async chunk's hand-off (h0 + h_seq x batch), or eager launches
               + prefill of newly admitted prompts (chunked: the prompt pieces a
                 step carries count as tokens of its batch in the compute term)
               + vocoder_share x F_eff x chunk tokens / peak, per chunk emitted)
              x jitter
              + a codec on the talker's GPU: its share of the GPU work of the codec
                calls started since the last step (proxy.sim.codec)

Chunks follow each sequence's :class:`~proxy.sim.chunks.ChunkSchedule` (the initial
sizes are fixed at admission, from the load when the schedule is load-dependent); without
async chunk (``spec.async_chunk`` false) a sequence's output is one chunk, emitted when
it finishes. With
a codec stage (``spec.codec``) a chunk the step completes goes to the codec's queue
(:class:`~proxy.sim.codec.CodecQueue`) instead of out: the codec decodes up to
``batch`` queued chunks per call (each chunk's frames plus its left context) on its
own timeline, overlapping later steps, and the chunk becomes visible when its call
ends (:attr:`Emission.at`); a codec sharing the talker's GPU pads its batched calls,
may hold request slots, and lengthens the talker's next step
(:class:`~proxy.sim.codec.SharedCodecSpec`). Every chunk
may also wait a per-chunk random delay (``emit_jitter_s``), never overtaking the
stream's previous chunk.

``jitter`` is a seeded log-normal factor with mean 1 whose 95th percentile is
``jitter_p95`` (1.3 in the published-curve fits). It is an AR(1) process in time
(correlation time ``jitter_tau_s``), so slow phases last long enough to slow whole
chunks, as they do on real cards.

Sequences wait inside the engine (``vllm:num_requests_waiting``) while the running
batch is at ``max_num_seqs`` or the KV budget cannot hold their prompt; when the
running batch outgrows the KV budget the most recently admitted sequence is
preempted (recompute) and waits at the head of the queue, as vLLM does.

A sequence is *gated* when its output may not run ahead of its input (streaming
ASR and speech-to-speech: one token per ``1/token_rate`` seconds of audio received);
a gated sequence with no input left is running but idle: it holds KV, costs no
compute, and makes no tokens.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace

from proxy.sim.chunks import ChunkSchedule
from proxy.sim.codec import CodecJob, CodecQueue
from proxy.sim.spec import EngineSpec, jitter_sigma

__all__ = [
    "Emission",
    "Engine",
    "EngineSpec",
    "EngineStats",
    "Step",
    "jitter_sigma",
]


@dataclass(frozen=True, slots=True)
class Emission:
    """Tokens ``[start, end)`` of sequence ``seq_id`` became available (one chunk) at
    ``at``: the end of the step that made them, or, with a codec stage, the end of the
    codec call that decoded them (possibly after later steps)."""

    seq_id: int
    start: int
    end: int
    final: bool
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Step:
    """One engine iteration. Its emissions are visible at ``started_at + duration``."""

    started_at: float
    duration: float
    batch: int  #: sequences advanced this step
    emissions: tuple[Emission, ...]
    running: int = 0  #: sequences in the batch after admission (idle gated ones included)
    waiting: int = 0  #: sequences still waiting after admission
    admitted: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    #: (seq_id, seconds from submit to its first token) for first tokens made this step
    first_tokens: tuple[tuple[int, float], ...] = ()
    #: (seq_id, seconds spent waiting before admission)
    queue_times: tuple[tuple[int, float], ...] = ()
    #: (seq_id, seconds from submit to its last token) for sequences finished this step
    finished: tuple[tuple[int, float], ...] = ()

    @property
    def ends_at(self) -> float:
        return self.started_at + self.duration


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics and tests."""

    running: int
    waiting: int
    kv_tokens: int
    kv_usage: float  #: fraction of the KV budget in use, 0..1
    steps: int
    tokens_generated: int
    prompt_tokens: int
    preemptions: int
    last_batch: int
    last_step_s: float


@dataclass(slots=True)
class _Seq:
    seq_id: int
    prompt_tokens: int
    schedule: ChunkSchedule
    gated: bool
    submitted_at: float
    limit: int  #: tokens it may generate so far (input received, or the target)
    closed: bool  #: limit is final; the sequence finishes when it reaches it
    generated: int = 0
    next_emit: int = 0
    emitted: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    recompute: bool = False
    context: int = 0  #: KV tokens held while running
    plan: tuple[int, ...] | None = None  #: initial chunk sizes, fixed at first admission
    chunks: int = 0  #: chunks emitted so far
    prefill_left: int = 0  #: prompt tokens still to take (chunked prefill only)

    def chunk_size(self, index: int) -> int:
        plan = self.plan if self.plan is not None else self.schedule.initial
        return plan[index] if index < len(plan) else self.schedule.steady

    def first_size(self) -> int:
        if self.plan is not None:
            return self.chunk_size(0)
        s = self.schedule
        return max(s.load_first, default=0) or (s.initial[0] if s.initial else s.steady)


@dataclass(slots=True)
class _Counters:
    steps: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    last_batch: int = 0
    last_step_s: float = 0.0


class Engine:
    """A continuous-batching engine on one GPU. Not thread-safe; call from one loop.

    Contract: ``step(now)`` must be called with non-decreasing times, and the next call
    should not start before the previous ``step.ends_at``.
    """

    def __init__(self, spec: EngineSpec, *, seed: int = 0) -> None:
        self.spec = spec
        self._rng = random.Random(seed)
        self._sigma = jitter_sigma(spec.jitter_p95)
        self._jitter_state = 0.0
        self._next_id = 1
        self._seqs: dict[int, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._kv_tokens = 0
        self._count = _Counters()
        #: Chunks waiting for the codec, each with its own delay after decoding.
        self._codec: CodecQueue[tuple[Emission, float]] | None = None
        if spec.codec is not None:
            self._codec = CodecQueue(spec.codec)
        self._emit_rng = random.Random(seed * 31 + 7)
        self._visible_at: dict[int, float] = {}  #: seq_id -> its latest chunk's ``at``

    # -- submissions ------------------------------------------------------------------

    def submit(
        self,
        *,
        now: float,
        prompt_tokens: int,
        output_tokens: int | None = None,
        first_chunk_tokens: int = 0,
        chunk_tokens: int = 0,
        schedule: ChunkSchedule | None = None,
    ) -> int:
        """Queue a sequence; return its id.

        ``output_tokens`` set: a free-running generation of that many tokens (TTS, file
        ASR). ``None``: a gated stream whose tokens are released by :meth:`extend_input`
        and which finishes after :meth:`close_input`. Chunks follow ``schedule``, or are
        ``first_chunk_tokens`` then ``chunk_tokens`` long (the last one may be shorter).
        """
        if schedule is None:
            if first_chunk_tokens < 1 or chunk_tokens < 1:
                raise ValueError("prompt_tokens >= 0 and chunk sizes >= 1 required")
            schedule = ChunkSchedule.simple(first_chunk_tokens, chunk_tokens)
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens >= 0 and chunk sizes >= 1 required")
        if output_tokens is not None and output_tokens < 0:
            raise ValueError("output_tokens must be >= 0")
        seq = _Seq(
            seq_id=self._next_id,
            prompt_tokens=prompt_tokens,
            schedule=schedule,
            gated=output_tokens is None,
            submitted_at=now,
            limit=output_tokens or 0,
            closed=output_tokens is not None,
        )
        need = (prompt_tokens + seq.first_size()) * self.spec.kv_bytes_per_token
        if need > self.spec.kv_budget_bytes:
            raise ValueError(
                f"prompt of {prompt_tokens} tokens does not fit the KV cache "
                f"({self.spec.kv_budget_bytes / 2**30:.1f} GiB)"
            )
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self._waiting.append(seq)
        return seq.seq_id

    def extend_input(self, seq_id: int, tokens: int) -> None:
        """A gated sequence may generate ``tokens`` more (its input grew)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.closed or tokens <= 0:
            return
        seq.limit += tokens

    def close_input(self, seq_id: int) -> None:
        """No more input: the gated sequence finishes once it reaches its limit."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.closed = True

    def cancel(self, seq_id: int) -> None:
        """Abort a sequence (client went away); frees its slot and KV, and drops its
        chunks still waiting for the codec. Idempotent."""
        self._visible_at.pop(seq_id, None)
        if self._codec is not None:
            self._codec.cancel(seq_id)
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if seq.admitted_at is not None and seq in self._running:
            self._running.remove(seq)
            self._kv_tokens -= seq.context
        else:
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass

    # -- queries ----------------------------------------------------------------------

    def has_work(self) -> bool:
        """True when a step now would admit or advance something."""
        if self._waiting and self._can_admit(self._waiting[0]):
            return True
        return any(self._ready(s) for s in self._running)

    def drain_codec(self) -> list[Emission]:
        """Decode every queued chunk now (the LM is idle, so no chunk can join them):
        the emissions, each with its ``at``. The runner calls this when
        :meth:`has_work` is false."""
        emissions = self._run_codec(math.inf)
        if self._codec is not None:
            self._codec.talker_owed = 0.0  # no talker step ran beside these calls
        return emissions

    def contains(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def stats(self) -> EngineStats:
        c = self._count
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=self._kv_tokens,
            kv_usage=min(
                1.0, self._kv_tokens * self.spec.kv_bytes_per_token / self.spec.kv_budget_bytes
            ),
            steps=c.steps,
            tokens_generated=c.tokens,
            prompt_tokens=c.prompt_tokens,
            preemptions=c.preemptions,
            last_batch=c.last_batch,
            last_step_s=c.last_step_s,
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Engine running={s.running} waiting={s.waiting} kv={s.kv_usage:.1%} steps={s.steps}>"
        )

    # -- the step -----------------------------------------------------------------------

    def step(self, now: float) -> Step:
        """Run one iteration starting at ``now``; see the module docstring."""
        spec = self.spec
        decoded = self._run_codec(now)
        admitted, queue_times, prefill_s = self._admit(now)
        preempted = self._preempt_for_growth()
        running, waiting = len(self._running), len(self._waiting)
        prompt_tokens, prompts_done = self._take_prompts()
        kv_per_step = 0
        batch = 0
        vocoder_tokens = 0
        made: list[tuple[_Seq, int, int, bool]] = []
        first_tokens: list[tuple[int, float]] = []
        finished_seqs: list[_Seq] = []
        for seq in self._running:
            if seq.prefill_left > 0:
                continue
            if seq.generated >= seq.limit:
                if seq.closed:  # input ended after it caught up: close the stream
                    made.append((seq, seq.emitted, seq.generated, True))
                    vocoder_tokens += seq.generated - seq.emitted
                    seq.emitted = seq.generated
                    finished_seqs.append(seq)
                continue
            batch += 1
            kv_per_step += seq.context
            seq.generated += 1
            seq.context += 1
            if seq.first_token_at is None:
                seq.first_token_at = now  # corrected to the step end below
                first_tokens.append((seq.seq_id, 0.0))
            done = seq.closed and seq.generated >= seq.limit
            if done or (spec.async_chunk and seq.generated >= seq.next_emit):
                made.append((seq, seq.emitted, seq.generated, done))
                vocoder_tokens += seq.generated - seq.emitted
                seq.emitted = seq.generated
                seq.chunks += 1
                seq.next_emit = seq.generated + seq.chunk_size(seq.chunks)
            if done:
                finished_seqs.append(seq)
        self._kv_tokens += batch
        # A prompt's last token yields its first output token: one token, not two.
        tokens = batch + prompt_tokens - prompts_done
        duration = spec.step_s(batch, tokens, kv_per_step, vocoder_tokens, prefill_s)
        duration *= self._jitter(duration)
        if self._codec is not None:
            duration += self._codec.talker_owed
            self._codec.talker_owed = 0.0
        end = now + duration
        emissions = list(decoded)
        for seq, start, stop, final in made:
            em = Emission(seq.seq_id, start, stop, final)
            delay = self._emit_delay()
            if self._codec is None:
                emissions.append(self._visible(em, end + delay))
            else:
                frames = stop - start + min(seq.schedule.left_context, start)
                self._codec.add(CodecJob(end, seq.seq_id, final, frames, (em, delay)))
        firsts = []
        for seq_id, _ in first_tokens:
            seq = self._seqs[seq_id]
            seq.first_token_at = end
            firsts.append((seq_id, end - seq.submitted_at))
        finished = []
        for seq in finished_seqs:
            self._running.remove(seq)
            self._kv_tokens -= seq.context
            del self._seqs[seq.seq_id]
            finished.append((seq.seq_id, end - seq.submitted_at))
        c = self._count
        c.steps += 1
        c.tokens += batch
        c.last_batch = batch
        c.last_step_s = duration
        return Step(
            started_at=now,
            duration=duration,
            batch=batch,
            emissions=tuple(emissions),
            running=running,
            waiting=waiting,
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            first_tokens=tuple(firsts),
            queue_times=tuple(queue_times),
            finished=tuple(finished),
        )

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _ready(seq: _Seq) -> bool:
        return (
            seq.prefill_left > 0
            or seq.generated < seq.limit
            or (seq.closed and seq.generated >= seq.limit)
        )

    def _take_prompts(self) -> tuple[int, int]:
        """Chunked prefill: the prompt tokens this step carries (every decoding
        sequence's token first, then prompts in admission order up to
        ``max_num_batched_tokens`` in all) and how many prompts it finishes."""
        if not self.spec.chunked_prefill:
            return 0, 0
        decoding = sum(1 for s in self._running if s.prefill_left == 0 and s.generated < s.limit)
        budget = max(0, self.spec.max_num_batched_tokens - decoding)
        taken = done = 0
        for seq in self._running:
            if seq.prefill_left == 0 or budget == 0:
                continue
            take = min(seq.prefill_left, budget)
            seq.prefill_left -= take
            budget -= take
            taken += take
            done += seq.prefill_left == 0
        return taken, done

    def _prompt_cost(self, seq: _Seq) -> int:
        # A preempted sequence recomputes its prompt and everything it generated.
        return seq.prompt_tokens + (seq.generated if seq.recompute else 0)

    def _can_admit(self, seq: _Seq) -> bool:
        if len(self._running) >= self.spec.max_num_seqs:
            return False
        need = self._prompt_cost(seq) + seq.first_size()
        return (self._kv_tokens + need) * self.spec.kv_bytes_per_token <= self.spec.kv_budget_bytes

    def _admit(self, now: float) -> tuple[list[int], list[tuple[int, float]], float]:
        spec = self.spec
        admitted: list[int] = []
        queue_times: list[tuple[int, float]] = []
        prefill_tokens = 0
        while self._waiting and self._can_admit(self._waiting[0]):
            seq = self._waiting[0]
            cost = self._prompt_cost(seq)
            if (
                not spec.chunked_prefill
                and admitted
                and prefill_tokens + cost > spec.max_num_batched_tokens
            ):
                break
            self._waiting.popleft()
            if seq.admitted_at is None:
                queue_times.append((seq.seq_id, now - seq.submitted_at))
                self._count.prompt_tokens += seq.prompt_tokens
            seq.admitted_at = now
            if seq.plan is None:
                running = len(self._running) + 1
                seq.plan = seq.schedule.plan(running, spec.max_num_seqs)
                seq.next_emit = seq.chunk_size(0)
            seq.context = cost
            seq.prefill_left = cost if spec.chunked_prefill else 0
            seq.recompute = False
            self._kv_tokens += cost
            self._running.append(seq)
            admitted.append(seq.seq_id)
            prefill_tokens += cost
        prefill_s = 0.0
        if admitted:
            # Chunked, the prompt tokens are paid in the steps that carry them.
            whole = 0 if spec.chunked_prefill else prefill_tokens
            prefill_s = (
                whole * spec.prefill_flops_per_token / spec.peak_flops
                + len(admitted) * spec.prefill_overhead_s
            )
        return admitted, queue_times, prefill_s

    def _preempt_for_growth(self) -> list[int]:
        spec = self.spec
        preempted: list[int] = []
        growth = sum(1 for s in self._running if s.generated < s.limit)
        while (
            len(self._running) > 1
            and (self._kv_tokens + growth) * spec.kv_bytes_per_token > spec.kv_budget_bytes
        ):
            victim = self._running.pop()  # the most recently admitted
            if victim.generated < victim.limit:
                growth -= 1
            self._kv_tokens -= victim.context
            victim.context = 0
            victim.recompute = True
            self._waiting.appendleft(victim)
            self._count.preemptions += 1
            preempted.append(victim.seq_id)
        return preempted

    def _emit_delay(self) -> float:
        """A chunk's own extra delay (``emit_jitter_s`` mean, exponential)."""
        mean = self.spec.emit_jitter_s
        return self._emit_rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def _visible(self, em: Emission, at: float) -> Emission:
        """``em`` visible at ``at``, but never before the stream's previous chunk."""
        previous = self._visible_at.get(em.seq_id)
        if previous is not None:
            at = max(at, previous + 1e-6)  # strictly after: timers keep the order
        if em.final:
            self._visible_at.pop(em.seq_id, None)
        else:
            self._visible_at[em.seq_id] = at
        return replace(em, at=at)

    def _run_codec(self, until: float) -> list[Emission]:
        """Run the codec calls that start by ``until`` (:class:`CodecQueue`); a codec
        sharing the talker's GPU owes the next talker step what its calls took."""
        if self._codec is None:
            return []
        return [
            self._visible(em, end + delay)
            for jobs, end in self._codec.calls(until)
            for em, delay in (job.item for job in jobs)
        ]

    def _jitter(self, duration: float) -> float:
        if self._sigma == 0.0:
            return 1.0
        rho = math.exp(-max(duration, 1e-4) / self.spec.jitter_tau_s)
        x = rho * self._jitter_state + math.sqrt(1.0 - rho * rho) * self._rng.gauss(0.0, 1.0)
        self._jitter_state = x
        return math.exp(self._sigma * x - 0.5 * self._sigma * self._sigma)
