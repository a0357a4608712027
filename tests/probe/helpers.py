"""Build probe traces the way the probe does: through Headroom's adapters and meter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from proxy.metering import AudioFormat, ws_adapter
from proxy.probe.analysis import LevelStats, LevelWindow, SessionTrace, level_stats
from proxy.probe.ceiling import summarize
from proxy.probe.probe_session import ClientOptions, SessionRecorder
from proxy.probe.ramp import LevelRun, ProbeResult, ProbeSettings
from proxy.probe.traces import read_traces
from proxy.probe.workload import bundled

DATA = Path(__file__).parent / "data"


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tts_trace(
    start: float,
    chunks: Sequence[tuple[float, float]],
    *,
    end: float | None = None,
    outcome: str = "ok",
) -> SessionTrace:
    """A speech-WS session admitted at ``start`` receiving ``(at, audio_s)`` chunks
    (24 kHz PCM16 binary frames), metered by the real adapter and meter."""
    clock = FakeClock(start)
    rec = SessionRecorder(clock)
    adapter = ws_adapter("vllm-omni-speech-ws", rec.meter, AudioFormat(24000))
    adapter.client_text(start, '{"type": "input.done"}')
    adapter.upstream_text(start, '{"type": "audio.start", "format": "pcm"}')
    for at, audio_s in chunks:
        adapter.upstream_binary(at, b"\0" * round(audio_s * 48000))
    clock.now = end if end is not None else (chunks[-1][0] if chunks else start)
    return rec.close(outcome)  # type: ignore[arg-type]


def asr_trace(
    start: float,
    events: Sequence[float],
    audio_sent_s: float,
    *,
    end: float | None = None,
    outcome: str = "ok",
) -> SessionTrace:
    """A vllm-realtime session: ``transcription.delta`` events at the given times."""
    clock = FakeClock(start)
    rec = SessionRecorder(clock)
    adapter = ws_adapter("vllm-realtime", rec.meter, AudioFormat(16000))
    for at in events:
        adapter.upstream_text(at, '{"type": "transcription.delta", "delta": "word "}')
    rec.audio_sent_s = audio_sent_s
    clock.now = end if end is not None else (events[-1] if events else start)
    return rec.close(outcome)  # type: ignore[arg-type]


def steady(start: float, first: float, gap: float, audio_s: float, n: int) -> SessionTrace:
    """A TTS stream: a first chunk at ``first``, then ``n`` chunks every ``gap`` s."""
    chunks = [(first, audio_s)] + [(first + gap * (i + 1), audio_s) for i in range(n)]
    return tts_trace(start, chunks)


def recorded(name: str, threshold: float = 1.2) -> list[tuple[LevelWindow, LevelStats]]:
    """A recorded run (``tests/probe/data/NAME.jsonl``) analysed level by level."""
    kind = "asr" if name.startswith("asr") else "tts"
    out = []
    for window, traces, share in read_traces(DATA / f"{name}.jsonl"):
        stats = level_stats(window, traces, threshold=threshold, kind=kind, share=share)
        out.append((window, stats))
    return out


def recorded_result(name: str = "tts-c2") -> ProbeResult:
    """A whole :class:`ProbeResult` from a recorded run, no network needed."""
    kind = "asr" if name.startswith("asr") else "tts"
    protocol = "vllm-realtime" if kind == "asr" else "vllm-omni-speech-ws"
    path = "/v1/realtime" if kind == "asr" else "/v1/audio/speech/stream"
    settings = ProbeSettings(
        client=ClientOptions(url=f"ws://gpu0.example:8000{path}", protocol=protocol),
        workload=bundled(kind),
        hold_s=4.0,
        warmup_s=1.5,
    )
    runs = []
    for window, traces, share in read_traces(DATA / f"{name}.jsonl"):
        stats = level_stats(window, traces, threshold=1.2, kind=settings.kind, share=share)
        runs.append(LevelRun(window, tuple(traces), stats, share))
    summary = summarize([r.stats for r in runs], 1.2)
    return ProbeResult(settings, summary, tuple(runs), started_at=1.7e9, duration_s=31.5)
