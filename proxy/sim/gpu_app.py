"""The ASGI app of one simulated GPU: every upstream endpoint plus the admin API.

===========================================  ===========================================
``POST /v1/audio/speech``                    vLLM-Omni speech (SSE, raw pcm/wav, file)
``WS /v1/audio/speech/stream``               vLLM-Omni streaming speech
``WS /v1/realtime``                          vLLM realtime ASR (omni audio-out on TTS)
``POST /v1/audio/transcriptions``            vLLM transcription (multipart; SSE)
``POST /v1/completions``, ``/v1/chat/...``    TTS codec tokens as text (Orpheus on vLLM)
``GET /ping``                                SageMaker health check
``WS /invocations-bidirectional-stream``     SageMaker bidirectional streaming
``GET /metrics``                             vLLM metric names
``GET /health``, ``GET /v1/models``          as vLLM
``GET|POST|DELETE /sim/faults[?gpu=N]``      read, change, clear the faults
``GET /sim/stats``                           engine snapshot (JSON)
``GET|POST|DELETE /sim/bypass[?gpu=N]``      streams no gateway admitted (``streams``)
``GET|POST|DELETE /sim/metrics_page[?gpu=N]`` ``/metrics`` honest, NaN or dripping
===========================================  ===========================================

The SageMaker WebSocket runs the endpoint named by ``X-Amzn-SageMaker-Model-
Invocation-Path`` (default: ``/v1/realtime`` on an ASR preset, else
``/v1/audio/speech/stream``), with binary frames read as UTF-8 text like the AWS
sample bridge.

A handshake the simulator refuses on purpose (the ``handshake_503`` fault, an unknown
invocation path) is answered with an HTTP response through the ASGI WebSocket denial
response. uvicorn's websockets-sansio implementation before 0.55 then logs "ASGI
callable returned without completing handshake" at ERROR although the refusal was
answered. uvicorn runs the app in one task per connection and logs the app's outcome in
that same task, so :func:`refuse_handshake` marks the task once the refusal is sent and
:data:`REFUSAL_LOG_FILTER` (on the ``uvicorn.error`` logger) drops what is logged there
afterwards: a record is recognised by where it is logged, not by its text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from proxy.sim.common import ChannelClosed, WsChannel, error_response, unavailable_response
from proxy.sim.completions_api import create_completion
from proxy.sim.engine_metrics import PAGE_MODES
from proxy.sim.realtime_api import realtime
from proxy.sim.speech_http import create_speech
from proxy.sim.speech_ws_api import speech_stream
from proxy.sim.transcription import create_transcription

if TYPE_CHECKING:
    from proxy.sim.gpu import SimGpu

__all__ = ["INVOCATION_PATH_HEADER", "REFUSAL_LOG_FILTER", "build_app", "refuse_handshake"]

INVOCATION_PATH_HEADER = "x-amzn-sagemaker-model-invocation-path"
_ADMIN_BODY_LIMIT = 4096  # bytes of an admin request's JSON body
#: Set in a connection's task once the simulator has answered its handshake with a refusal.
_REFUSED: ContextVar[bool] = ContextVar("sim_refused_handshake", default=False)


class _RefusalLogFilter(logging.Filter):
    """Drops the records logged in the task of a handshake already refused on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _REFUSED.get()


REFUSAL_LOG_FILTER = _RefusalLogFilter()


async def refuse_handshake(websocket: WebSocket, response: Response) -> None:
    """Answer the handshake with ``response``, then mark this connection's task (see the
    module docstring). A failure to send is not marked and is logged as usual."""
    await websocket.send_denial_response(response)
    _REFUSED.set(True)


Handler = Callable[["SimGpu", WsChannel, Mapping[str, Any]], Awaitable[None]]
_WS_HANDLERS: dict[str, Handler] = {
    "/v1/realtime": realtime,
    "/v1/audio/speech/stream": speech_stream,
}


async def _serve_ws(
    gpu: SimGpu, websocket: WebSocket, handler: Handler, *, binary_as_text: bool = False
) -> None:
    if gpu.faults.handshake_503:
        await refuse_handshake(websocket, unavailable_response())
        return
    await websocket.accept()
    opened = gpu.metrics.websocket_opened()
    channel = WsChannel(websocket, binary_as_text=binary_as_text)
    try:
        await handler(gpu, channel, websocket.scope)
    except ChannelClosed:
        pass
    finally:
        gpu.metrics.websocket_closed(opened)


def _target(gpu: SimGpu, request: Request) -> SimGpu | JSONResponse:
    raw = request.query_params.get("gpu")
    if raw is None:
        return gpu
    try:
        return gpu.cluster[int(raw)]
    except (ValueError, IndexError):
        return error_response(f"no simulated GPU {raw!r} in this cluster", 404, "gpu")


