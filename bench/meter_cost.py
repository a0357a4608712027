"""CPU cost of metering per relayed chunk: adapter + session meter + Prometheus sink.

Run: ``python bench/meter_cost.py [--seconds 0.5]``. For each stream shape it measures
process CPU time per chunk with metering on (what the relay will call per chunk) and off
(just iterating the frames, the floor every relay pays anyway) and prints a table.
Everything is synthetic and in-process; each measurement is the best of three runs that
together take about ``--seconds`` of CPU (about 10 s in all by default).

Shapes: 9.6 KB binary PCM frames (vllm-omni-speech-ws, 0.2 s at 24 kHz), the same audio
as base64 JSON deltas (openai-realtime ``response.output_audio.delta``; also with ``\\/``
escapes, which take the json.loads fallback), SSE ``speech.audio.delta`` events split
across two TCP chunks (openai-speech-http), ASR text deltas, and the meter alone: once for
one session at a time, and once for 500 sessions fed in turn, as a busy relay feeds them
(in this synthetic loop that costs no more: the relay's extra per-chunk cost comes from
everything else it touches per session).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/meter_cost.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.metering.adapters import AudioFormat, http_adapter, ws_adapter
from proxy.metering.rolling import ReplicaSignals
from proxy.metering.series import Metrics
from proxy.metering.session_meter import PrometheusReplicaSink, SessionMeter

FORMAT = AudioFormat(24000, 1, 2)
FRAME = bytes(range(256)) * 37 + bytes(128)  # 9600 bytes = 0.2 s of 24 kHz PCM16
SESSION_CHUNKS = 250  # a new session (and a finish()) every 250 chunks
STEP = 0.1  # arrival spacing: 2x realtime


def make_sink() -> PrometheusReplicaSink:
    return PrometheusReplicaSink(Metrics(), "tts", "gpu0", ReplicaSignals())


# A scenario turns (sink factory) into (per-chunk callable over frames, frames).
Feed = Callable[[float, Any], None]


def ws_binary(meter: SessionMeter) -> Feed:
    adapter = ws_adapter("vllm-omni-speech-ws", meter, FORMAT)
    return lambda now, frame: adapter.upstream_binary(now, frame)


def ws_text(protocol: str) -> Callable[[SessionMeter], Feed]:
    def build(meter: SessionMeter) -> Feed:
        adapter = ws_adapter(protocol, meter, FORMAT)
        return lambda now, frame: adapter.upstream_text(now, frame)

    return build


def http_chunks(content_type: str) -> Callable[[SessionMeter], Feed]:
    def build(meter: SessionMeter) -> Feed:
        adapter = http_adapter("openai-speech-http", meter, FORMAT)
        adapter.request("POST", {}, "application/json", b'{"stream": true}')
        adapter.response_start(200, {"content-type": content_type})
        return lambda now, chunk: adapter.response_chunk(now, chunk)

    return build


def meter_only(meter: SessionMeter) -> Feed:
    return lambda now, seconds: meter.audio(now, 0.2)


class NullMeter:
    """Takes the adapter's calls and does nothing: isolates the adapter's own cost. A
    meter of its own, not a SessionMeter subclass: the meter may be compiled
    (proxy/speedups.py), and compiled classes take no interpreted subclasses."""

    def __init__(self, admitted_at: float, sink: object) -> None:
        pass

    def audio(self, now: float, seconds: float) -> None:
        pass

    def event(self, now: float) -> None:
        pass

    def utterance_end(self, now: float) -> None:
        pass

    def response_end(self, now: float) -> None:
        pass

    def commit_final(self, now: float) -> None:
        pass

    def transcript_final(self, now: float) -> None:
        pass

    def finish(self, now: float) -> None:
        pass


def run_on(
    build: Callable[[SessionMeter], Feed],
    frames: Sequence[object],
    budget: float,
    adapter_only: bool = False,
) -> float:
    """Process-CPU µs per frame with metering on (or only the adapter, into a null meter)."""
    sink = make_sink()
    done, started = 0, time.process_time()
    now = 0.0
    while True:
        meter: Any = (NullMeter if adapter_only else SessionMeter)(now, sink)
        feed = build(meter)
        for i in range(SESSION_CHUNKS):
            now += STEP
            feed(now, frames[i % len(frames)])
        meter.finish(now)
        done += SESSION_CHUNKS
        elapsed = time.process_time() - started
        if elapsed >= budget:
            return elapsed / done * 1e6


def run_interleaved(sessions: int, budget: float) -> float:
    """Process-CPU µs per chunk of the meter alone, ``sessions`` meters fed in turn."""
    sink = make_sink()
    done, started = 0, time.process_time()
    now = 0.0
    while True:
        meters = [SessionMeter(now, sink) for _ in range(sessions)]
        for _ in range(SESSION_CHUNKS):
            for meter in meters:  # each session still sees one chunk per STEP
                now += STEP / sessions
                meter.audio(now, 0.2)
        for meter in meters:
            meter.finish(now)
        done += SESSION_CHUNKS * sessions
        elapsed = time.process_time() - started
        if elapsed >= budget:
            return elapsed / done * 1e6


def run_off(frames: Sequence[object], budget: float) -> float:
    """Process-CPU µs per frame just iterating the frames (no metering)."""
    done, started = 0, time.process_time()
    sink: list[object] = []
    while True:
        now = 0.0
        for i in range(SESSION_CHUNKS):
            now += STEP
            sink.append(frames[i % len(frames)])
        sink.clear()
        done += SESSION_CHUNKS
        elapsed = time.process_time() - started
        if elapsed >= budget:
            return elapsed / done * 1e6


def scenarios() -> list[tuple[str, Callable[[SessionMeter], Feed], Sequence[object]]]:
    b64 = base64.b64encode(FRAME).decode()
    delta = json.dumps(
        {"type": "response.output_audio.delta", "event_id": "event_1", "response_id": "resp_1",
         "item_id": "item_1", "output_index": 0, "content_index": 0, "delta": b64}
    )  # fmt: skip
    escaped = delta.replace("/", "\\/")
    sse = f"event: speech.audio.delta\ndata: {json.dumps({'audio': b64})}\n\n".encode()
    half = len(sse) // 2
    text = json.dumps({"type": "transcription.delta", "delta": "hello there"})
    return [
        ("binary PCM 9.6 KB (speech-ws)", ws_binary, [FRAME]),
        ("base64 JSON delta 12.8 KB (realtime)", ws_text("openai-realtime"), [delta]),
        ("  same, '\\/'-escaped (fallback)", ws_text("openai-realtime"), [escaped]),
        ("SSE delta in 2 TCP chunks (speech-http)", http_chunks("text/event-stream"),
         [sse[:half], sse[half:]]),
        ("raw PCM 9.6 KB (speech-http)", http_chunks("audio/pcm"), [FRAME]),
        ("ASR text delta (vllm-realtime)", ws_text("vllm-realtime"), [text]),
        ("meter + Prometheus sink only", meter_only, [0.2]),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="CPU budget per row")
    args = parser.parse_args(argv)
    print("CPU µs per chunk; off = iterating frames only, adapter = adapter into a null meter,")
    print("on = adapter + SessionMeter + PrometheusReplicaSink (+ ReplicaSignals)\n")
    print(f"{'stream shape':42} {'off':>7} {'adapter':>8} {'on':>7} {'on - off':>9}")
    third = args.seconds / 3  # best of three runs: other load on the machine only adds
    run_on(ws_binary, [FRAME], 0.05)  # warm-up: imports, first registry, caches
    for name, build, frames in scenarios():
        off = min(run_off(frames, third) for _ in range(3))
        adapter = min(run_on(build, frames, third, adapter_only=True) for _ in range(3))
        on = min(run_on(build, frames, third) for _ in range(3))
        print(f"{name:42} {off:7.2f} {adapter:8.2f} {on:7.2f} {on - off:9.2f}")
    off = min(run_off([0.2], third) for _ in range(3))
    on = min(run_interleaved(500, max(third, 0.5)) for _ in range(3))
    name = "  same, 500 sessions in turn"
    print(f"{name:42} {off:7.2f} {'':8} {on:7.2f} {on - off:9.2f}")


if __name__ == "__main__":
    main()
