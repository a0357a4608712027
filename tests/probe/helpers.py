"""Build probe traces the way the probe does: through Headroom's adapters and meter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from proxy.metering.adapters import AudioFormat, ws_adapter
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
    opened: float | None = None,
) -> SessionTrace:
    """A speech-WS session started at ``start`` receiving ``(at, audio_s)`` chunks
    (24 kHz PCM16 binary frames), metered by the real adapter and meter; the target
    opened its stream at ``opened`` (None: not recorded)."""
    clock = FakeClock(start)
    rec = SessionRecorder(clock)
    if opened is not None:
        rec.opened(opened)
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


def steady(
    start: float,
    first: float,
    gap: float,
    audio_s: float,
    n: int,
    *,
    opened: float | None = None,
) -> SessionTrace:
    """A TTS stream: a first chunk at ``first``, then ``n`` chunks every ``gap`` s."""
    chunks = [(first, audio_s)] + [(first + gap * (i + 1), audio_s) for i in range(n)]
    return tts_trace(start, chunks, opened=opened)


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


def result_of(
    levels: Sequence[tuple[LevelWindow, Sequence[SessionTrace]]], **settings: object
) -> ProbeResult:
    """A :class:`ProbeResult` of the given levels, analysed with the settings' rules (the
    defaults: stalls and TTFA judged) as a run would; ``settings`` override
    :class:`ProbeSettings` fields."""
    probe = ProbeSettings(
        client=ClientOptions(
            url="ws://headroom.example:8080/v1/audio/speech/stream",
            protocol="vllm-omni-speech-ws",
        ),
        workload=bundled("tts"),
        **settings,  # type: ignore[arg-type]
    )
    runs = []
    for window, traces in levels:
        stats = level_stats(
            window,
            traces,
            threshold=probe.threshold,
            max_stall_share=probe.max_stall_share,
            ttfa_limit_s=probe.ttfa_limit_s,
        )
        runs.append(LevelRun(window, tuple(traces), stats))
    summary = summarize([r.stats for r in runs], probe.threshold)
    return ProbeResult(probe, summary, tuple(runs), started_at=1.7e9, duration_s=120.0)


def queued_level(
    level: int, phase: str, *, wait_s: float, engine_s: float = 0.29, gap: float = 1.25
) -> tuple[LevelWindow, list[SessionTrace]]:
    """A level of ``level`` streams that each waited ``wait_s`` before the target opened
    them (a gateway's queue), then got first audio ``engine_s`` later and 2 s chunks every
    ``gap`` s (1.6x at 1.25 s): the window is [10, 40]."""
    window = LevelWindow(level, 0.0, 10.0, 40.0, phase=phase)
    traces = []
    for i in range(level):
        for start in (1.0 + i * 0.1, 12.0 + i * 0.1):
            opened = start + wait_s
            traces.append(steady(start, opened + engine_s, gap, 2.0, 12, opened=opened))
    return window, traces