def build_app(gpu: SimGpu) -> Starlette:
    """The app for ``gpu``."""
    model = gpu.preset.model
    started = int(time.time())

    async def speech(request: Request) -> Response:
        return await create_speech(gpu, request)

    async def transcriptions(request: Request) -> Response:
        return await create_transcription(gpu, request)

    async def completions(request: Request) -> Response:
        return await create_completion(gpu, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await create_completion(gpu, request, chat=True)

    async def speech_ws(websocket: WebSocket) -> None:
        await _serve_ws(gpu, websocket, speech_stream)

    async def realtime_ws(websocket: WebSocket) -> None:
        await _serve_ws(gpu, websocket, realtime)

    async def sagemaker_ws(websocket: WebSocket) -> None:
        default = "/v1/realtime" if gpu.preset.kind == "asr" else "/v1/audio/speech/stream"
        path = websocket.headers.get(INVOCATION_PATH_HEADER, default).split("?", 1)[0]
        handler = _WS_HANDLERS.get("/" + path.strip().lstrip("/"))
        if handler is None:
            await refuse_handshake(
                websocket,
                error_response(
                    f"unknown invocation path {path!r}; use one of {', '.join(_WS_HANDLERS)}",
                    404,
                ),
            )
            return
        await _serve_ws(gpu, websocket, handler, binary_as_text=True)

    async def health(request: Request) -> Response:
        return Response(status_code=503 if gpu.faults.unhealthy else 200)

    async def ping(request: Request) -> Response:
        if gpu.faults.unhealthy:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "healthy"})

    async def models(request: Request) -> Response:
        card = {
            "id": model,
            "object": "model",
            "created": started,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": 32768,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        page = gpu.metrics
        if page.page != "slow":
            return Response(page.render(), media_type=CONTENT_TYPE_LATEST)

        async def drip() -> AsyncIterator[bytes]:
            # One byte every drip_s until the mode changes; then the rest at once.
            body = page.render()
            sent = 0
            while page.page == "slow" and sent < len(body) - 1:
                yield body[sent : sent + 1]
                sent += 1
                await asyncio.sleep(page.drip_s)
            yield body[sent:]

        return StreamingResponse(drip(), media_type=CONTENT_TYPE_LATEST)

    async def metrics_page(request: Request) -> Response:
        target = _target(gpu, request)
        if isinstance(target, JSONResponse):
            return target
        page = target.metrics
        if request.method == "DELETE":
            page.page = "honest"
        elif request.method == "POST":
            body = await request.body()
            try:
                if len(body) > _ADMIN_BODY_LIMIT:
                    raise ValueError("the body is too large")
                doc = json.loads(body)
                if not isinstance(doc, dict) or set(doc) - {"page", "drip_s"}:
                    raise ValueError('the body must be {"page": MODE[, "drip_s": S]}')
                mode, drip_s = doc.get("page", page.page), doc.get("drip_s", page.drip_s)
                if mode not in PAGE_MODES:
                    raise ValueError(f"page must be one of {', '.join(PAGE_MODES)}")
                if isinstance(drip_s, bool) or not isinstance(drip_s, int | float):
                    raise ValueError("drip_s must be a number of seconds")
                if not 0 < drip_s <= 60:
                    raise ValueError("drip_s must be above 0 and at most 60")
            except json.JSONDecodeError:
                return error_response("Invalid JSON body", 400)
            except ValueError as exc:
                return error_response(str(exc), 400)
            page.page, page.drip_s = mode, float(drip_s)
        return JSONResponse({"page": page.page, "drip_s": page.drip_s})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "headroom-sim", "preset": gpu.preset.name})

    async def faults(request: Request) -> Response:
        target = _target(gpu, request)
        if isinstance(target, JSONResponse):
            return target
        if request.method == "GET":
            return JSONResponse(target.faults.as_json())
        if request.method == "DELETE":
            new = type(target.faults)()
        else:
            try:
                changes = json.loads(await request.body())
                if not isinstance(changes, dict):
                    raise ValueError("the body must be a JSON object of fault fields")
                new = target.faults.updated(changes)
            except json.JSONDecodeError:
                return error_response("Invalid JSON body", 400)
            except ValueError as exc:
                return error_response(str(exc), 400)
        # Refusing closes only the listener; this request's connection still answers.
        await target.set_faults(new)
        return JSONResponse(new.as_json())

    async def bypass(request: Request) -> Response:
        target = _target(gpu, request)
        if isinstance(target, JSONResponse):
            return target
        if request.method == "DELETE":
            target.bypass.set_count(0)
        elif request.method == "POST":
            body = b""
            async for part in request.stream():
                body += part
                if len(body) > _ADMIN_BODY_LIMIT:
                    return error_response("The body is too large", 413)
            try:
                doc = json.loads(body)
                if not isinstance(doc, dict) or set(doc) - {"streams", "audio_s"}:
                    raise ValueError('the body must be {"streams": N[, "audio_s": S]}')
                streams, audio_s = doc.get("streams"), doc.get("audio_s")
                if not isinstance(streams, int) or isinstance(streams, bool):
                    raise ValueError("streams must be an integer")
                if audio_s is not None and (
                    not isinstance(audio_s, int | float) or isinstance(audio_s, bool)
                ):
                    raise ValueError("audio_s must be a number of seconds")
                target.bypass.set_count(streams, audio_s)
            except json.JSONDecodeError:
                return error_response("Invalid JSON body", 400)
            except ValueError as exc:
                return error_response(str(exc), 400)
        return JSONResponse({"streams": target.bypass.count, "audio_s": target.bypass.audio_s})

    async def stats(request: Request) -> Response:
        target = _target(gpu, request)
        if isinstance(target, JSONResponse):
            return target
        return JSONResponse(target.stats_json())

    routes = [
        Route("/v1/audio/speech", speech, methods=["POST"]),
        WebSocketRoute("/v1/audio/speech/stream", speech_ws),
        WebSocketRoute("/v1/realtime", realtime_ws),
        Route("/v1/audio/transcriptions", transcriptions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/ping", ping, methods=["GET"]),
        WebSocketRoute("/invocations-bidirectional-stream", sagemaker_ws),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/sim/faults", faults, methods=["GET", "POST", "DELETE"]),
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/bypass", bypass, methods=["GET", "POST", "DELETE"]),
        Route("/sim/metrics_page", metrics_page, methods=["GET", "POST", "DELETE"]),
    ]
    return Starlette(routes=routes)
