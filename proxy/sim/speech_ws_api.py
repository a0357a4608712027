"""vLLM-Omni ``WS /v1/audio/speech/stream``: streaming text in, audio out.

Client: ``session.config`` (first, within ``speech_config_s``), ``input.text``,
``input.done`` (flush; the connection stays open), ``session.close``. Server, per
sentence: ``audio.start`` -> binary PCM frames -> ``audio.done``; per flush
``session.done``; problems as ``{"type": "error", "message": ...}``.

As upstream: generation runs inside the receive loop (no messages are read while a
sentence is generated); ``stream_audio=false`` (the default) sends each sentence as one
binary frame (a complete WAV file for ``wav``), ``stream_audio=true`` needs pcm and
speed 1.0 and sends chunks as the engine emits them, with ``sample_rate`` and
``channels`` on ``audio.start``. Fatal problems (no config in time, idle timeout,
malformed first message) send an error and end the handler without a close frame,
which is what vLLM-Omni's handler does; ``session.close`` closes with 1000.
Limits: 4 MiB for ``session.config``, 128 KiB for other messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from proxy.sim.audio import wav_header
from proxy.sim.common import ChannelClosed, WsChannel
from proxy.sim.engine_runner import EngineStopped
from proxy.sim.faults import StreamFaults
from proxy.sim.tts import InjectedDrop, InjectedError, plan_speech, speak

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["MAX_CONFIG_BYTES", "MAX_TEXT_BYTES", "TextSplitter", "speech_stream"]

MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_TEXT_BYTES = 128 * 1024
_FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
_BOUNDARY = {
    "sentence": re.compile(r"[.!?\u3002\uff01\uff1f]+[\"')\]]*\s*"),
    "clause": re.compile(r"[.!?;:,\u3002\uff01\uff1f\uff0c\uff1b]+[\"')\]]*\s*"),
}


class TextSplitter:
    """Cuts incoming text into synthesis units: everything at flush (``none``), or at
    each sentence (``sentence``) or clause (``clause``) boundary as text arrives."""

    def __init__(self, granularity: str) -> None:
        self._boundary = _BOUNDARY.get(granularity)
        self._buffer = ""

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        if self._boundary is None:
            return []
        units = []
        while match := self._boundary.search(self._buffer):
            unit, self._buffer = self._buffer[: match.end()].strip(), self._buffer[match.end() :]
            if unit:
                units.append(unit)
        return units

    def flush(self) -> list[str]:
        unit, self._buffer = self._buffer.strip(), ""
        return [unit] if unit else []


def _config(msg: dict[str, Any], served_model: str) -> dict[str, Any]:
    """Validate ``session.config``; ``ValueError`` carries the upstream wording."""
    model = msg.get("model")
    if model is not None and model != served_model:
        raise LookupError(f"The model `{model}` does not exist.")
    fmt = msg.get("response_format", "wav")
    if fmt not in _FORMATS:
        raise ValueError(f"Invalid session config: response_format must be one of {_FORMATS}")
    if fmt not in ("wav", "pcm"):
        raise ValueError(f"Invalid session config: headroom sim renders wav or pcm, not {fmt}")
    stream_audio = msg.get("stream_audio", False)
    speed = msg.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if not isinstance(stream_audio, bool) or isinstance(speed, bool):
        raise ValueError("Invalid session config: stream_audio must be a boolean")
    if not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
        raise ValueError("Invalid session config: speed must be within 0.25..4.0")
    if stream_audio and fmt != "pcm":
        raise ValueError(
            "Invalid session config: WebSocket streaming audio (stream_audio=true) requires "
            f"response_format='pcm'. Got response_format='{fmt}'."
        )
    if stream_audio and speed != 1.0:
        raise ValueError("Invalid session config: WebSocket stream_audio=true requires speed=1.0")
    granularity = msg.get("split_granularity", "none")
    if granularity not in ("none", "sentence", "clause"):
        raise ValueError("Invalid session config: split_granularity must be none|sentence|clause")
    voice = msg.get("voice", msg.get("speaker"))
    initial = msg.get("initial_codec_chunk_frames")
    max_new = msg.get("max_new_tokens")
    for name, value in (("initial_codec_chunk_frames", initial), ("max_new_tokens", max_new)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"Invalid session config: {name} must be an integer")
    return {
        "format": fmt,
        "stream_audio": stream_audio,
        "speed": float(speed),
        "split": granularity,
        "voice": voice if isinstance(voice, str) else None,
        "initial": initial or None,
        "max_new_tokens": max_new if max_new and max_new > 0 else None,
        "ref_audio": msg.get("ref_audio") if isinstance(msg.get("ref_audio"), str) else None,
        "instructions": msg.get("instructions")
        if isinstance(msg.get("instructions"), str)
        else None,
    }


async def _error(ch: WsChannel, message: str, **extra: Any) -> None:
    await ch.send_json({"type": "error", "message": message, **extra})


def _parse(raw: str | bytes) -> dict[str, Any] | str:
    """The message as a dict, or the error text to send."""
    if isinstance(raw, bytes):
        return "Binary frames are not supported; send JSON text messages"
    if len(raw) > MAX_CONFIG_BYTES:
        return "WebSocket message too large"
    try:
        msg = json.loads(raw)
    except json.JSONDecodeError:
        return "Invalid JSON message"
    if not isinstance(msg, dict):
        return "WebSocket messages must be JSON objects"
    if msg.get("type") != "session.config" and len(raw) > MAX_TEXT_BYTES:
        return "input.text message too large"
    return msg


async def speech_stream(gpu: SimGpu, ch: WsChannel, scope: Mapping[str, Any]) -> None:
    """Serve one connection (already accepted)."""
    if gpu.preset.kind != "tts":
        await _error(
            ch,
            f"This simulated GPU serves the speech-recognition model {gpu.preset.model}; "
            "/v1/audio/speech/stream needs a TTS preset.",
        )
        return
    faults = gpu.stream_faults()
    config: dict[str, Any] | None = None
    splitter = TextSplitter("none")
    utterance = sentence = 0
    utterance_open = False
    timeouts = gpu.timeouts
    while True:
        try:
            raw = await ch.receive(
                timeouts.speech_config_s if config is None else timeouts.speech_idle_s
            )
        except TimeoutError:
            if config is None:
                await _error(ch, "Timeout waiting for session.config")
            else:
                await _error(ch, "Idle timeout: no message received")
            return
        msg = _parse(raw)
        if isinstance(msg, str):
            await _error(ch, msg)
            if config is None:
                return
            continue
        kind = msg.get("type")
        if kind == "session.config":
            if utterance_open:
                await _error(
                    ch,
                    "session.config cannot be applied while an utterance is in progress; "
                    "send input.done first",
                )
                continue
            try:
                config = _config(msg, gpu.preset.model)
            except (ValueError, LookupError) as exc:
                await _error(ch, str(exc))
                if config is None:
                    return
                continue
            splitter = TextSplitter(config["split"])
        elif config is None:
            await _error(ch, f"Expected session.config, got: {kind}")
            return
        elif kind == "input.text":
            text = msg.get("text", "")
            if not isinstance(text, str):
                await _error(ch, "input.text requires a string value")
                continue
            utterance_open = utterance_open or bool(text)
            for unit in splitter.feed(text):
                await _sentence(gpu, ch, scope, faults, config, unit, utterance, sentence)
                sentence += 1
        elif kind == "input.done":
            for unit in splitter.flush():
                await _sentence(gpu, ch, scope, faults, config, unit, utterance, sentence)
                sentence += 1
            await ch.send_json(
                {"type": "session.done", "utterance_index": utterance, "total_sentences": sentence}
            )
            utterance, sentence, utterance_open = utterance + 1, 0, False
        elif kind == "session.close":
            await ch.close(1000)
            return
        else:
            await _error(ch, f"Unknown message type: {kind}")


async def _sentence(
    gpu: SimGpu,
    ch: WsChannel,
    scope: Mapping[str, Any],
    faults: StreamFaults,
    config: dict[str, Any],
    text: str,
    utterance: int,
    sentence: int,
) -> None:
    """Generate one sentence and send it (audio.start, audio, audio.done)."""
    fmt = config["format"]
    start: dict[str, Any] = {
        "type": "audio.start",
        "utterance_index": utterance,
        "sentence_index": sentence,
        "sentence_text": text,
        "format": fmt,
    }
    streaming = config["stream_audio"]
    start_sent = False
    total = 0
    failed = False
    try:
        plan = plan_speech(
            gpu,
            text,
            voice=config["voice"],
            speed=config["speed"],
            max_new_tokens=config["max_new_tokens"],
            initial_chunk=config["initial"],
            ref_audio=config["ref_audio"],
            instructions=config["instructions"],
        )
        if not streaming:
            await ch.send_json(start)
            start_sent = True
            async with aclosing(speak(gpu, plan, faults, per_chunk=False)) as chunks:
                parts = [pcm async for pcm, _ in chunks]
            audio = b"".join(parts)
            if fmt == "wav":
                audio = wav_header(plan.audio.sample_rate, len(audio)) + audio
            action = await faults.before_chunk()
            if action == "drop":
                raise InjectedDrop()
            if action == "error":
                raise InjectedError()
            await ch.send_bytes(audio)
            total = len(audio)
        else:
            async with aclosing(speak(gpu, plan, faults)) as chunks:
                async for pcm, _ in chunks:
                    if not start_sent:
                        start |= {"sample_rate": plan.audio.sample_rate, "channels": 1}
                        await ch.send_json(start)
                        start_sent = True
                    await ch.send_bytes(pcm)
                    total += len(pcm)
    except InjectedDrop:
        await gpu.drop(scope)
        raise ChannelClosed() from None
    except EngineStopped:
        await ch.close(1012, "simulated GPU shutting down")
        raise ChannelClosed() from None
    except (InjectedError, ValueError) as exc:
        failed = True
        if not start_sent:
            await ch.send_json(start)
            start_sent = True
        extra = {"partial_audio": True, "action": "discard"} if total else {}
        await _error(
            ch, f"Generation failed for utterance {utterance}, sentence {sentence}: {exc}", **extra
        )
    if not start_sent:
        await ch.send_json(start)
    await ch.send_json(
        {
            "type": "audio.done",
            "utterance_index": utterance,
            "sentence_index": sentence,
            "total_bytes": total,
            "error": failed,
        }
    )
