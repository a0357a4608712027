"""Text-to-speech on a simulated GPU, shared by the HTTP and WebSocket speech APIs.

:func:`plan_speech` turns a request into the utterance's PCM timeline, its prefill
size and its codec-token count; :func:`speak` submits it to the engine and yields the
PCM of each chunk as the engine emits it, applying the connection's faults. The
protocol layer only frames the bytes.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.sim.audio import SpeechAudio
from proxy.sim.common import prompt_tokens_for_text
from proxy.sim.faults import StreamFaults

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["InjectedDrop", "InjectedError", "SpeechPlan", "plan_speech", "speak"]

#: Fallback length of a reference clip given by URL (seconds).
_REF_AUDIO_DEFAULT_S = 10.0
_REF_AUDIO_MAX_S = 30.0


class InjectedDrop(Exception):
    """The ``drop_after_chunks`` fault fired: abort the connection."""


class InjectedError(Exception):
    """The ``error_after_chunks`` fault fired: send the protocol's error event."""

    def __init__(self) -> None:
        super().__init__("simulated engine fault (headroom sim --fault-error-after)")


@dataclass(slots=True)
class SpeechPlan:
    """One utterance ready for the engine."""

    audio: SpeechAudio
    prompt_tokens: int
    output_tokens: int
    first_chunk_tokens: int  #: 0 = the preset's


def ref_audio_tokens(ref_audio: str | None, token_rate_hz: float) -> int:
    """Codec frames a voice-clone reference adds to the prefill. A base64 payload is
    measured as 24 kHz PCM16; a URL counts as 10 s. Capped at 30 s (vLLM-Omni)."""
    if not ref_audio:
        return 0
    payload = ref_audio.split(",", 1)[1] if ref_audio.startswith("data:") else ref_audio
    if payload.startswith(("http://", "https://", "file:")):
        seconds = _REF_AUDIO_DEFAULT_S
    else:
        seconds = min(_REF_AUDIO_MAX_S, len(payload) * 3 / 4 / 48000)
    return math.ceil(seconds * token_rate_hz)


def plan_speech(
    gpu: SimGpu,
    text: str,
    *,
    voice: str | None = None,
    sample_rate: int | None = None,
    speed: float = 1.0,
    max_new_tokens: int | None = None,
    initial_chunk: int | None = None,
    ref_audio: str | None = None,
    instructions: str | None = None,
) -> SpeechPlan:
    """The utterance for ``text``; ``ValueError`` for an unusable sample rate or speed."""
    preset = gpu.preset
    audio = SpeechAudio(sample_rate or preset.sample_rate, voice or "default", speed)
    audio.extend(text)
    output = audio.tokens(preset.token_rate_hz)
    if max_new_tokens is not None:
        output = max(1, min(output, max_new_tokens))
    prompt = prompt_tokens_for_text(text + (instructions or ""), preset.prompt_overhead_tokens)
    prompt += ref_audio_tokens(ref_audio, preset.token_rate_hz)
    return SpeechPlan(audio, prompt, output, initial_chunk or 0)


async def speak(
    gpu: SimGpu, plan: SpeechPlan, faults: StreamFaults, *, per_chunk: bool = True
) -> AsyncGenerator[tuple[bytes, int], None]:
    """Yield ``(pcm, tokens_so_far)`` per emitted chunk, in real time.

    The connection's slow start applies first; with ``per_chunk`` the chunk faults
    (drop, error, stall) apply before each chunk is yielded.

    Raises :class:`InjectedDrop` / :class:`InjectedError` when a fault fires,
    :class:`~proxy.sim.engine_runner.EngineStopped` if the GPU shuts down, ``ValueError`` if
    the prompt can never fit the KV cache. The engine sequence is cancelled when the
    generator is closed: consume it under ``contextlib.aclosing``.
    """
    await faults.slow_start()
    rate = gpu.preset.token_rate_hz
    stream = gpu.open_stream(
        prompt_tokens=plan.prompt_tokens,
        output_tokens=plan.output_tokens,
        first_chunk_tokens=plan.first_chunk_tokens,
    )
    try:
        while True:
            em = await stream.next()
            # The last chunk takes the audio's tail unless max_new_tokens cut it short.
            whole = em.final and plan.output_tokens >= plan.audio.tokens(rate)
            pcm = plan.audio.token_range(em.start, em.end, rate, final=whole)
            if pcm and per_chunk:
                action = await faults.before_chunk()
                if action == "drop":
                    raise InjectedDrop()
                if action == "error":
                    raise InjectedError()
            if pcm:
                yield pcm, em.end
            if em.final:
                return
    finally:
        stream.cancel()
