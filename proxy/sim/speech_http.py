"""vLLM-Omni ``POST /v1/audio/speech``: SSE, raw pcm/wav streaming, and non-streaming.

Request semantics follow vLLM-Omni's ``OpenAICreateSpeechRequest``: ``stream_format
="audio"`` streams raw bytes; ``stream=true`` or ``stream_format="sse"`` streams
``speech.audio.delta`` events; otherwise the whole file is returned. Streaming needs
``response_format`` pcm or wav (wav: the first bytes are a RIFF header with
0xFFFFFFFF sizes) and speed 1.0. The simulator renders only wav and pcm; other formats
are refused with a 400 that says so.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from proxy.sim.audio import wav_header
from proxy.sim.common import error_body, error_response, unavailable_response
from proxy.sim.engine_runner import EngineStopped
from proxy.sim.faults import StreamFaults
from proxy.sim.tts import InjectedDrop, InjectedError, SpeechPlan, plan_speech, speak

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["create_speech", "parse_speech_request"]

MAX_BODY_BYTES = 16 * 1024 * 1024
_FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
_MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm"}


@dataclass(slots=True)
class SpeechRequest:
    text: str
    voice: str | None
    response_format: str
    sample_rate: int | None
    speed: float
    mode: str  #: "sse", "audio" or "file"
    max_new_tokens: int | None
    initial_chunk: int | None
    ref_audio: str | None
    instructions: str | None


def _opt_int(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"'{name}' must be an integer >= {low}")
    return value


def parse_speech_request(body: Any, served_model: str) -> SpeechRequest:
    """Validate a speech request body; ``ValueError`` (400) or ``LookupError`` (404)."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("'input' must be a non-empty string")
    model = body.get("model")
    if model is not None and model != served_model:
        raise LookupError(f"The model `{model}` does not exist.")
    voice = body.get("voice", body.get("speaker"))
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and not isinstance(voice, str):
        raise ValueError("'voice' must be a string")
    fmt = body.get("response_format", "wav")
    if fmt not in _FORMATS:
        raise ValueError(f"'response_format' must be one of {', '.join(_FORMATS)}")
    stream = body.get("stream", False)
    stream_format = body.get("stream_format")
    if not isinstance(stream, bool) or stream_format not in (None, "sse", "audio"):
        raise ValueError("'stream' must be a boolean and 'stream_format' 'sse' or 'audio'")
    mode = "audio" if stream_format == "audio" else "sse" if stream or stream_format else "file"
    speed = body.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4:
        raise ValueError("'speed' must be a number within 0.25..4.0")
    if mode != "file" and fmt not in ("pcm", "wav"):
        raise ValueError(
            "Streaming (stream=true, stream_format='audio', or stream_format='sse') requires "
            f"response_format='pcm' or 'wav'. Got response_format='{fmt}'."
        )
    if mode != "file" and speed != 1.0:
        raise ValueError("HTTP streaming requires speed=1.0")
    if fmt not in ("pcm", "wav"):
        raise ValueError(
            f"response_format '{fmt}' is not rendered by headroom sim; use 'wav' or 'pcm'"
        )
    sample_rate = _opt_int(body, "sample_rate", 1)
    if sample_rate is not None and not 8000 <= sample_rate <= 48000:
        raise ValueError("'sample_rate' must be within 8000..48000 Hz")
    ref_audio = body.get("ref_audio")
    instructions = body.get("instructions")
    return SpeechRequest(
        text=text,
        voice=voice,
        response_format=fmt,
        sample_rate=sample_rate,
        speed=float(speed),
        mode=mode,
        max_new_tokens=_opt_int(body, "max_new_tokens", 1),
        initial_chunk=_opt_int(body, "initial_codec_chunk_frames", 0),
        ref_audio=ref_audio if isinstance(ref_audio, str) else None,
        instructions=instructions if isinstance(instructions, str) else None,
    )


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _usage(plan: SpeechPlan, tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": plan.prompt_tokens,
        "output_tokens": tokens,
        "total_tokens": plan.prompt_tokens + tokens,
        "input_token_details": {"text_tokens": plan.prompt_tokens, "audio_tokens": 0},
    }


async def create_speech(gpu: SimGpu, request: Request) -> Response:
    """The endpoint."""
    if gpu.faults.handshake_503:
        return unavailable_response()
    if gpu.preset.kind != "tts":
        return error_response(
            f"This simulated GPU serves the speech-recognition model {gpu.preset.model}; "
            "/v1/audio/speech needs a TTS preset.",
            404,
        )
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return error_response("request body too large", 413)
    try:
        req = parse_speech_request(json.loads(raw), gpu.preset.model)
        plan = plan_speech(
            gpu,
            req.text,
            voice=req.voice,
            sample_rate=req.sample_rate,
            speed=req.speed,
            max_new_tokens=req.max_new_tokens,
            initial_chunk=req.initial_chunk,
            ref_audio=req.ref_audio,
            instructions=req.instructions,
        )
    except json.JSONDecodeError:
        return error_response("Invalid JSON body", 400)
    except LookupError as exc:
        return error_response(str(exc), 404, "model")
    except ValueError as exc:
        return error_response(str(exc), 400)
    faults = gpu.stream_faults()
    rate = plan.audio.sample_rate
    if req.mode == "file":
        return await _whole_file(gpu, request, plan, req, faults)

    async def body() -> AsyncIterator[bytes]:
        tokens = 0
        first = True
        try:
            async with aclosing(speak(gpu, plan, faults)) as chunks:
                async for pcm, made in chunks:
                    tokens = made
                    if first and req.response_format == "wav":
                        pcm = wav_header(rate) + pcm
                    first = False
                    if req.mode == "audio":
                        yield pcm
                    else:
                        yield _sse(
                            {
                                "type": "speech.audio.delta",
                                "audio": base64.b64encode(pcm).decode("ascii"),
                                "response_format": req.response_format,
                            }
                        )
        except InjectedDrop:
            await gpu.drop(request.scope)
            return
        except (InjectedError, EngineStopped, ValueError) as exc:
            if req.mode == "sse":
                status = 400 if isinstance(exc, ValueError) else 500
                yield _sse({"type": "speech.audio.error", **error_body(str(exc), status)})
            else:
                await gpu.drop(request.scope)  # raw audio has no way to say it failed
            return
        if req.mode == "sse":
            yield _sse({"type": "speech.audio.done", "usage": _usage(plan, tokens)})

    media = "text/event-stream" if req.mode == "sse" else _MEDIA[req.response_format]
    headers = {"Cache-Control": "no-cache", "X-Sample-Rate": str(rate)}
    return StreamingResponse(body(), media_type=media, headers=headers)


async def _whole_file(
    gpu: SimGpu, request: Request, plan: SpeechPlan, req: SpeechRequest, faults: StreamFaults
) -> Response:
    """Non-streaming: the whole file is one chunk as far as faults are concerned."""
    parts: list[bytes] = []
    try:
        async with aclosing(speak(gpu, plan, faults, per_chunk=False)) as chunks:
            async for pcm, _ in chunks:
                parts.append(pcm)
        action = await faults.before_chunk()
    except ValueError as exc:
        return error_response(str(exc), 400)
    except EngineStopped as exc:
        return error_response(str(exc), 503)
    if action == "drop":
        await gpu.drop(request.scope)
        return Response(b"")
    if action == "error":
        return error_response(str(InjectedError()), 500)
    pcm = b"".join(parts)
    if req.response_format == "wav":
        pcm = wav_header(plan.audio.sample_rate, len(pcm)) + pcm
    return Response(pcm, media_type=_MEDIA[req.response_format])
