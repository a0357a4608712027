"""vLLM ``WS /v1/realtime``: streaming ASR, and vLLM-Omni's audio-out variant.

As vLLM (``entrypoints/openai/realtime/connection.py``): the server sends
``session.created`` on accept; the client sends ``session.update {model}``,
``input_audio_buffer.append {audio: base64 PCM16 16 kHz mono}`` and
``input_audio_buffer.commit {final?}``. The first non-final commit starts generation;
``final: true`` ends the input and the generation finishes with
``transcription.done {text, usage}``. Errors: ``{"type": "error", "error": str,
"code": str}`` with codes ``invalid_json``, ``invalid_audio``, ``unknown_event``,
``model_not_validated``, ``model_not_found``, ``invalid_event``, ``processing_error``.
No idle timeout (like upstream, vllm#46815). Binary frames get ``invalid_event`` and
end the connection (vLLM accepts text frames only).

Engine model: the generation is a *gated* sequence, one token per ``1/token_rate`` s
of audio received, so transcription keeps pace with the client's audio (or falls
behind it past the knee). ``transcription.delta`` events go out per emitted segment.

On a TTS preset the endpoint behaves as an omni (speech-to-speech) model: the same
gated sequence produces codec tokens, sent as ``response.audio.delta {audio, format:
"pcm16", sample_rate_hz}`` with text deltas alongside, and ``response.audio.done
{has_audio}`` at the end, as vLLM-Omni's realtime connection does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
import uuid
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy.sim.audio import LEXICON, SpeechAudio, words_for_tokens
from proxy.sim.common import ChannelClosed, WsChannel
from proxy.sim.engine_runner import EngineStopped, SeqStream

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["INPUT_SAMPLE_RATE", "RealtimeSession", "realtime"]

log = logging.getLogger("proxy.sim")

#: PCM16 mono input rate of ``input_audio_buffer.append``.
INPUT_SAMPLE_RATE = 16000
MAX_APPEND_BYTES = 25 * 1024 * 1024


class RealtimeSession:
    """One ``/v1/realtime`` connection."""

    def __init__(self, gpu: SimGpu, ch: WsChannel, scope: Mapping[str, Any]) -> None:
        self.gpu = gpu
        self.ch = ch
        self.scope = scope
        self.faults = gpu.stream_faults()
        self.seed = gpu.next_session_seed()
        self.omni = gpu.preset.kind == "tts"
        self.validated = False
        self.samples = 0  #: input samples received for the next/current generation
        self.released = 0  #: tokens released to the engine
        self.input_closed = False
        self.stream: SeqStream | None = None
        self.task: asyncio.Task[None] | None = None
        rate = gpu.preset.token_rate_hz
        self.samples_per_token = INPUT_SAMPLE_RATE / rate
        self.voice = SpeechAudio(gpu.preset.sample_rate, f"omni-{self.seed}")

    async def error(self, message: str, code: str | None) -> None:
        await self.ch.send_json({"type": "error", "error": message, "code": code})

    async def run(self) -> None:
        await self.ch.send_json(
            {
                "type": "session.created",
                "id": f"sess-{uuid.uuid4().hex}",
                "created": int(time.time()),
            }
        )
        try:
            while True:
                raw = await self.ch.receive()
                if isinstance(raw, bytes):
                    await self.error(
                        "binary frames are not supported; send JSON text events", "invalid_event"
                    )
                    return
                try:
                    event = json.loads(raw)
                except json.JSONDecodeError:
                    await self.error("Invalid JSON", "invalid_json")
                    continue
                if not isinstance(event, dict):
                    await self.error("events must be JSON objects", "invalid_event")
                    continue
                await self.handle(event)
        finally:
            if self.task is not None:
                self.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ChannelClosed):
                    await self.task
            if self.stream is not None:
                self.stream.cancel()

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "session.update":
            model = event.get("model")
            if model is not None and model != self.gpu.preset.model:
                await self.error(f"The model `{model}` does not exist.", "model_not_found")
                return
            self.validated = True
        elif kind == "input_audio_buffer.append":
            audio = event.get("audio")
            if not isinstance(audio, str):
                await self.error("input_audio_buffer.append requires 'audio'", "invalid_event")
                return
            try:
                pcm = base64.b64decode(audio, validate=True)
            except (binascii.Error, ValueError):
                await self.error("Invalid audio data", "invalid_audio")
                return
            if not pcm or len(pcm) % 2 or len(pcm) > MAX_APPEND_BYTES:
                await self.error("Invalid audio data", "invalid_audio")
                return
            self.samples += len(pcm) // 2
            self._release()
        elif kind == "input_audio_buffer.commit":
            if not self.validated:
                await self.error(
                    "Model not validated. Make sure to validate the model by sending a "
                    "session.update event.",
                    "model_not_validated",
                )
                return
            final = event.get("final", False)
            if not isinstance(final, bool):
                await self.error("'final' must be a boolean", "invalid_event")
                return
            if final:
                self.input_closed = True
                if self.stream is not None:
                    self.stream.close_input()
            if self.task is None or self.task.done():
                self.task = asyncio.get_running_loop().create_task(self._generate())
                self.task.add_done_callback(_retrieve)
        else:
            await self.error(f"Unknown event type: {kind}", "unknown_event")

    def _release(self) -> None:
        if self.stream is None:
            return
        tokens = int(self.samples / self.samples_per_token) - self.released
        if tokens > 0:
            self.released += tokens
            self.stream.extend(tokens)

    def _pcm(self, start: int, end: int) -> bytes:
        per_token = self.voice.sample_rate / self.gpu.preset.token_rate_hz
        first, last = int(start * per_token), int(end * per_token)
        while self.voice.total_samples < last:  # babble on: extend the answer as needed
            h = zlib.crc32(f"{self.seed}:{self.voice.total_samples}".encode())
            words = [LEXICON[(h >> (3 * i)) % len(LEXICON)] for i in range(6 + h % 5)]
            self.voice.extend(" ".join(words) + ". ")
        return self.voice.render(first, last)

    async def _generate(self) -> None:
        gpu, ch = self.gpu, self.ch
        preset = gpu.preset
        await self.faults.slow_start()
        try:
            stream = gpu.open_stream(
                prompt_tokens=preset.prompt_overhead_tokens, output_tokens=None
            )
        except EngineStopped:
            await ch.close(1012, "simulated GPU shutting down")
            return
        self.stream = stream
        self._release()
        if self.input_closed:
            stream.close_input()
        text = ""
        tokens = 0
        sent_audio = False
        try:
            while True:
                em = await stream.next()
                tokens = em.end
                if em.end > em.start:
                    action = await self.faults.before_chunk()
                    if action == "drop":
                        await gpu.drop(self.scope)
                        return
                    if action == "error":
                        await self.error(
                            "simulated engine fault (headroom sim --fault-error-after)",
                            "processing_error",
                        )
                        break
                    delta = words_for_tokens(self.seed, em.start, em.end, preset.token_rate_hz)
                    if not text:
                        delta = delta.lstrip()
                    text += delta
                    if delta or not self.omni:
                        await ch.send_json({"type": "transcription.delta", "delta": delta})
                    if self.omni:
                        await ch.send_json(
                            {
                                "type": "response.audio.delta",
                                "audio": base64.b64encode(self._pcm(em.start, em.end)).decode(),
                                "format": "pcm16",
                                "sample_rate_hz": preset.sample_rate,
                            }
                        )
                        sent_audio = True
                if em.final:
                    prompt = preset.prompt_overhead_tokens
                    await ch.send_json(
                        {
                            "type": "transcription.done",
                            "text": text,
                            "usage": {
                                "prompt_tokens": prompt,
                                "completion_tokens": tokens,
                                "total_tokens": prompt + tokens,
                            },
                        }
                    )
                    break
            if self.omni:
                await ch.send_json({"type": "response.audio.done", "has_audio": sent_audio})
        except EngineStopped:
            await ch.close(1012, "simulated GPU shutting down")
        except ChannelClosed:
            pass  # the client is gone; the receive loop ends the session
        finally:
            stream.cancel()
            self.stream = None
            # As upstream, audio left over belongs to no one: the next commit starts fresh.
            self.samples = self.released = 0
            self.input_closed = False


def _retrieve(task: asyncio.Task[None]) -> None:
    """Done callback of a generation task: its outcome is always retrieved, so a
    failure is logged once instead of as "Task exception was never retrieved" (a
    task replaced by the next commit is never awaited)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ChannelClosed):
        log.error("realtime generation failed", exc_info=exc)


async def realtime(gpu: SimGpu, ch: WsChannel, scope: Mapping[str, Any]) -> None:
    """Serve one connection (already accepted)."""
    await RealtimeSession(gpu, ch, scope).run()
